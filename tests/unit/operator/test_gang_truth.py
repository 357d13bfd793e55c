"""GangScheduled says what is true: True only while the model's gang pods are in their PodGroups, False with
the cause and the fix when they are not (the chart's admission policy missing), and a gang partly bound (some
pods holding nodes and accelerators, others refused) is named, with what it holds, in GangScheduled, Ready and an
Event. And where it can, the operator puts the pods of a revision's pair in their PodGroup itself. Pure: the
status and planner functions over censuses of pods in, out of and half in their groups (tests/fixtures/world.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from disagg_connector import contract
from disagg_operator import cache, events, gangs, planner, render
from disagg_operator import status as status_mod
from disagg_operator.cli import main
from disagg_operator.config import RenderDefaults
from disagg_operator.render import engine, gang
from disagg_operator.state import Observed

from tests.fixtures.models import REPO, load_example
from tests.fixtures.planner import NOW, cond
from tests.fixtures.world import children, desired, engine_pods, with_role_status

# Decode engines of two 8-GPU pods (one LWS group each), prefill one 8-GPU pod: a revision's pair is the prefill
# pod and decode group 0 (3 pods); group 1 is a gang of its own.
SPANNING = desired({"prefill": {"parallelism": {"tensor": 8}, "accelerator": {"count": 8}},
                    "decode": {"replicas": 2, "parallelism": {"data": 16, "expert": True}, "accelerator": {"count": 8}}})  # fmt: skip
ONE_POD = desired({"prefill": {"parallelism": {"tensor": 8}, "accelerator": {"count": 8}},
                   "decode": {"replicas": 2, "parallelism": {"tensor": 8}, "accelerator": {"count": 8}}})  # fmt: skip


def workload(world: Any, role: str) -> dict[str, Any]:
    return next(o for o in world.rendered.objects if o["kind"] in ("Deployment", "LeaderWorkerSet")
                and o["metadata"]["labels"].get(contract.LABEL_ROLE) == role)  # fmt: skip


def observe(world: Any, pods: tuple[dict[str, Any], ...], served: bool = True) -> Observed:
    return with_role_status(Observed(children(world, gangs=served), pods, pod_groups_served=served), world.revision)


def gang_condition(world: Any, observed: Observed) -> dict[str, Any]:
    return cond(planner.plan(world, observed, NOW).status, "GangScheduled")


def test_pods_in_their_groups_are_gang_scheduled() -> None:
    pods = engine_pods(workload(SPANNING, "prefill"), 1, bound=[0]) + engine_pods(workload(SPANNING, "decode"), 2, bound=[0, 1])
    said = gang_condition(SPANNING, observe(SPANNING, pods))
    assert (said["status"], said["reason"]) == ("True", "PodGroups"), said


def test_lws_pods_outside_their_groups_say_so_and_how_to_fix_it() -> None:
    """The chart's policy missing: the LWS's pods name no PodGroup (the prefill pod's template could name its pair,
    but the pair's decode half is LWS group 0, which only the policy can put there)."""
    pods = engine_pods(workload(SPANNING, "prefill"), 1, in_group=False) + engine_pods(workload(SPANNING, "decode"), 2, in_group=False)
    said = gang_condition(SPANNING, observe(SPANNING, pods))
    assert (said["status"], said["reason"]) == ("False", "PodsOutsideGroups"), said
    lws = workload(SPANNING, "decode")["metadata"]["name"]
    assert f"5 of the model's 5 gang pods are not in their PodGroup: " in said["message"]
    assert f"{lws}-0 (in none, not {contract.pair_pod_group_name('m', SPANNING.revision)})" in said["message"]
    assert "and 1 more" in said["message"]
    assert gang.POLICY_COMMAND in said["message"] and "gangScheduling.admissionPolicy.enabled" in said["message"]


def test_a_partly_bound_group_is_named_with_the_gpus_it_holds_in_gang_scheduled_ready_and_an_event() -> None:
    """The issue's cluster: the pair's prefill pod and decode group 0's leader bound, its worker refused (no GPU
    left), no pod in a PodGroup: 16 GPUs held by a pair that serves nothing."""
    decode = workload(SPANNING, "decode")
    lws = decode["metadata"]["name"]
    pods = engine_pods(workload(SPANNING, "prefill"), 1, in_group=False, bound=[0])
    group0 = engine_pods(decode, 1, in_group=False)
    pods += ({**group0[0], "spec": {**group0[0]["spec"], "nodeName": "kwok-p5en-3"}},
             engine_pods(decode, 1, in_group=False, unschedulable=[0])[1])  # fmt: skip
    observed = observe(SPANNING, pods)
    plan = planner.plan(SPANNING, observed, NOW)
    pair = contract.pair_pod_group_name("m", SPANNING.revision)

    said = cond(plan.status, "GangScheduled")
    assert (said["status"], said["reason"]) == ("False", "PartlyBound"), said
    assert said["message"].startswith(f"{pair} is partly bound: 2 of its 3 pods hold 16 nvidia.com/gpu (")
    assert f"{lws}-0 on kwok-p5en-3" in said["message"] and f"while {lws}-0-1 cannot be scheduled" in said["message"]
    assert "why: 3 of the model's 3 gang pods are not in their PodGroup" in said["message"]  # the cause, and its fix

    ready = cond(plan.status, "Ready")
    assert ready["status"] == "False" and f"{pair} is partly bound" in ready["message"] and "16 nvidia.com/gpu" in ready["message"]
    before = cond(planner.plan(SPANNING, observe(SPANNING, ()), NOW).status, "GangScheduled")
    assert before["status"] == "True"  # no pod yet: none outside
    recorded = events.of_status({"conditions": [before]}, plan.status)
    assert [(e.reason, e.type) for e in recorded if e.reason == "PartlyBound"] == [("PartlyBound", "Warning")]
    assert "16 nvidia.com/gpu" in next(e.note for e in recorded if e.reason == "PartlyBound")
    # once said, not again on the next pass
    assert not [e for e in events.of_status(plan.status, planner.plan(SPANNING, observed, NOW).status) if e.reason == "PartlyBound"]


def test_a_group_waiting_whole_or_bound_whole_is_not_partly_bound() -> None:
    decode = workload(SPANNING, "decode")
    pods = (engine_pods(workload(SPANNING, "prefill"), 1, bound=[0])
            + engine_pods(decode, 2, bound=[0], unschedulable=[1]))  # fmt: skip
    membership = gangs.membership(pods)
    assert membership.partly_bound == () and membership.outside == ()
    assert gang_condition(SPANNING, observe(SPANNING, pods))["status"] == "True"


def test_a_pair_of_one_pod_engines_is_partly_bound_until_it_has_an_engine_of_each_role() -> None:
    prefill, decode = workload(ONE_POD, "prefill"), workload(ONE_POD, "decode")
    half = engine_pods(prefill, 1, bound=[0]) + engine_pods(decode, 2, unschedulable=[0, 1])
    (partly,) = gangs.membership(half).partly_bound
    assert partly.group == contract.pair_pod_group_name("m", ONE_POD.revision) and partly.held == {"nvidia.com/gpu": 8}
    # a whole pair bound: a second decode pod waiting is a one-pod engine bound on its own, not a partly bound gang
    whole = engine_pods(prefill, 1, bound=[0]) + engine_pods(decode, 2, bound=[0], unschedulable=[1])
    assert gangs.membership(whole).partly_bound == ()
    # ... unless the role is not to run: then the pair is the prefill alone
    assert gangs.membership(engine_pods(prefill, 1, bound=[0]), roles_to_run=["prefill"]).partly_bound == ()


def test_where_no_pod_groups_are_served_a_partly_bound_group_says_why() -> None:
    decode = workload(SPANNING, "decode")
    leader, worker = engine_pods(decode, 1, in_group=False, unschedulable=[0])
    pods = engine_pods(workload(SPANNING, "prefill"), 1, in_group=False) + ({**leader, "spec": {**leader["spec"], "nodeName": "n1"}}, worker)
    said = gang_condition(SPANNING, observe(SPANNING, pods, served=False))
    assert (said["status"], said["reason"]) == ("False", "PartlyBound"), said
    assert "8 nvidia.com/gpu" in said["message"] and "GenericWorkload" in said["message"]
    quiet = gang_condition(SPANNING, observe(SPANNING, engine_pods(workload(SPANNING, "prefill"), 1, in_group=False), served=False))
    assert (quiet["status"], quiet["reason"]) == ("False", "PodGroupsNotServed")


def test_terminating_pods_are_not_counted() -> None:
    decode = workload(SPANNING, "decode")
    leader, worker = engine_pods(decode, 1, bound=[0])
    gone = {**leader, "metadata": {**leader["metadata"], "deletionTimestamp": NOW}}
    refused = engine_pods(decode, 1, unschedulable=[0])[1]
    assert gangs.membership((gone, refused)).partly_bound == ()


# --- the operator names the pair itself where it can ------------------------------------------------------


def test_one_pod_engines_name_their_revisions_pair_so_the_pair_holds_without_the_policy() -> None:
    plan = planner.plan(ONE_POD, Observed(pod_groups_served=True), NOW)
    pair = contract.pair_pod_group_name("m", ONE_POD.revision)
    engines = [a.obj for a in plan.applies if a.obj["kind"] == "Deployment" and a.obj["metadata"]["labels"].get(contract.LABEL_ROLE) != "router"]
    assert [d["spec"]["template"]["spec"]["schedulingGroup"] for d in engines] == [{"podGroupName": pair}] * 2
    # an LWS's template is every group's: it names none (the policy sends group 0 to the pair, the others to their own)
    spanning = planner.plan(SPANNING, Observed(pod_groups_served=True), NOW)
    assert all("schedulingGroup" not in (a.obj["spec"].get("template") or a.obj["spec"]["leaderWorkerTemplate"]["workerTemplate"])["spec"]
               for a in spanning.applies if a.obj["kind"] in ("Deployment", "LeaderWorkerSet")
               and a.obj["metadata"]["labels"].get(contract.LABEL_ROLE) != "router")  # fmt: skip


def test_the_pair_named_is_part_of_the_revision() -> None:
    """An operator upgrade that starts naming the pair is a new revision, rolled out with drains: never a change
    of a running Deployment's pods in place."""
    model = ONE_POD.model
    transfer = render.plan(model.spec)
    templates = {role: engine.pod_template(model, role, transfer, RenderDefaults()) for role in contract.ENGINE_ROLES}
    assert all(t["spec"]["schedulingGroup"] == {"podGroupName": gang.PAIR_OF_ITS_REVISION} for t in templates.values())
    unnamed = {role: {**t, "spec": {k: v for k, v in t["spec"].items() if k != "schedulingGroup"}} for role, t in templates.items()}
    assert render.revision_of(templates, transfer) == ONE_POD.revision != render.revision_of(unnamed, transfer)


def test_no_pod_group_is_named_where_none_is_served_nor_in_a_running_deployment_made_without_one() -> None:
    plan = planner.plan(ONE_POD, Observed(pod_groups_served=False), NOW)
    assert all(not gang.names_pod_group(a.obj) for a in plan.applies if a.obj["kind"] == "Deployment")
    # made where none was served (the cluster serves them now): kept as made, nothing written
    made = with_role_status(Observed(children(ONE_POD), engine_pods(workload(ONE_POD, "prefill"), 1, in_group=False, bound=[0])
                                     + engine_pods(workload(ONE_POD, "decode"), 2, in_group=False, bound=[0, 1])), ONE_POD.revision)  # fmt: skip
    served = replace(made, children={**made.children, **children(ONE_POD, kinds=["PodGroup"], gangs=True)}, pod_groups_served=True)
    plan = planner.plan(ONE_POD, served, NOW)
    assert [a for a in plan.applies if a.obj["kind"] == "Deployment"] == []
    said = cond(plan.status, "GangScheduled")  # and the model says why its pods are outside, and when that ends
    assert (said["status"], said["reason"]) == ("False", "PodsOutsideGroups") and gang.UNNAMED_HINT in said["message"]


# --- validate and plan: will the gangs hold where they look? ------------------------------------------------


def test_the_outlook_says_what_gangs_need_and_whether_they_hold_on_a_cluster() -> None:
    both = frozenset({contract.GANG_LWS_GROUP, contract.GANG_PAIR})
    assert gangs.outlook(SPANNING.model)[0] is None and "the chart's admission policy" in gangs.outlook(SPANNING.model)[1]
    held, words = gangs.outlook(SPANNING.model, True, both)
    assert held is True and words.startswith("will hold: decode engines span 2 pods")
    held, words = gangs.outlook(SPANNING.model, True, frozenset())
    assert held is False and "disagg.dev/gang=lws-group, disagg.dev/gang=pair" in words and gang.POLICY_COMMAND in words
    assert gangs.outlook(SPANNING.model, False, both)[0] is False
    assert gangs.outlook(SPANNING.model, True, None)[0] is None  # policies not readable: cannot tell
    # one-pod engines name their pair themselves: no policy needed
    assert gangs.outlook(ONE_POD.model, True, frozenset())[0] is True
    assert gangs.outlook(ONE_POD.model, True, None)[0] is True  # nor a policy that could not be read
    assert "the admission policy" not in gangs.outlook(ONE_POD.model)[1]
    apart = desired({"prefill": {"priorityClassName": "batch"}})
    assert gangs.outlook(apart.model, True, frozenset()) == (None, gangs.outlook(apart.model)[1]) and "none" in gangs.outlook(apart.model)[1]


def test_the_operators_cache_keeps_what_membership_reads_of_a_pod() -> None:
    """The census is built from slim copies of the pods (cache.slim_pod): they keep the PodGroup a pod is in and
    what it asks for, or every pod would read as outside its group and a partly bound gang as holding nothing."""
    decode = workload(SPANNING, "decode")
    leader, worker = engine_pods(decode, 1, bound=[0])
    for pod in (leader, {**worker, "spec": {k: v for k, v in worker["spec"].items() if k != "schedulingGroup"}}):
        full, kept = gangs.Member.of(pod), gangs.Member.of(cache.slim_pod(pod))
        assert kept == full and full is not None
    assert gangs.Member.of(cache.slim_pod(leader)).accelerators == {"nvidia.com/gpu": 8}


def test_a_scheduler_error_on_a_gang_is_not_a_silent_wait() -> None:
    """kube-scheduler 1.37 fails a pair's pod-group cycle in which a member cannot be placed for another reason
    (a missing PersistentVolumeClaim) with SchedulerError, and its words lose the reason: Ready names the pods
    and the error, and the claim when the pass found the model's weights claim missing."""
    claimed = desired({"model": {"source": {"uri": "pvc://weights/qwen3"}}})
    error = {"type": "PodScheduled", "status": "False", "reason": "SchedulerError",
             "message": 'error in "DynamicResources" PodGroupPostFilter plugins: not found'}  # fmt: skip
    pods = tuple({**p, "status": {"conditions": [error]}} for p in engine_pods(workload(claimed, "prefill"), 1)
                 + engine_pods(workload(claimed, "decode"), 1))  # fmt: skip
    observed = observe(claimed, pods)
    ready = cond(planner.plan(claimed, observed, NOW).status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Unschedulable") and "the scheduler fails on it" in ready["message"]
    ready = cond(planner.plan(claimed, replace(observed, missing_claim="weights"), NOW).status, "Ready")
    assert ready["reason"] == "Unschedulable" and 'persistentvolumeclaim "weights" not found' in ready["message"]


def test_the_validate_command_says_what_the_gangs_need_and_asks_a_cluster_only_when_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    example = str(REPO / "examples" / "deepseek-v3-p5en-wide-ep.yaml")
    assert main(["validate", "-f", example]) == 0
    out = capsys.readouterr().out
    assert "valid (Push via LIBFABRIC" in out
    assert f"  gangs: {gangs.outlook(desired(load_example(Path(example))['spec']).model)[1]}\n" in out
    assert "the chart's admission policy" in out
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["validate", "--cluster", "-f", example]) == 2
    err = capsys.readouterr().err
    assert "--cluster needs a kubeconfig" in err and "Traceback" not in err


def test_the_slo_autoscaler_counts_a_group_the_scheduler_refuses_as_one_blocked_engine() -> None:
    """Decode group 1's pods (its leader and its worker) cannot be placed: one engine, not two pods, with the
    scheduler's words, is what the autoscaler holds growth for and does not count as capacity."""
    decode = workload(SPANNING, "decode")
    pods = engine_pods(workload(SPANNING, "prefill"), 1, bound=[0]) + engine_pods(decode, 2, bound=[0], unschedulable=[1])
    stuck = status_mod.unschedulable_engines(observe(SPANNING, pods).census, SPANNING.revision)
    assert stuck["prefill"] == (0, "") and stuck["decode"][0] == 1, stuck
    assert "Insufficient nvidia.com/gpu" in stuck["decode"][1] and f"{decode['metadata']['name']}-1" in stuck["decode"][1]
