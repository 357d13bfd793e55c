"""What Argo CD and Flux make of the statuses the operator writes: the chart's Argo CD health.lua run by a
real Lua 5.1 set up as Argo CD's VM, and the real kstatus library, on statuses the operator's own pure code
produces (planner.plan and the status functions) for each situation a model meets.

kstatus reads only generic conditions (cli-utils pkg/kstatus/status/generic.go: `Reconciling` and
`Stalled`, then `Ready`); status.py derives both from Ready and Progressing on every path, and the cases
say what each situation must read as.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

import pytest
import yaml

from disagg_connector import contract
from disagg_connector.contract.health import RouterHealth
from disagg_operator import planner
from disagg_operator import status as status_mod
from disagg_operator.api.crd import build_crd
from disagg_operator.state import ChildProblem, Observed, RouterView, key_of

from tests.fixtures.gitops import HEALTH_LUA, Verdict, argocd_health, kstatus
from tests.fixtures.planner import FOREIGN_SERVICE, NEW_IMAGE, NOW, WORLD, refused, rolling
from tests.fixtures.status import router_health
from tests.fixtures.world import deployment_of, desired, pod, serving_pods, steady

GENERATION = 3  # the generation tests/fixtures/world.desired() judges


def model(status: dict[str, Any], generation: int = GENERATION, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DisaggregatedModel as the API server returns it, carrying `status`."""
    return {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
            "metadata": {"name": "m", "namespace": "ns", "uid": "uid-1", "generation": generation},
            "spec": spec or {"model": {"name": "Qwen/Qwen3-0.6B"}}, "status": status}  # fmt: skip


def planned(world, observed: Observed) -> dict[str, Any]:
    return planner.plan(world, observed, NOW).status


def with_pod_status(observed: Observed, role: str, **pod_status: Any) -> Observed:
    """The observed world with the role's pod replaced by one carrying `pod_status`."""
    pods = [p for p in observed.pods if p["metadata"]["labels"].get(contract.LABEL_ROLE) != role]
    return Observed(observed.children, (*pods, pod(role, f"{role[0]}-bad", WORLD.revision, ready=False, **pod_status)))


def crash_looping() -> Observed:
    return with_pod_status(steady(WORLD), "prefill", containerStatuses=[{
        "name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": "CUDA out of memory"}}}])  # fmt: skip


def unschedulable() -> Observed:
    message = "0/8 nodes are available: 6 Insufficient vpc.amazonaws.com/efa, 2 node(s) had untolerated taint(s)."
    return with_pod_status(steady(WORLD), "decode", conditions=[
        {"type": "Ready", "status": "False"},
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}])  # fmt: skip


def preflight_failed() -> Observed:
    return with_pod_status(steady(WORLD), "prefill", initContainerStatuses=[{
        "name": "preflight",
        "state": {"terminated": {"exitCode": 1, "message": "NixlBackendUnavailable: LIBFABRIC did not instantiate"}}}])  # fmt: skip


def over_quota() -> Observed:
    observed = steady(WORLD)
    decode = copy.deepcopy(deployment_of(observed, "decode"))
    decode["status"] = {"conditions": [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                        "message": 'pods "m-decode-x" is forbidden: exceeded quota: gpus'}]}  # fmt: skip
    pods = tuple(p for p in observed.pods if p["metadata"]["labels"].get(contract.LABEL_ROLE) != "decode")
    return Observed({**observed.children, key_of(decode): decode}, pods)


def old_pods_left() -> Observed:
    """The old revision's Deployments are deleted; the garbage collector has not reached their pods yet."""
    both = rolling(new_ready=True)
    new_only = {k: o for k, o in both.children.items() if o["metadata"]["labels"].get(contract.LABEL_REVISION) != WORLD.revision}
    return Observed(new_only, both.pods)


def failing_transfers() -> RouterHealth:
    """A router's /health whose recent window saw decode legs fail in the current revision."""
    return router_health({"decode_failed": 5}, 0)


SCALED_TO_ZERO = desired({"decode": {"replicas": 0}})
TWO_PREFILLS = desired({"prefill": {"replicas": 2}})
APPLY_FAILED = ChildProblem("ApplyFailed", "Deployment", "m-decode", "the server rejected our request (HTTP 500)")
API_DOWN = ChildProblem("ApiUnavailable", "API", "server", "the API server did not answer (timed out); retrying")

