"""Status from observed children: honest Ready, capacity/crash/fabric reasons, stable transitions."""

from __future__ import annotations

from typing import Any

import pytest

from disagg_connector import contract
from disagg_operator.state import Observed, key_of
from disagg_operator.sizing import targets
from disagg_operator.status import compute, invalid_status

from tests.fixtures.world import desired
from tests.fixtures.status import REV, router_health


def deployment(role: str, replicas: int, revision: str | None = REV, **status: Any) -> dict[str, Any]:
    labels = contract.child_labels("m", role, revision if role != "router" else None)
    name = f"m-{role}-{revision}" if role != "router" else "m-router"
    obj = {"kind": "Deployment", "metadata": {"name": name, "labels": labels}, "spec": {"replicas": replicas}}
    return {**obj, "status": status} if status else obj


def pod(role: str, name: str, ready: bool = True, revision: str | None = REV, **status: Any) -> dict[str, Any]:
    labels = contract.child_labels("m", role, revision if role != "router" else None)
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": {"name": name, "labels": labels}, "status": {"conditions": conditions, **status}}


def world(deployments: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Observed:
    return Observed(children={key_of(d): d for d in deployments}, pods=tuple(pods))


def status_of(observed: Observed, previous: dict | None = None, now: str = "t1") -> dict[str, Any]:
    world = desired(previous=previous)
    return compute(world, observed, targets(world, observed), now)


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


FULL = world(
    [deployment("prefill", 1), deployment("decode", 1), deployment("router", 1)],
    [pod("prefill", "p1"), pod("decode", "d1"), pod("router", "r1")],
)


def test_ready_when_current_revision_and_router_are_ready() -> None:
    status = status_of(FULL)
    assert cond(status, "Ready")["status"] == "True"
    assert status["phase"] == "Ready" and status["transferMode"] == "Push" and status["revision"] == REV
    assert status["prefill"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "targetReplicas": 1}
    assert status["router"] == {"readyReplicas": 1, "url": "http://m-router.ns.svc:8000"}
    assert status["observedGeneration"] == 3
    assert cond(status, "Progressing")["status"] == "False"


def test_old_revision_pods_serve_but_never_count_as_the_current_revisions_ready() -> None:
    """Ready means serving (the old pair serves), readyReplicas counts the current revision only (Dynamo #3567)."""
    observed = world(
        [deployment("prefill", 1), deployment("decode", 1), deployment("router", 1),
         deployment("prefill", 1, "old"), deployment("decode", 1, "old")],
        [pod("prefill", "p-old", revision="old"), pod("decode", "d-old", revision="old"),
         pod("prefill", "p1", ready=False), pod("decode", "d1"), pod("router", "r1")],
    )  # fmt: skip
    status = status_of(observed)
    assert cond(status, "Ready")["status"] == "True"
    assert status["prefill"] == {"replicas": 2, "readyReplicas": 0, "updatedReplicas": 1, "targetReplicas": 1}
    progressing = cond(status, "Progressing")
    assert progressing["status"] == "True" and progressing["reason"] == "RolloutInProgress"


def test_unschedulable_pod_names_the_missing_resource() -> None:
    message = ("0/8 nodes are available: 2 Insufficient hugepages-2Mi, 2 Insufficient nvidia.com/gpu, "
               "2 node(s) had untolerated taint(s), 6 Insufficient vpc.amazonaws.com/efa.")
    pending = pod("decode", "d1", ready=False)
    pending["status"]["conditions"].append(
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    )
    observed = world(FULL.workloads, [pod("prefill", "p1"), pending, pod("router", "r1")])
    ready = cond(status_of(observed), "Ready")
    assert ready["reason"] == "InsufficientEFADevices"
    assert "vpc.amazonaws.com/efa (EFA devices)" in ready["message"] and "d1" in ready["message"]


def test_crash_loop_has_its_own_reason() -> None:
    crashing = pod("prefill", "p1", ready=False, containerStatuses=[{
        "name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": "CUDA out of memory"}},
    }])  # fmt: skip
    observed = world(FULL.workloads, [crashing, pod("decode", "d1"), pod("router", "r1")])
    status = status_of(observed)
    assert cond(status, "Ready")["reason"] == "CrashLoop" and "CUDA out of memory" in cond(status, "Ready")["message"]
    assert cond(status, "Degraded")["status"] == "True"


def test_preflight_failure_becomes_the_fabric_condition() -> None:
    failed = pod("prefill", "p1", ready=False, initContainerStatuses=[{
        "name": "preflight",
        "state": {"terminated": {"exitCode": 1, "message": "NixlBackendUnavailable: LIBFABRIC did not instantiate"}},
    }])  # fmt: skip
    observed = world(FULL.workloads, [failed, pod("decode", "d1"), pod("router", "r1")])
    fabric = cond(status_of(observed), "FabricReady")
    assert (fabric["status"], fabric["reason"]) == ("False", "NixlBackendUnavailable")
    assert "LIBFABRIC did not instantiate" in fabric["message"]


