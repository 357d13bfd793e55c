"""The planner, table-driven: (desired, observed) -> the actions and the status that results. Pure: no
client, no cluster. Each case names a situation a model meets in its life."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

from disagg_connector import contract
from disagg_operator import executor, planner
from disagg_operator import status as status_mod
from disagg_operator.state import ChildProblem, Desired, Observed, key_of
from kubernetes.client.exceptions import ApiException

from .world import children, deployment_of, desired, live, serving_pods, steady

NOW = "2026-12-01T00:00:00Z"
WORLD = desired()
NEW_IMAGE = desired({"engine": {"image": "registry.example/vllm:new"}})


def act(plan: planner.Plan) -> list[tuple[str, str, str, str]]:
    return [(type(a).__name__, a.obj["kind"], a.obj["metadata"]["name"], a.why) for a in plan.actions]


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def engine_names(world: Desired) -> set[str]:
    return {contract.engine_deployment_name("m", r, world.revision) for r in contract.ENGINE_ROLES}


def drifted() -> Observed:
    observed = steady(WORLD)
    decode = copy.deepcopy(deployment_of(observed, "decode"))
    decode["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/edited:by-hand"
    return Observed({**observed.children, key_of(decode): decode}, observed.pods)


def rolling(new_ready: bool) -> Observed:
    """The old revision serves; the new revision's Deployments exist, their pods ready or not."""
    old = steady(WORLD)
    new_children = {k: v for k, v in children(NEW_IMAGE).items()}
    return Observed({**old.children, **new_children},
                    old.pods + serving_pods(NEW_IMAGE.revision, routers=0, ready=new_ready))


def with_stale_policy() -> Observed:
    observed = steady(NO_POLICY)
    policy = live(next(o for o in WORLD.rendered.objects if o["kind"] == "NetworkPolicy"))
    return Observed({**observed.children, key_of(policy): policy}, observed.pods)


NO_POLICY = desired({"network": {"networkPolicy": {"enabled": False}}})
SCALED = desired({"prefill": {"replicas": 2}})
FOREIGN_SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {
    "name": "m-router", "namespace": "ns", "uid": "x", "ownerReferences": [{"kind": "Gateway", "name": "edge", "uid": "g", "controller": True}]}}


def refusal(world: Desired) -> ChildProblem:
    return ChildProblem("ChildRejected", "Deployment", contract.engine_deployment_name("m", "decode", world.revision),
                        'Deployment.apps "m-decode" is invalid: spec.template.spec.containers[0].resources.limits: '
                        'Invalid value: "1Gi": must be greater than or equal to memory request')


def refused(world: Desired, base: Observed) -> Observed:
    problem = refusal(world)
    return Observed(base.children, base.pods, refused={("Deployment", problem.name): problem})


@dataclass(frozen=True)
class Case:
    id: str
    world: Desired
    observed: Callable[[], Observed]
    actions: Callable[[list[tuple[str, str, str, str]]], bool]
    ready: tuple[str, str]  # (status, reason) of the Ready condition
    more: Callable[[dict[str, Any]], bool] = field(default=lambda status: True)


CASES = [
    Case("first-create", WORLD, lambda: Observed(),
         lambda a: [x[0] for x in a] == ["Apply"] * len(WORLD.rendered.objects) and {x[3] for x in a} == {"create"}
         and [x[1] for x in a][:3] == ["ServiceAccount", "Role", "RoleBinding"] and a[-1][2] == "m-router",
         ("False", "WaitingForPods")),
    Case("steady-state", WORLD, lambda: steady(WORLD), lambda a: a == [], ("True", "Ready"),
         lambda s: cond(s, "Progressing")["reason"] == "Complete"),
    Case("drift", WORLD, drifted,
         lambda a: a == [("Apply", "Deployment", contract.engine_deployment_name("m", "decode", WORLD.revision), "update")],
         ("True", "Ready")),
    Case("scale", SCALED, lambda: steady(WORLD),
         lambda a: a == [("Apply", "Deployment", contract.engine_deployment_name("m", "prefill", WORLD.revision), "update")],
         ("True", "Ready"), lambda s: SCALED.revision == WORLD.revision),
    Case("revision-change", NEW_IMAGE, lambda: steady(WORLD),
         lambda a: {x[2] for x in a if x[3] == "create"} == engine_names(NEW_IMAGE) and not [x for x in a if x[0] == "Delete"],
         ("False", "WaitingForPods"), lambda s: cond(s, "Progressing")["reason"] == "RolloutInProgress"),
    Case("new-revision-not-ready-keeps-old", NEW_IMAGE, lambda: rolling(new_ready=False),
         lambda a: a == [], ("False", "WaitingForPods"), lambda s: cond(s, "Progressing")["reason"] == "RolloutInProgress"),
    Case("retire-old-revision", NEW_IMAGE, lambda: rolling(new_ready=True),
         lambda a: sorted(x[2] for x in a) == sorted(engine_names(WORLD)) and {x[:2] for x in a} == {("Delete", "Deployment")}
         and {x[3] for x in a} == {"retired"},
         ("True", "Ready"), lambda s: cond(s, "Progressing")["reason"] == "Complete" and s["prefill"]["replicas"] == 1),
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
    plan = planner.plan(case.world, case.observed(), NOW)
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
])  # fmt: skip
def test_api_refusals_get_stable_reasons(code: int, message: str, reason: str) -> None:
    assert executor.problem_from_error("Service", "s", code, message).reason == reason



def test_every_write_is_dry_run_except_a_binding_to_a_role_made_in_the_same_pass() -> None:
    first = planner.plan(WORLD, Observed(), NOW)
    assert {a.key for a in first.applies} - {a.key for a in first.dry_runs} == {("RoleBinding", "m-router")}
    role = next(o for o in WORLD.rendered.objects if o["kind"] == "Role")
    later = planner.plan(WORLD, Observed({key_of(role): live(role)}), NOW)
    assert {a.key for a in later.dry_runs} == {a.key for a in later.applies}
