"""The planner, table-driven: (desired, observed) -> the actions and the status that results. Pure: no
client, no cluster. Each case names a situation a model meets in its life."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pytest

from disagg_connector import contract
from disagg_operator import executor, planner
from disagg_operator import status as status_mod
from disagg_operator.state import Desired, Observed, RouterView, key_of
from kubernetes.client.exceptions import ApiException

from tests.fixtures.world import children, deployment_of, desired, live, serving_pods, steady, with_role_status
from tests.fixtures.planner import COSTED, FOREIGN_SERVICE, IDLE, LEAVING, NEW_IMAGE, NOW, OLD_D, OLD_P, WORLD, act, cond, refused, rolling, router


def engine_names(world: Desired) -> set[str]:
    return {contract.engine_deployment_name("m", r, world.revision) for r in contract.ENGINE_ROLES}


def drifted() -> Observed:
    observed = steady(WORLD)
    decode = copy.deepcopy(deployment_of(observed, "decode"))
    decode["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/edited:by-hand"
    return Observed({**observed.children, key_of(decode): decode}, observed.pods)


BUSY = RouterView((router({OLD_P: (0, True), OLD_D: (0, True)}), router({OLD_P: (0, True), OLD_D: (1, True)})), ("r0", "r1"))
UNSEEN = RouterView((router({OLD_P: (0, False), OLD_D: (0, False)}),), ("r0",))
SILENT = RouterView((router({OLD_P: (0, True), OLD_D: (0, True)}), None), ("r0", "r1"))


def with_stale_policy() -> Observed:
    observed = steady(NO_POLICY)
    policy = live(next(o for o in WORLD.rendered.objects if o["kind"] == "NetworkPolicy"))
    return Observed({**observed.children, key_of(policy): policy}, observed.pods)


NO_POLICY = desired({"network": {"networkPolicy": {"enabled": False}}})
SCALED = desired({"prefill": {"replicas": 2}})


@dataclass(frozen=True)
class Case:
    id: str
    world: Desired
    observed: Callable[[], Observed]
    actions: Callable[[list[tuple[str, str, str, str]]], bool]
    ready: tuple[str, str]  # (status, reason) of the Ready condition
    more: Callable[[dict[str, Any]], bool] = field(default=lambda status: True)
    routers: RouterView | None = None
    now: str = NOW


def deployments(world: Desired) -> list[str]:
    return sorted(contract.engine_deployment_name("m", r, world.revision) for r in contract.ENGINE_ROLES)


CASES = [
    Case("first-create", WORLD, lambda: Observed(),
         lambda a: [x[0] for x in a] == ["Apply"] * len(children(WORLD)) and {x[3] for x in a} == {"create"}
         and [x[1] for x in a][:3] == ["ServiceAccount", "Role", "RoleBinding"] and a[-1][2] == "m-router",
         ("False", "WaitingForPods")),
    Case("steady-state", WORLD, lambda: steady(WORLD), lambda a: a == [], ("True", "Ready"),
         lambda s: cond(s, "Progressing")["reason"] == "Complete"),
    Case("drift", WORLD, drifted,
         lambda a: a == [("Apply", "Deployment", contract.engine_deployment_name("m", "decode", WORLD.revision), "update")],
         ("True", "Ready")),
    Case("scale-is-written-to-the-role-scaler-and-its-deployment", SCALED, lambda: steady(WORLD),
         lambda a: a == [("Apply", contract.ROLE_KIND, "m-prefill", "update"),
                         ("Apply", "Deployment", contract.engine_deployment_name("m", "prefill", WORLD.revision), "update")],
         ("True", "Ready"), lambda s: SCALED.revision == WORLD.revision and s["prefill"]["targetReplicas"] == 2
         and cond(s, "Progressing")["reason"] == "WaitingForPods" and cond(s, "Degraded")["status"] == "False"),
    Case("revision-change-starts-with-one-surge-pod-per-role", NEW_IMAGE, lambda: steady(WORLD),
         lambda a: {x[2] for x in a if x[3] == "create"} == set(deployments(NEW_IMAGE)) and not [x for x in a if x[0] == "Delete"],
         ("True", "Ready"), lambda s: cond(s, "Progressing")["reason"] == "RolloutInProgress"),
    Case("new-revision-not-ready-keeps-old", NEW_IMAGE, lambda: rolling(new_ready=False),
         lambda a: a == [], ("True", "Ready"), lambda s: cond(s, "Progressing")["reason"] == "RolloutInProgress"
         and cond(s, "Degraded")["status"] == "False" and cond(s, "Reconciling")["status"] == "True"),
    Case("a-ready-new-pair-marks-the-old-pair-draining", NEW_IMAGE, lambda: rolling(new_ready=True),
         lambda a: a == [("Annotate", "Pod", OLD_P, "leaving"), ("Annotate", "Pod", OLD_D, "leaving")],
         ("True", "Ready"), lambda s: f"draining {OLD_P}, {OLD_D}" in cond(s, "Progressing")["message"]),
    Case("drained-pair-gets-the-lowest-deletion-cost", NEW_IMAGE, lambda: rolling(True, LEAVING),
         lambda a: a == [("Annotate", "Pod", OLD_P, "drained"), ("Annotate", "Pod", OLD_D, "drained")],
         ("True", "Ready"), routers=IDLE),
    Case("a-request-in-flight-keeps-its-pod", NEW_IMAGE, lambda: rolling(True, LEAVING),
         lambda a: a == [("Annotate", "Pod", OLD_P, "drained")], ("True", "Ready"),
         lambda s: OLD_D in cond(s, "Progressing")["message"], routers=BUSY),
    Case("a-router-that-has-not-seen-the-mark-is-waited-for", NEW_IMAGE, lambda: rolling(True, LEAVING),
         lambda a: a == [], ("True", "Ready"), routers=UNSEEN),
    Case("a-silent-router-is-waited-for", NEW_IMAGE, lambda: rolling(True, LEAVING), lambda a: a == [],
         ("True", "Ready"), routers=SILENT),
    Case("a-stream-outlives-deadline-plus-lease-and-keeps-its-decode", NEW_IMAGE, lambda: rolling(True, LEAVING),
         lambda a: a == [("Annotate", "Pod", OLD_P, "drained")], ("True", "Ready"),
         lambda s: f"{OLD_D} (1 request(s) in flight on router r1)" in cond(s, "Progressing")["message"],
         routers=BUSY, now="2026-12-01T00:59:00Z"),  # long past 60 s deadline + 120 s lease, within the 1 h bound
    Case("a-silent-router-holds-a-decode-until-the-drain-timeout", NEW_IMAGE, lambda: rolling(True, LEAVING),
         lambda a: a == [("Annotate", "Pod", OLD_P, "drained")], ("True", "Ready"),
         lambda s: f"{OLD_D} (router r1 did not answer)" in cond(s, "Progressing")["message"],
         routers=SILENT, now="2026-12-01T00:03:00Z"),  # a prefill's KV is no one's after deadline + lease
    Case("the-drain-timeout-ends-the-wait", NEW_IMAGE, lambda: rolling(True, LEAVING),
         lambda a: [x[3] for x in a] == ["drained", "drained"], ("True", "Ready"), routers=SILENT,
         now="2026-12-01T01:00:00Z"),  # spec.rollout.drainTimeoutSeconds (3600) after the mark
    Case("a-router-that-answers-late-lets-the-pod-go-at-once", NEW_IMAGE, lambda: rolling(True, LEAVING),
         lambda a: [x[3] for x in a] == ["drained", "drained"], ("True", "Ready"), routers=IDLE,
         now="2026-12-01T00:20:00Z"),
    Case("once-the-cost-is-seen-the-old-revision-goes", NEW_IMAGE, lambda: rolling(True, COSTED),
         lambda a: sorted(x[2] for x in a) == deployments(WORLD) and {x[:2] for x in a} == {("Delete", "Deployment")}
         and {x[3] for x in a} == {"retired"},
         ("True", "Ready"), lambda s: cond(s, "Progressing")["reason"] == "Complete" and s["prefill"]["replicas"] == 1,
         routers=IDLE),
    Case("stale-child", NO_POLICY, with_stale_policy,
         lambda a: a == [("Delete", "NetworkPolicy", contract.engines_network_policy_name("m"), "stale")], ("True", "Ready")),
    Case("ownership-conflict", WORLD,
         lambda: Observed(steady(WORLD).children, steady(WORLD).pods, foreign={key_of(FOREIGN_SERVICE): FOREIGN_SERVICE}),
         lambda a: a == [], ("False", "OwnershipConflict"),
         lambda s: "Service m-router" in cond(s, "Ready")["message"] and "Gateway edge" in cond(s, "Ready")["message"]
         and cond(s, "Degraded")["status"] == "True"),
    Case("child-refused", NEW_IMAGE, lambda: refused(NEW_IMAGE, steady(WORLD)),
         lambda a: a == [], ("False", "ChildRejected"),
         lambda s: "nothing was changed" in cond(s, "Ready")["message"] and "must be greater than or equal to memory request"
         in cond(s, "Ready")["message"] and cond(s, "Degraded")["reason"] == "ChildRejected"),
    Case("refused-before-anything-runs", WORLD, lambda: refused(WORLD, Observed()),
         lambda a: a == [], ("False", "ChildRejected"), lambda s: cond(s, "Degraded")["status"] == "False"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan(case: Case) -> None:
    plan = planner.plan(case.world, replace(case.observed(), routers=case.routers), case.now)
    assert case.actions(act(plan)), act(plan)
    ready = cond(plan.status, "Ready")
    assert (ready["status"], ready["reason"]) == case.ready, ready
    assert case.more(plan.status), plan.status
    assert plan.status["observedGeneration"] == 3 and plan.status["revision"] == case.world.revision


def test_steady_state_is_a_fixed_point() -> None:
    """The status a steady pass computes, fed back as the previous status, plans nothing new."""
    first = planner.plan(WORLD, steady(WORLD), NOW)
    again = planner.plan(desired(previous=first.status), steady(WORLD), "2026-12-01T01:00:00Z")
    assert again.actions == () and again.status == first.status


class ScriptedCluster:
    """The four calls the executor makes, failing the n-th write with a given API error."""

    def __init__(self, fail_at: int, status: int, message: str):
        self.fail_at, self.status, self.message = fail_at, status, message
        self.writes: list[str] = []

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        if len(self.writes) == self.fail_at:
            raise ApiException(status=self.status, reason="x", body=json.dumps({"message": self.message}))
        self.writes.append(obj["metadata"]["name"])
        return obj

    def delete(self, obj: dict[str, Any]) -> None:
        self.writes.append(obj["metadata"]["name"])


@pytest.mark.parametrize(("code", "message", "reason"), [
    (403, 'deployments.apps is forbidden: User "op" cannot patch resource', "Forbidden"),
    (403, "exceeded quota: compute, requested: count/deployments.apps=1", "QuotaExceeded"),
    (409, "the object has been modified", "Conflict"),
    (500, "etcdserver: request timed out", "ApplyFailed"),
])  # fmt: skip
def test_a_write_that_fails_half_way(code: int, message: str, reason: str) -> None:
    plan = planner.plan(WORLD, Observed(), NOW)
    cluster = ScriptedCluster(fail_at=3, status=code, message=message)
    outcome = executor.execute(plan, cluster)  # type: ignore[arg-type]
    assert (outcome.done, outcome.total) == (3, len(plan.actions)) and len(cluster.writes) == 3
    status = status_mod.write_failed(WORLD, Observed(), plan.status, outcome.failure, outcome.done, outcome.total, NOW)
    ready = cond(status, "Ready")
    assert ready["status"] == "False" and ready["reason"] == reason
    assert f"3 of {len(plan.actions)} changes made" in ready["message"] and message in ready["message"]
    assert "retrying" in ready["message"]


@pytest.mark.parametrize(("code", "message", "reason"), [
    (422, "is invalid", "ChildRejected"), (400, "bad request", "ChildRejected"), (404, "namespaces not found", "ApplyFailed"),
    (500, "failed to create typed patch object (/m; apps/v1, Kind=Deployment): .spec...: expected list", "ChildRejected"),
    # kube-apiserver 1.37's answer to a PodGroup of a missing PriorityClass (kubectl apply --dry-run=server)
    (403, 'podgroups.scheduling.k8s.io "m-x-pair" is forbidden: no PriorityClass with name gold was found', "ChildRejected"),
    (403, 'deployments.apps "m" is forbidden: User "system:serviceaccount:x:y" cannot patch resource', "Forbidden"),
])  # fmt: skip
def test_api_refusals_get_stable_reasons(code: int, message: str, reason: str) -> None:
    assert executor.problem_from_error("Service", "s", code, message).reason == reason



def test_every_write_is_dry_run_except_a_binding_to_a_role_made_in_the_same_pass() -> None:
    first = planner.plan(WORLD, Observed(), NOW)
    assert {a.key for a in first.applies} - {a.key for a in first.dry_runs} == {("RoleBinding", "m-router")}
    role = next(o for o in WORLD.rendered.objects if o["kind"] == "Role")
    later = planner.plan(WORLD, Observed({key_of(role): live(role)}), NOW)
    assert {a.key for a in later.dry_runs} == {a.key for a in later.applies}


def _scaled_by_hand(world: Desired, role: str, replicas: int) -> Observed:
    observed = steady(world)
    key = (contract.ROLE_KIND, f"m-{role}")
    scaler = copy.deepcopy(observed.children[key])
    scaler["spec"]["replicas"] = replicas  # kubectl scale dmrole/m-decode --replicas=N
    return Observed({**observed.children, key: scaler}, observed.pods)


def test_kubectl_scale_of_the_role_wins_until_the_spec_changes() -> None:
    plan = planner.plan(WORLD, _scaled_by_hand(WORLD, "decode", 3), NOW)
    assert act(plan) == [("Apply", "Deployment", contract.engine_deployment_name("m", "decode", WORLD.revision), "update")]
    decode = next(a.obj for a in plan.applies if a.obj["kind"] == "Deployment")
    assert decode["spec"]["replicas"] == 3 and plan.status["decode"]["targetReplicas"] == 3
    # Then the spec's decode.replicas changes: that is written to the role, over the hand-scaled size.
    changed = desired({"decode": {"replicas": 2}})
    again = planner.plan(changed, _scaled_by_hand(WORLD, "decode", 3), NOW)
    scaler = next(a.obj for a in again.applies if a.obj["kind"] == contract.ROLE_KIND)
    assert scaler["spec"]["replicas"] == 2 and again.status["decode"]["targetReplicas"] == 2


def test_with_an_hpa_the_operator_never_writes_the_size() -> None:
    metrics = [{"type": "Pods", "pods": {"metric": {"name": "vllm:num_requests_waiting"},
                                         "target": {"type": "AverageValue", "averageValue": "4"}}}]
    auto = desired({"decode": {"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 8, "metrics": metrics}}})
    observed = _scaled_by_hand(auto, "decode", 5)  # the HPA scaled it
    plan = planner.plan(desired({"decode": {"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 8,
                                                                          "metrics": metrics}}}), observed, NOW)
    assert not [a for a in plan.applies if a.obj["kind"] == contract.ROLE_KIND and a.obj["spec"]["replicas"] != 5]
    assert plan.status["decode"]["targetReplicas"] == 5


ACTIVE = {"autoscaling": {"mode": "Active", "ttftMilliseconds": 2000, "tpotMilliseconds": 50,
                          "prefill": {"maxEngines": 4}, "decode": {"minEngines": 2, "maxEngines": 4}}}  # fmt: skip


def _decided(observed: Observed, prefill: int, decode: int, mode: str = "Active") -> Observed:
    role = lambda current, size: {"current": current, "recommended": size, "reason": "why"}  # noqa: E731
    return replace(observed, autoscaling={"mode": mode, "decidedAt": NOW, "prefill": role(1, prefill), "decode": role(1, decode)})


def test_the_active_slo_autoscaler_is_the_roles_one_writer() -> None:
    """Its decision is written to both roles, over a kubectl scale; before its first decision the live size stays;
    its bounds hold whatever the spec or the hand-scaled size says; an Advisory decision writes nothing."""
    active = desired(ACTIVE)
    steady_active = steady(active)
    plan = planner.plan(active, _decided(steady_active, 3, 2), NOW)
    scalers = {a.obj["metadata"]["name"]: a.obj["spec"]["replicas"] for a in plan.applies if a.obj["kind"] == contract.ROLE_KIND}
    assert scalers == {"m-prefill": 3, "m-decode": 2}
    assert (plan.status["prefill"]["targetReplicas"], plan.status["decode"]["targetReplicas"]) == (3, 2)
    hand = _scaled_by_hand(active, "prefill", 4)  # kubectl scale between two decisions: the last decision stands
    assert planner.plan(active, _decided(hand, 3, 2), NOW).status["prefill"]["targetReplicas"] == 3
    before = planner.plan(active, hand, NOW)  # no decision yet (a restarted operator): what is there, within bounds
    assert (before.status["prefill"]["targetReplicas"], before.status["decode"]["targetReplicas"]) == (4, 2)
    too_big = planner.plan(active, _scaled_by_hand(active, "prefill", 9), NOW)
    assert too_big.status["prefill"]["targetReplicas"] == 4, "maxEngines bounds a hand-scaled size"
    advisory = planner.plan(active, _decided(steady_active, 3, 3, mode="Advisory"), NOW)
    assert advisory.status["prefill"]["targetReplicas"] == 1, "a decision of the Advisory mode is not written"


def test_scale_in_drains_the_pod_that_leaves_first() -> None:
    two = desired({"decode": {"replicas": 2}})
    observed = with_role_status(Observed(children(two), serving_pods(two.revision, decode=2)), two.revision)
    one = desired({"decode": {"replicas": 1}})
    assert one.revision == two.revision
    plan = planner.plan(one, observed, NOW)
    marks = [a for a in plan.actions if isinstance(a, planner.Annotate)]
    assert [(a.obj["metadata"]["name"], a.why) for a in marks] == [(f"d-{two.revision}-1", "leaving")]
    assert not [a for a in plan.applies if a.obj["kind"] == "Deployment"], "the Deployment keeps the pod until it is drained"
    assert plan.requeue_after is not None and plan.draining == (f"d-{two.revision}-1",)


def test_a_drained_pod_its_replicaset_is_removing_keeps_its_mark_and_cost() -> None:
    """The Deployment was shrunk past the drained pod and the ReplicaSet has not deleted it yet: the next pass
    leaves its mark and cost (unmarked, routers would send it new requests and the ReplicaSet could pick another
    pod). The size rising again grows the Deployment first; once the Deployment has room for it, it is unmarked."""
    one = desired({"decode": {"replicas": 1}})
    pods = serving_pods(one.revision, decode=2)
    leaving = f"d-{one.revision}-1"
    pods = tuple({**p, "metadata": {**p["metadata"], "annotations": dict(COSTED)}} if p["metadata"]["name"] == leaving else p
                 for p in pods)  # fmt: skip
    shrunk = with_role_status(Observed(children(one), pods), one.revision)
    assert deployment_of(shrunk, "decode")["spec"]["replicas"] == 1
    plan = planner.plan(one, shrunk, NOW)
    assert not [a for a in plan.actions if isinstance(a, planner.Annotate)], act(plan)

    two = desired({"decode": {"replicas": 2}})
    growing = planner.plan(two, shrunk, NOW)
    assert not [x for x in act(growing) if x[0] == "Annotate"]
    assert [a.obj["spec"]["replicas"] for a in growing.applies if a.obj["kind"] == "Deployment"] == [2]
    grown = with_role_status(Observed(children(two), pods), two.revision)
    assert [(x[2], x[3]) for x in act(planner.plan(two, grown, NOW)) if x[0] == "Annotate"] == [(leaving, "stays")]


def test_a_role_deleted_after_kubectl_scale_comes_back_at_its_recorded_size() -> None:
    """scale to 3, delete the DisaggregatedRole: it is recreated at 3 (the status's targetReplicas), and no serving
    decode is drained; a spec changed since (another generation) is asked for its own size instead."""
    scaled = _scaled_by_hand(WORLD, "decode", 3)
    observed = with_role_status(Observed(scaled.children, serving_pods(WORLD.revision, decode=3)), WORLD.revision)
    first = planner.plan(WORLD, observed, NOW)
    assert first.status["decode"]["targetReplicas"] == 3
    without_role = Observed({k: v for k, v in observed.children.items() if k != (contract.ROLE_KIND, "m-decode")}, observed.pods)
    again = planner.plan(desired(previous=first.status), without_role, NOW)
    recreated = next(a.obj for a in again.applies if a.obj["kind"] == contract.ROLE_KIND)
    assert (recreated["metadata"]["name"], recreated["spec"]["replicas"], a_why(again, "m-decode")) == ("m-decode", 3, "create")
    assert not [a for a in again.actions if isinstance(a, planner.Annotate)], "no serving pod is drained"
    assert again.status["decode"]["targetReplicas"] == 3
    newer = planner.plan(desired({"engine": {"image": "x/y:z"}}, previous=first.status, generation=4), without_role, NOW)
    assert newer.status["decode"]["targetReplicas"] == 1, "a new generation's spec asks for its own size"


def a_why(plan: planner.Plan, name: str) -> str:
    return next(a.why for a in plan.applies if a.obj["metadata"]["name"] == name)


def _crash_looping(observed: Observed, revision: str) -> Observed:
    """The pods of `revision` crash-loop (a bad image)."""
    waiting = {"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}
    pods = tuple({**p, "status": {**p["status"], "containerStatuses": [waiting]}}
                 if p["metadata"]["labels"].get(contract.LABEL_REVISION) == revision else p for p in observed.pods)  # fmt: skip
    return replace(observed, pods=pods)


def test_ready_means_serving_through_a_bad_images_rollout() -> None:
    """The new revision crash-loops while the old one serves at full size: Ready stays True (kubectl wait, a
    GitOps gate and an alert on Ready see a model that serves), Degraded says CrashLoop, Progressing says the
    rollout is held up and why; nothing of the old revision is drained."""
    plan = planner.plan(NEW_IMAGE, _crash_looping(rolling(new_ready=False), NEW_IMAGE.revision), NOW)
    ready, degraded, progressing = (cond(plan.status, t) for t in ("Ready", "Degraded", "Progressing"))
    assert (ready["status"], ready["reason"]) == ("True", "Ready"), ready
    assert (degraded["status"], degraded["reason"]) == ("True", "CrashLoop"), degraded
    assert progressing["reason"] == "RolloutInProgress" and "CrashLoop" in progressing["message"], progressing
    assert cond(plan.status, "Stalled")["status"] == "False"
    assert not [a for a in plan.actions if isinstance(a, planner.Annotate)]


def test_a_crash_loop_that_leaves_a_role_short_of_its_size_is_not_ready() -> None:
    """No rollout: the only decode crash-loops, nothing of the current revision serves: Ready=False CrashLoop."""
    observed = _crash_looping(steady(WORLD), WORLD.revision)
    observed = replace(observed, pods=tuple({**p, "status": {**p["status"], "conditions": [{"type": "Ready", "status": "False"}]}}
                                            if p["metadata"]["labels"].get(contract.LABEL_ROLE) == "decode" else p
                                            for p in observed.pods))  # fmt: skip
    ready = cond(planner.plan(WORLD, observed, NOW).status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "CrashLoop"), ready


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan_leaves_its_inputs_unchanged(case: Case) -> None:
    """plan() is pure: the rendered objects and the observed world are the same after it as before (a planner
    that edits them makes later passes, and tests sharing a world, depend on order)."""
    observed = replace(case.observed(), routers=case.routers)
    before = copy.deepcopy((case.world.rendered.objects, observed.children, observed.pods, case.world.previous_status))
    planner.plan(case.world, observed, case.now)
    planner.plan(case.world, _scaled_by_hand(case.world, "decode", 3), case.now)
    assert (case.world.rendered.objects, observed.children, observed.pods, case.world.previous_status) == before


def test_the_routers_are_asked_while_a_pod_drains_when_their_set_changes_and_once_per_period() -> None:
    observed = Observed(children={}, pods=serving_pods("abc", routers=2))
    assert planner.routers_due(observed, None, at=0.0, poll_seconds=300)  # never read yet
    read = planner.RoutersRead(0.0, planner.ready_routers(observed))
    assert read.ready == {"r-0", "r-1"}
    assert not planner.routers_due(observed, read, at=299.0, poll_seconds=300)
    assert planner.routers_due(observed, read, at=300.0, poll_seconds=300)  # the period passed
    one_router = Observed(children={}, pods=serving_pods("abc", routers=1))
    assert planner.routers_due(one_router, read, at=1.0, poll_seconds=300)  # a router went
    draining = copy.deepcopy(observed.pods)
    draining[0]["metadata"]["annotations"] = {contract.ANNOTATION_DRAINING: "2026-12-01T00:00:00Z"}
    assert planner.routers_due(Observed(children={}, pods=draining), read, at=1.0, poll_seconds=300)
