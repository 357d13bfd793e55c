"""The planner with engines that span pods: a role of LeaderWorkerSet groups counts, rolls out, scales and
retires in engines (groups), never in pods. Pure: the worlds are built as the API server and the LWS
controller would show them (tests/fixtures/world.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from disagg_connector import contract
from disagg_operator import executor, planner
from disagg_operator.state import Observed, RouterView
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from tests.fixtures.planner import MARKED_AT, NOW, act, cond, router
from tests.fixtures.world import children, desired, pod, with_role_status

# Decode DP2 over two one-GPU pods (one LWS group per engine); prefill one pod per engine.
GROUPS = {"decode": {"replicas": 2, "parallelism": {"data": 2, "expert": True}, "accelerator": {"count": 1}}}
TWO = desired(GROUPS)
ONE = desired({**GROUPS, "decode": {**GROUPS["decode"], "replicas": 1}})
NEW_IMAGE = desired({**GROUPS, "engine": {"image": "registry.example/vllm:new"}})


def group_pod(revision: str, group: int, worker: int, ready: bool = True, marked: bool = False) -> dict[str, Any]:
    """A decode pod as the LWS controller makes it: its labels, our template's annotations."""
    lws = contract.engine_deployment_name("m", "decode", revision)
    out = pod("decode", f"{lws}-{group}" + (f"-{worker}" if worker else ""), revision, ready)
    out["metadata"]["labels"].update({contract.LWS_NAME_LABEL: lws, contract.LWS_GROUP_INDEX_LABEL: str(group),
                                      contract.LWS_WORKER_INDEX_LABEL: str(worker)})  # fmt: skip
    out["metadata"]["annotations"] = {contract.ANNOTATION_DP_SIZE: "2", contract.ANNOTATION_DP_SIZE_LOCAL: "1",
                                      **({contract.ANNOTATION_DRAINING: MARKED_AT} if marked else {})}  # fmt: skip
    return out


def groups(revision: str, count: int, not_ready: tuple[tuple[int, int], ...] = (), marked: tuple[int, ...] = ()) -> tuple[dict[str, Any], ...]:
    return tuple(group_pod(revision, g, w, (g, w) not in not_ready, g in marked) for g in range(count) for w in (0, 1))


def world(want: Any, pods: tuple[dict[str, Any], ...], routers: RouterView | None = None, prefill: int = 1,
          gangs: bool = False) -> Observed:  # fmt: skip
    base = (*(pod("prefill", f"p-{want.revision}-{i}", want.revision) for i in range(prefill)),
            *(pod("router", f"r-{i}", None) for i in range(2)))  # fmt: skip
    observed = with_role_status(Observed(children(want, gangs=gangs), base + pods), want.revision)
    return Observed(observed.children, observed.pods, routers=routers, pod_groups_served=gangs or None)


def lws_of(plan: planner.Plan) -> dict[str, Any] | None:
    return next((a.obj for a in plan.applies if a.obj["kind"] == "LeaderWorkerSet"), None)


def test_a_group_with_a_pod_not_ready_is_no_ready_engine() -> None:
    status = planner.plan(TWO, world(TWO, groups(TWO.revision, 2, not_ready=((1, 1),))), NOW).status
    assert status["decode"]["readyReplicas"] == 1 and status["decode"]["replicas"] == 2
    assert cond(status, "Ready")["status"] == "True" and "decode 1/2" in cond(status, "Ready")["message"]

    none_whole = planner.plan(TWO, world(TWO, groups(TWO.revision, 2, not_ready=((0, 0), (1, 1)))), NOW).status
    assert none_whole["decode"]["readyReplicas"] == 0 and cond(none_whole, "Ready")["status"] == "False"


def test_the_role_scaler_counts_engines() -> None:
    plan = planner.plan(TWO, world(TWO, groups(TWO.revision, 2, not_ready=((1, 0),))), NOW)
    (decode,) = [a for a in plan.actions if isinstance(a, planner.SetStatus) and a.obj["metadata"]["name"] == "m-decode"]
    assert (decode.status["replicas"], decode.status["readyReplicas"]) == (2, 1)