def test_a_preflight_in_restart_back_off_says_its_own_reason_everywhere() -> None:
    """A kubelet restarts a failed preflight in back-off: CrashLoopBackOff, the failure in the last state, the
    message with its file's newline (tests/integration/containers/test_real_node.py). Every condition names the
    preflight's reason, not CrashLoop."""
    failed = pod("prefill", "p1", ready=False, initContainerStatuses=[{
        "name": "preflight", "restartCount": 3,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 1, "message": "NixlImportFailed: python cannot import nixl\n"}},
    }])  # fmt: skip
    observed = world(FULL.workloads, [failed, pod("decode", "d1"), pod("router", "r1")])
    status = status_of(observed)
    for type_ in ("Ready", "Degraded", "FabricReady"):
        assert cond(status, type_)["reason"] == "NixlImportFailed", cond(status, type_)
        assert cond(status, type_)["message"].endswith("python cannot import nixl"), cond(status, type_)


def test_transition_time_moves_only_when_status_flips() -> None:
    first = status_of(FULL, now="t1")
    again = status_of(FULL, previous=first, now="t2")
    assert again == first  # unchanged world: identical status, so no write
    degraded = world(FULL.workloads, [pod("prefill", "p1", ready=False), pod("decode", "d1"), pod("router", "r1")])
    flipped = status_of(degraded, previous=first, now="t3")
    assert cond(flipped, "Ready")["lastTransitionTime"] == "t3"
    assert cond(flipped, "FabricReady")["lastTransitionTime"] == "t1"


def test_invalid_spec_status_keeps_what_runs() -> None:
    first = status_of(FULL)
    status = invalid_status(["spec.x: bad"], 4, first, "t9")
    assert status["phase"] == "Invalid" and status["prefill"] == first["prefill"]
    assert cond(status, "Ready")["reason"] == "InvalidSpec" and "spec.x: bad" in cond(status, "Ready")["message"]


def test_a_deployment_that_cannot_create_pods_says_why() -> None:
    failure = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
               "message": 'pods "m-decode-x" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1'}
    blocked = deployment("decode", 1, conditions=[failure])
    status = status_of(world([deployment("prefill", 1), blocked, deployment("router", 1)],
                             [pod("prefill", "p1"), pod("router", "r1")]))
    ready = cond(status, "Ready")
    assert ready["reason"] == "QuotaExceeded" and "exceeded quota: gpus" in ready["message"]
    assert f"decode Deployment m-decode-{REV}" in ready["message"]
    assert cond(status, "Degraded")["reason"] == "QuotaExceeded"  # the prefill and router still run


def test_status_has_the_api_shape() -> None:
    with pytest.raises(ValueError):
        from disagg_operator.status import _typed
        _typed({"phase": "Ready", "readyReplica": 1})


@pytest.mark.parametrize(("reports", "expected"), [
    ((("decode_failed", 5, 1),), ("False", "TransfersFailing")),
    ((("kv_wait_timeout", 3, 0),), ("False", "DeadlinesHit")),
    ((("decode_failed", 0, 7),), ("True", "TransfersSucceeding")),
    ((("decode_failed", 0, 7), ("decode_failed", 4, 0)), ("False", "TransfersFailing")),  # any router's trouble counts
    ((None,), ("Unknown", "RouterUnreachable")),
    ((), ("Unknown", "NoRouterReady")),
])  # fmt: skip
def test_kv_transfer_health_comes_from_the_routers_numbers(reports: tuple, expected: tuple[str, str]) -> None:
    from dataclasses import replace

    from disagg_operator.state import RouterView

    view = RouterView(tuple(None if r is None else router_health({r[0]: r[1]} if r[1] else {}, r[2]) for r in reports))
    kv = cond(status_of(replace(FULL, routers=view)), "KVTransferHealthy")
    assert (kv["status"], kv["reason"]) == expected, kv
    if expected[0] == "False":
        assert f"revision {REV}" in kv["message"]


def test_kv_transfer_health_stays_between_reads_of_the_routers() -> None:
    from dataclasses import replace

    from disagg_operator.state import RouterView

    failing = status_of(replace(FULL, routers=RouterView((router_health({"decode_failed": 5}, 0),))))
    carried = status_of(FULL, previous=failing, now="t2")  # routers not asked this pass
    assert cond(carried, "KVTransferHealthy") == cond(failing, "KVTransferHealthy")