@dataclass(frozen=True)
class Case:
    id: str
    status: Callable[[], dict[str, Any]]
    argo: tuple[str, str]  # (health status, a phrase of its message)
    kstatus: str
    generation: int = GENERATION


CASES = [
    Case("first-create", lambda: planned(WORLD, Observed()), ("Progressing", "WaitingForPods"), "InProgress"),
    Case("steady", lambda: planned(WORLD, steady(WORLD)), ("Healthy", "ready at revision"), "Current"),
    Case("spec-not-judged-yet", lambda: planned(WORLD, steady(WORLD)), ("Progressing", "generation 4"), "InProgress",
         generation=GENERATION + 1),
    Case("rollout-new-revision-starting", lambda: planned(NEW_IMAGE, steady(WORLD)), ("Progressing", "RolloutInProgress"),
         "InProgress"),
    Case("rollout-new-revision-not-ready", lambda: planned(NEW_IMAGE, rolling(new_ready=False)),
         ("Progressing", "RolloutInProgress"), "InProgress"),
    Case("rollout-new-ready-old-still-serving", lambda: planned(NEW_IMAGE, rolling(new_ready=True)),
         ("Progressing", "RolloutInProgress"), "InProgress"),
    Case("rollout-old-deployments-deleted-pods-not-yet", lambda: planned(NEW_IMAGE, old_pods_left()),
         ("Progressing", "RolloutInProgress"), "InProgress"),
    Case("rollout-done", lambda: planned(NEW_IMAGE, steady(NEW_IMAGE)), ("Healthy", "ready at revision"), "Current"),
    Case("scaling-out", lambda: planned(TWO_PREFILLS, steady(TWO_PREFILLS)), ("Progressing", "WaitingForPods"), "InProgress"),
    Case("scaled-to-zero", lambda: planned(SCALED_TO_ZERO, Observed(steady(SCALED_TO_ZERO).children, serving_pods(
        SCALED_TO_ZERO.revision, decode=0))), ("Suspended", "ScaledToZero"), "Current"),
    Case("invalid-spec", lambda: status_mod.invalid_status(["spec.decode.parallelism.pipeline: push cannot"], GENERATION,
         planned(WORLD, steady(WORLD)), NOW), ("Degraded", "InvalidSpec: spec.decode"), "Failed"),
    Case("child-refused", lambda: planned(NEW_IMAGE, refused(NEW_IMAGE, steady(WORLD))),
         ("Degraded", "ChildRejected: nothing was changed"), "Failed"),
    Case("child-refused-before-anything-runs", lambda: planned(WORLD, refused(WORLD, Observed())),
         ("Degraded", "ChildRejected"), "Failed"),
    Case("ownership-conflict", lambda: planned(WORLD, Observed(steady(WORLD).children, steady(WORLD).pods,
         foreign={key_of(FOREIGN_SERVICE): FOREIGN_SERVICE})), ("Degraded", "OwnershipConflict: nothing was changed: Service m-router"),
         "Failed"),
    Case("quota-exceeded", lambda: planned(WORLD, over_quota()), ("Degraded", "QuotaExceeded"), "Failed"),
    # Capacity, crashes and the fabric may clear without a spec change: kstatus waiting is right for them.
    Case("crash-loop", lambda: planned(WORLD, crash_looping()), ("Degraded", "CrashLoop"), "InProgress"),
    Case("insufficient-efa", lambda: planned(WORLD, unschedulable()), ("Degraded", "InsufficientEFADevices"), "InProgress"),
    Case("preflight-failed", lambda: planned(WORLD, preflight_failed()), ("Degraded", "NixlBackendUnavailable"), "InProgress"),
    Case("write-failed-half-way", lambda: status_mod.write_failed(NEW_IMAGE, steady(WORLD), planned(NEW_IMAGE, steady(WORLD)),
         APPLY_FAILED, 3, 8, NOW), ("Progressing", "ApplyFailed: 3 of 8 changes made"), "InProgress"),
    # A failure that retrying clears keeps the model Progressing, serving or not: Ready means serving, and the
    # next pass gets through.
    Case("api-unavailable-before-serving", lambda: status_mod.write_failed(WORLD, Observed(), planned(WORLD, Observed()),
         API_DOWN, 0, 8, NOW), ("Progressing", "WaitingForPods"), "InProgress"),
    Case("api-unavailable-while-serving", lambda: status_mod.write_failed(WORLD, steady(WORLD), planned(WORLD, steady(WORLD)),
         API_DOWN, 0, 1, NOW), ("Progressing", "ApiUnavailable"), "InProgress"),
    Case("kv-transfers-failing", lambda: planned(WORLD, replace(steady(WORLD), routers=RouterView((failing_transfers(),)))),
         ("Degraded", "TransfersFailing: "), "Current"),
    Case("operator-bug", lambda: status_mod.unservable("InternalError", "the operator failed on this model (KeyError)",
         "retrying with backoff", GENERATION, None, NOW), ("Degraded", "InternalError"), "InProgress"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_argocd_health_of_operator_statuses(case: Case) -> None:
    verdict = argocd_health(model(case.status(), case.generation))
    assert verdict.status == case.argo[0], verdict
    assert case.argo[1] in verdict.message, verdict


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kstatus_of_operator_statuses(case: Case) -> None:
    (verdict,) = kstatus([model(case.status(), case.generation)])
    assert verdict.status == case.kstatus, verdict


def test_every_argo_status_the_script_names_is_one_argo_cd_knows() -> None:
    """The script returns literal statuses only; a typo would show as Unknown in Argo CD."""
    named = set(re.findall(r'return "([A-Za-z]+)"', HEALTH_LUA.read_text()))
    assert named == {"Healthy", "Progressing", "Degraded", "Suspended"}


def as_created() -> dict[str, Any]:
    obj = model({}, generation=1)
    del obj["status"]  # the API server drops status on create
    return obj


def test_argo_cd_reads_a_model_without_status_as_progressing() -> None:
    assert argocd_health(as_created()) == Verdict("Progressing", "waiting for the operator to judge this spec")


def test_kstatus_reads_a_model_the_operator_has_not_judged_as_in_progress() -> None:
    """The CRD defaults status to observedGeneration 0 (the API server drops status on create), so a model
    reads InProgress before the operator's first write, and while no operator runs at all."""
    (version,) = build_crd()["spec"]["versions"]
    created = {**as_created(), "status": version["schema"]["openAPIV3Schema"]["properties"]["status"]["default"]}
    assert kstatus([created])[0].status == "InProgress"
    assert argocd_health(created) == Verdict("Progressing", "waiting for the operator to judge this spec")


def test_the_script_needs_no_library_argo_cd_leaves_out() -> None:
    """Argo CD's VM has no string library: a script calling one fails there; here too."""
    from tests.fixtures.gitops import _argo_vm

    with pytest.raises(Exception, match="string"):
        _argo_vm({}).execute('return string.format("%d", 1)')
    with pytest.raises(Exception, match="index a string value"):
        _argo_vm({}).execute('return ("x"):upper()')


ARGOCD_CM_KEY = f"resource.customizations.health.{contract.API_GROUP}_{contract.KIND}"
GITOPS_DOC = HEALTH_LUA.parents[3] / "docs" / "gitops.md"
_ARGOCD_CM_BLOCK = re.compile(r"(```yaml\n)(apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: argocd-cm\n.*?)(```)", re.DOTALL)


def test_the_documented_argocd_cm_carries_the_chart_script() -> None:
    """docs/gitops.md's argocd-cm block is valid YAML whose health key is Argo CD's name for our kind and
    whose script is the chart's, byte for byte (DISAGG_UPDATE_GOLDEN=1 rewrites the block)."""
    script = HEALTH_LUA.read_text()
    literal = "".join(f"    {line}" if line.strip() else "\n" for line in script.splitlines(keepends=True))
    block = f"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: argocd-cm\n  namespace: argocd\ndata:\n  {ARGOCD_CM_KEY}: |\n{literal}"
    text = GITOPS_DOC.read_text()
    if os.environ.get("DISAGG_UPDATE_GOLDEN") == "1":
        text = _ARGOCD_CM_BLOCK.sub(lambda m: m.group(1) + block + m.group(3), text)
        GITOPS_DOC.write_text(text)
    (documented,) = [m.group(2) for m in _ARGOCD_CM_BLOCK.finditer(text)]
    assert yaml.safe_load(documented)["data"] == {ARGOCD_CM_KEY: script}
    assert documented == block, "docs/gitops.md's argocd-cm block is stale: regenerate with DISAGG_UPDATE_GOLDEN=1"