def test_scale_in_drains_every_pod_of_the_highest_group_before_the_lws_shrinks() -> None:
    lws_name = contract.engine_deployment_name("m", "decode", TWO.revision)
    first = planner.plan(ONE, world(TWO, groups(TWO.revision, 2)), NOW)
    marks = [(a.obj["metadata"]["name"], a.why) for a in first.actions if isinstance(a, planner.Annotate)]
    assert marks == [(f"{lws_name}-1", "leaving"), (f"{lws_name}-1-1", "leaving")]  # group 1: the LWS removes it
    assert lws_of(first) is None, "the LWS keeps its group until both pods are drained"
    assert set(first.draining) == {f"{lws_name}-1", f"{lws_name}-1-1"} and first.requeue_after

    # One router still has a request on the worker: the group stays, both pods keep draining.
    busy = RouterView((router({f"{lws_name}-1": (0, True), f"{lws_name}-1-1": (1, True)}),), ("r0",))
    held = planner.plan(ONE, world(TWO, groups(TWO.revision, 2, marked=(1,)), busy), NOW)
    assert lws_of(held) is None and not [a for a in held.actions if isinstance(a, planner.Annotate)]
    assert "1 request(s) in flight" in cond(held.status, "Progressing")["message"]

    idle = RouterView((router({f"{lws_name}-1": (0, True), f"{lws_name}-1-1": (0, True)}),), ("r0",))
    done = planner.plan(ONE, world(TWO, groups(TWO.revision, 2, marked=(1,)), idle), NOW)
    shrunk = lws_of(done)
    assert shrunk is not None and shrunk["spec"]["replicas"] == 1
    assert not [a for a in done.actions if isinstance(a, planner.Annotate)], "no deletion cost: LWS picks by index"


def test_a_group_not_ready_leaves_at_once() -> None:
    plan = planner.plan(ONE, world(TWO, groups(TWO.revision, 2, not_ready=((1, 0), (1, 1)))), NOW)
    shrunk = lws_of(plan)
    assert shrunk is not None and shrunk["spec"]["replicas"] == 1 and not plan.draining


def test_a_marked_group_that_stays_after_all_is_unmarked() -> None:
    plan = planner.plan(TWO, world(TWO, groups(TWO.revision, 2, marked=(1,))), NOW)
    assert sorted((a.obj["metadata"]["name"], a.why) for a in plan.actions if isinstance(a, planner.Annotate)) == [
        (f"{contract.engine_deployment_name('m', 'decode', TWO.revision)}-1", "stays"),
        (f"{contract.engine_deployment_name('m', 'decode', TWO.revision)}-1-1", "stays")]


def test_a_group_the_lws_is_removing_keeps_its_marks() -> None:
    """The LWS was shrunk past group 1 and its controller has not deleted the group's pods yet: they keep their
    marks until they go (unmarked, a router would send them new requests in that moment)."""
    plan = planner.plan(ONE, world(ONE, groups(ONE.revision, 2, marked=(1,))), NOW)
    assert not [a for a in plan.actions if isinstance(a, planner.Annotate)], [a.why for a in plan.actions]


def test_a_rollout_surges_in_engines_and_keeps_a_ready_pair() -> None:
    """Image change of a 2-engine multi-pod role: the new LWS gets one group (surge 1 engine, 2 pods), the old
    keeps both groups until the new group is whole and ready."""
    old = world(TWO, groups(TWO.revision, 2))
    first = planner.plan(NEW_IMAGE, old, NOW)
    new_lws = lws_of(first)
    assert new_lws is not None and new_lws["metadata"]["labels"][contract.LABEL_REVISION] == NEW_IMAGE.revision
    assert new_lws["spec"]["replicas"] == 1
    assert not [a for a in first.actions if isinstance(a, (planner.Scale, planner.Annotate))
                and a.obj["metadata"]["labels"].get(contract.LABEL_ROLE) == "decode"]  # fmt: skip

    # The new group is half ready: nothing of the old revision's decode may go yet.
    new_children = {k: v for k, v in children(NEW_IMAGE).items() if k[0] in ("Deployment", "LeaderWorkerSet")}
    half = Observed({**old.children, **new_children}, old.pods + groups(NEW_IMAGE.revision, 1, not_ready=((0, 1),))
                    + (pod("prefill", f"p-{NEW_IMAGE.revision}-0", NEW_IMAGE.revision),))
    waiting = planner.plan(NEW_IMAGE, half, NOW)
    assert not [a for a in waiting.actions if isinstance(a, planner.Annotate)
                and a.obj["metadata"]["labels"].get(contract.LABEL_ROLE) == "decode"]  # fmt: skip
    assert waiting.status["decode"]["readyReplicas"] == 0

    # Whole and ready: one old group drains (the highest), pods of both its workers.
    whole = Observed(half.children, old.pods + groups(NEW_IMAGE.revision, 1)
                     + (pod("prefill", f"p-{NEW_IMAGE.revision}-0", NEW_IMAGE.revision),))
    moving = planner.plan(NEW_IMAGE, whole, NOW)
    old_lws = contract.engine_deployment_name("m", "decode", TWO.revision)
    assert sorted(a.obj["metadata"]["name"] for a in moving.actions if isinstance(a, planner.Annotate)
                  and a.obj["metadata"]["labels"].get(contract.LABEL_ROLE) == "decode") == [f"{old_lws}-1", f"{old_lws}-1-1"]


class NoLwsCluster:
    """A cluster without the LeaderWorkerSet CRD: the dynamic client's discovery finds no such kind."""

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if obj["kind"] == "LeaderWorkerSet":
            raise ResourceNotFoundError(f"No matches found for {{'api_version': '{obj['apiVersion']}', 'kind': 'LeaderWorkerSet'}}")
        return None

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        return self.get(obj) or obj


def test_without_the_lws_crd_nothing_is_written_and_status_says_what_to_install() -> None:
    tentative = planner.plan(TWO, Observed(), NOW)
    probes = executor.probe(tentative, NoLwsCluster(), "uid-1")  # type: ignore[arg-type]
    final = planner.plan(TWO, Observed().with_probes(probes.foreign, probes.refused), NOW)
    assert final.actions == ()
    ready = cond(final.status, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "KindNotInstalled"
    assert "install LeaderWorkerSet" in ready["message"] and "accelerator.count" in ready["message"]
    assert act(tentative)  # the same model with the kind installed would write


# --- gangs: a PodGroup per LeaderWorkerSet group (render/gang.py) -------------------------------------------


def pod_groups_of(plan: planner.Plan, action: type = planner.Apply) -> list[dict[str, Any]]:
    return [a.obj for a in plan.actions if isinstance(a, action) and a.obj["kind"] == "PodGroup"]


def served(observed: Observed, answer: bool | None = True) -> Observed:
    return replace(observed, pod_groups_served=answer)


def test_each_group_gets_its_pod_group_before_its_pods_where_the_cluster_serves_them() -> None:
    """Prefill and decode of different priorities: no pair, so every LWS group has a PodGroup of its own."""
    apart = desired({"decode": {**GROUPS["decode"], "priorityClassName": "engines"}})
    plan = planner.plan(apart, served(Observed()), NOW)
    lws = lws_of(plan)
    assert lws is not None
    pgs = pod_groups_of(plan)
    # named as the admission policy names every pod's group: its leader pod, <lws>-<index>
    assert [pg["metadata"]["name"] for pg in pgs] == [f"{lws['metadata']['name']}-0", f"{lws['metadata']['name']}-1"]
    assert all(pg["spec"]["schedulingPolicy"] == {"gang": {"minCount": 2}} for pg in pgs)  # both pods or none
    assert all(pg["metadata"]["ownerReferences"] == lws["metadata"]["ownerReferences"] for pg in pgs)
    assert [pg["metadata"]["labels"][contract.LWS_GROUP_INDEX_LABEL] for pg in pgs] == ["0", "1"]
    kinds = [a.obj["kind"] for a in plan.applies]
    assert kinds.index("PodGroup") < kinds.index("LeaderWorkerSet")  # a pod may not wait for its PodGroup
    pod_labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    assert pod_labels[contract.LABEL_GANG] == contract.GANG_LWS_GROUP  # what the chart's policy selects
    assert contract.LABEL_POD_GROUP not in pod_labels
    assert cond(plan.status, "GangScheduled")["status"] == "True"


def test_group_0_is_in_its_revisions_pair_with_the_first_prefill() -> None:
    """Roles of one priority: group 0 of the decode LWS and the prefill pods are the revision's pair, one gang of
    one engine of each role (1 + 2 pods); the other groups have their own."""
    plan = planner.plan(TWO, served(Observed()), NOW)
    lws = lws_of(plan)
    assert lws is not None
    pair = contract.pair_pod_group_name("m", TWO.revision)
    # first the pair alone: group 1's pods wait for a PodGroup (outside the scheduler's queue) until it is bound
    assert {pg["metadata"]["name"]: pg["spec"]["schedulingPolicy"]["gang"]["minCount"] for pg in pod_groups_of(plan)} == {pair: 3}
    assert lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"][contract.LABEL_POD_GROUP] == pair
    message = cond(plan.status, "GangScheduled")["message"]
    assert "decode (2 pods) is one PodGroup" in message and "first prefill and decode engines are bound together" in message

    made = {k: o for k, o in children(TWO, gangs=True).items() if k[0] != "PodGroup" or k[1] == pair}
    pending = tuple(group_pod(TWO.revision, g, w, ready=False) for g in range(2) for w in (0, 1))
    assert not pod_groups_of(planner.plan(TWO, served(Observed(made, pending)), NOW))
    # the pair bound (its pods have nodes): group 1 gets its PodGroup
    on_nodes = tuple({**p, "spec": {"nodeName": "n"}} if p["metadata"]["name"].startswith(f"{lws['metadata']['name']}-0") else p
                     for p in pending)  # fmt: skip
    then = pod_groups_of(planner.plan(TWO, served(Observed(made, on_nodes)), NOW))
    assert [pg["metadata"]["name"] for pg in then] == [f"{lws['metadata']['name']}-1"]


def test_a_pod_group_has_its_pods_priority() -> None:
    want = desired({"decode": {**GROUPS["decode"], "priorityClassName": "engines"}})
    pgs = pod_groups_of(planner.plan(want, served(Observed()), NOW))
    assert pgs and all(pg["spec"]["priorityClassName"] == "engines" for pg in pgs)


def test_without_pod_groups_served_none_is_written_and_status_says_so() -> None:
    plan = planner.plan(TWO, served(Observed(), False), NOW)
    assert lws_of(plan) is not None and not pod_groups_of(plan)
    gang = cond(plan.status, "GangScheduled")
    assert (gang["status"], gang["reason"]) == ("False", "PodGroupsNotServed")
    assert "decode (2 pods)" in gang["message"] and "GenericWorkload" in gang["message"]

    def types(status: dict[str, Any]) -> set[str]:
        return {c["type"] for c in status["conditions"]}

    assert "GangScheduled" not in types(planner.plan(TWO, Observed(), NOW).status)  # not asked: not said
    one_pod = desired()  # no engine spans pods: no condition, asked or not
    assert "GangScheduled" not in types(planner.plan(one_pod, served(Observed(), False), NOW).status)


def test_a_group_that_leaves_keeps_its_pod_group_until_its_lws_has_shrunk() -> None:
    lws_name = contract.engine_deployment_name("m", "decode", TWO.revision)
    idle = RouterView((router({f"{lws_name}-1": (0, True), f"{lws_name}-1-1": (0, True)}),), ("r0",))
    shrinking = planner.plan(ONE, world(TWO, groups(TWO.revision, 2, marked=(1,)), idle, gangs=True), NOW)
    assert lws_of(shrinking)["spec"]["replicas"] == 1  # type: ignore[index]
    assert not pod_groups_of(shrinking, planner.Delete)

    shrunk = world(ONE, groups(TWO.revision, 1), gangs=True)  # the LWS at 1; group 1's pods are gone
    leftover = next(o for o in children(TWO, gangs=True).values() if o["metadata"]["name"] == f"{lws_name}-1")
    plan = planner.plan(ONE, replace(shrunk, children={**shrunk.children, ("PodGroup", f"{lws_name}-1"): leftover}), NOW)
    assert [pg["metadata"]["name"] for pg in pod_groups_of(plan, planner.Delete)] == [f"{lws_name}-1"]
    assert not pod_groups_of(plan)  # group 0's stays as it is


def test_an_old_revisions_pod_groups_go_with_its_lws() -> None:
    old_lws = contract.engine_deployment_name("m", "decode", TWO.revision)
    old = {k: o for k, o in children(TWO, gangs=True).items() if k[0] in ("Deployment", "LeaderWorkerSet", "PodGroup")}
    new = world(NEW_IMAGE, groups(NEW_IMAGE.revision, 2), gangs=True)
    # the old revision's pods are all gone: its workloads are retired, its PodGroups with them
    plan = planner.plan(NEW_IMAGE, replace(new, children={**old, **new.children}), NOW)
    retired = [a.obj["metadata"]["name"] for a in plan.actions if isinstance(a, planner.Delete) and a.why == "retired"]
    assert old_lws in retired
    old_pair = contract.pair_pod_group_name("m", TWO.revision)
    assert sorted(pg["metadata"]["name"] for pg in pod_groups_of(plan, planner.Delete)) == sorted([f"{old_lws}-1", old_pair])


def unschedulable(pod_obj: dict[str, Any], message: str) -> dict[str, Any]:
    pod_obj["status"] = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}
    return pod_obj


def test_status_names_the_engine_that_cannot_be_bound_and_what_it_lacks() -> None:
    """Kube-scheduler's words for a gang that does not fit: the member that would fit waits for its group, the
    other lacks GPUs (tests/e2e/test_gang_scheduling.py sees them on the real scheduler)."""
    lws_name = contract.engine_deployment_name("m", "decode", TWO.revision)
    waits = "pod group is unschedulable, minCount (2) cannot be satisfied: 1 scheduled, 0 remaining"
    lacks = "0/6 nodes are available: 4 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node affinity/selector."
    pending = (unschedulable(group_pod(TWO.revision, 0, 0), waits), unschedulable(group_pod(TWO.revision, 0, 1), lacks))
    ready = cond(planner.plan(ONE, world(ONE, pending, gangs=True), NOW).status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InsufficientGPUs")
    assert ready["message"].startswith(f"decode engine {lws_name}/0 (2 pods, bound together or not at all): 2 of its pods")
    assert waits in ready["message"] and "no node has enough nvidia.com/gpu" in ready["message"]

    both_wait = (unschedulable(group_pod(TWO.revision, 0, 0), waits), unschedulable(group_pod(TWO.revision, 0, 1), waits))
    ready = cond(planner.plan(ONE, world(ONE, both_wait, gangs=True), NOW).status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "GroupUnschedulable")


def test_gangs_not_to_be_had_is_one_warning_event() -> None:
    from disagg_operator import events

    status = planner.plan(TWO, served(Observed(), False), NOW).status
    told = [(e.type, e.reason) for e in events.of_status(None, status)]
    assert ("Warning", "PodGroupsNotServed") in told
    assert ("Warning", "PodGroupsNotServed") not in [(e.type, e.reason) for e in events.of_status(status, status)]
