"""Status from what is observed: pure, observed children -> status dict with conditions.

Ready means the *current* revision's prefill, decode and router are ready, never that old pods happen
to satisfy a count (Dynamo #3567). A pod that cannot be scheduled becomes a capacity reason naming the
resource; a crash loop and a failed fabric preflight have reasons of their own. A condition's
lastTransitionTime moves only when its status flips, so an unchanged world yields an identical status
and no write.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from disagg_connector import contract
from disagg_connector.preflight import parse_termination_message

from .render import Rendered

# Scheduler messages count nodes per cause: "0/8 nodes are available: 6 Insufficient vpc.amazonaws.com/efa, ...".
_INSUFFICIENT = re.compile(r"(\d+) Insufficient ([\w./-]*\w)")
CAPACITY_REASONS = {
    contract.ACCELERATOR_RESOURCES["nvidia"]: ("InsufficientGPUs", "GPUs"),
    contract.ACCELERATOR_RESOURCES["neuron"]: ("InsufficientNeuronDevices", "Neuron devices"),
    contract.EFA_RESOURCE: ("InsufficientEFADevices", "EFA devices"),
    contract.HUGEPAGES_RESOURCE: ("InsufficientHugepages", "2Mi hugepages"),
    "cpu": ("InsufficientCPU", "CPU"),
    "memory": ("InsufficientMemory", "memory"),
}
CRASH_WAITING_REASONS = {"CrashLoopBackOff"}
IMAGE_WAITING_REASONS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName"}


@dataclass(frozen=True)
class Observed:
    """Children as the API returned them (plain dicts), already filtered to this model."""

    deployments: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def _role(obj: dict[str, Any]) -> str | None:
    return _labels(obj).get(contract.LABEL_ROLE)


def _revision(obj: dict[str, Any]) -> str | None:
    return _labels(obj).get(contract.LABEL_REVISION)


def _terminating(pod: dict[str, Any]) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return not _terminating(pod) and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def role_counts(observed: Observed, role: str, revision: str) -> dict[str, int]:
    """replicas: pods of the role across revisions; updated: of the current revision; ready: current
    revision pods that are Ready (the only ones that can serve paired with the current revision)."""
    pods = [p for p in observed.pods if _role(p) == role and not _terminating(p)]
    current = [p for p in pods if _revision(p) == revision]
    return {
        "replicas": len(pods),
        "readyReplicas": sum(1 for p in current if _pod_ready(p)),
        "updatedReplicas": len(current),
    }


def desired_replicas(observed: Observed, role: str, revision: str) -> int | None:
    for deploy in observed.deployments:
        if _role(deploy) == role and _revision(deploy) in (revision, None):
            return int(deploy.get("spec", {}).get("replicas", 1))
    return None


def router_ready(observed: Observed) -> int:
    return sum(1 for p in observed.pods if _role(p) == "router" and _pod_ready(p))


def old_revisions(observed: Observed, revision: str) -> set[str]:
    return {r for d in observed.deployments if (r := _revision(d)) and r != revision}


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


def _unschedulable(pod: dict[str, Any]) -> Problem | None:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            text = cond.get("message", "")
            # The resource that rules out the most nodes first: that is what to add (or ask less of).
            counted = sorted(((int(n), r) for n, r in _INSUFFICIENT.findall(text)), key=lambda c: -c[0])
            known = [r for _, r in counted if r in CAPACITY_REASONS]
            name = pod["metadata"]["name"]
            if known:
                reason = CAPACITY_REASONS[known[0]][0]
                what = ", ".join(f"{m} ({CAPACITY_REASONS[m][1]})" for m in known)
                return Problem(reason, f"{_role(pod)} pod {name} cannot be scheduled: no node has enough {what}. {text}")
            return Problem("Unschedulable", f"{_role(pod)} pod {name} cannot be scheduled: {text}")
    return None


def _container_problem(pod: dict[str, Any]) -> Problem | None:
    name = pod["metadata"]["name"]
    status = pod.get("status", {})
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") in CRASH_WAITING_REASONS:
            detail = f" (exit code {last.get('exitCode')}: {last.get('message') or last.get('reason')})" if last else ""
            return Problem("CrashLoop", f"{_role(pod)} pod {name}: container {cs.get('name')} is crash-looping{detail}")
        if waiting.get("reason") in IMAGE_WAITING_REASONS:
            return Problem("ImagePullFailed", f"{_role(pod)} pod {name}: {waiting.get('message') or waiting.get('reason')}")
    return None


def _preflight_results(pods: Iterable[dict[str, Any]]) -> tuple[list[Problem], int]:
    """(failures, passes) of the preflight init containers of P and D pods."""
    failures, passes = [], 0
    for pod in pods:
        for cs in pod.get("status", {}).get("initContainerStatuses") or []:
            if cs.get("name") != "preflight":
                continue
            for state in ((cs.get("state") or {}).get("terminated"), (cs.get("lastState") or {}).get("terminated")):
                if not state:
                    continue
                if state.get("exitCode") == 0:
                    passes += 1
                else:
                    parsed = parse_termination_message(state.get("message") or "")
                    reason, message = parsed or ("PreflightFailed", state.get("message") or state.get("reason") or "")
                    failures.append(Problem(reason, f"{_role(pod)} pod {pod['metadata']['name']}: {message}"))
                break
    return failures, passes


def condition(
    type_: str, ok: bool | None, reason: str, message: str, generation: int | None, previous: dict[str, dict[str, Any]], now: str
) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    before = previous.get(type_)
    changed = before is None or before.get("status") != status
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def _previous_conditions(previous_status: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (previous_status or {}).get("conditions") or [] if "type" in c}


def invalid_status(
    problems: list[str], generation: int | None, previous_status: dict[str, Any] | None, now: str
) -> dict[str, Any]:
    """The spec passed admission (or none ran) but cannot be served: say what to change, keep the rest."""
    prev = _previous_conditions(previous_status)
    message = "; ".join(problems)
    kept = {k: v for k, v in (previous_status or {}).items() if k in ("prefill", "decode", "router", "revision")}
    return {
        **kept,
        "observedGeneration": generation,
        "phase": "Invalid",
        "conditions": [
            condition("Ready", False, "InvalidSpec", message, generation, prev, now),
            condition("Progressing", False, "InvalidSpec", "fix the spec; nothing running was changed", generation, prev, now),
        ],
    }


def compute(
    rendered: Rendered,
    observed: Observed,
    *,
    name: str,
    namespace: str,
    router_port: int,
    generation: int | None,
    previous_status: dict[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    revision = rendered.revision
    prev = _previous_conditions(previous_status)
    roles = {role: role_counts(observed, role, revision) for role in contract.ENGINE_ROLES}
    wanted = {role: desired_replicas(observed, role, revision) for role in contract.ENGINE_ROLES}
    router_wanted = desired_replicas(observed, "router", revision) or 0
    routers = router_ready(observed)
    old = old_revisions(observed, revision)

    engine_pods = [p for p in observed.pods if _role(p) in contract.ENGINE_ROLES and not _terminating(p)]
    current_pods = [p for p in engine_pods if _revision(p) == revision]
    fabric_failures, fabric_passes = _preflight_results(current_pods)
    capacity = next(filter(None, map(_unschedulable, current_pods)), None)
    crash = next(filter(None, map(_container_problem, observed.pods)), None)

    def role_ready(role: str) -> bool:
        want = wanted[role]
        return want is not None and roles[role]["readyReplicas"] >= max(1, want)

    engines_ready = all(role_ready(r) for r in contract.ENGINE_ROLES)
    ready = engines_ready and routers >= router_wanted
    summary = ", ".join(
        f"{r} {roles[r]['readyReplicas']}/{wanted[r] if wanted[r] is not None else '?'}" for r in contract.ENGINE_ROLES
    ) + f", router {routers}/{router_wanted} ready at revision {revision}"

    if ready:
        ready_cond = ("Ready", True, "Ready", summary)
    elif fabric_failures:
        ready_cond = ("Ready", False, fabric_failures[0].reason, fabric_failures[0].message)
    elif crash:
        ready_cond = ("Ready", False, crash.reason, crash.message)
    elif capacity:
        ready_cond = ("Ready", False, capacity.reason, capacity.message)
    elif any(wanted[r] == 0 for r in contract.ENGINE_ROLES):
        ready_cond = ("Ready", False, "ScaledToZero", f"a role has 0 replicas: {summary}")
    else:
        ready_cond = ("Ready", False, "WaitingForPods", summary)

    rolling = bool(old)
    progressing = not ready or rolling
    if rolling:
        progress_cond = ("Progressing", True, "RolloutInProgress",
                         f"revision {revision} is coming up; revisions {', '.join(sorted(old))} keep serving until it is ready")
    elif progressing:
        progress_cond = ("Progressing", True, "WaitingForPods", summary)
    else:
        progress_cond = ("Progressing", False, "Complete", f"revision {revision} is fully rolled out")

    short = [r for r in contract.ENGINE_ROLES if wanted[r] and 0 < roles[r]["readyReplicas"] < wanted[r]]
    degraded_problem = crash or (fabric_failures[0] if fabric_failures else None)
    if degraded_problem:
        degraded = ("Degraded", True, degraded_problem.reason, degraded_problem.message)
    elif short:
        degraded = ("Degraded", True, "ReducedCapacity", f"serving below the desired size: {summary}")
    else:
        degraded = ("Degraded", False, "AsExpected", "")

    if fabric_failures:
        fabric = ("FabricReady", False, fabric_failures[0].reason, fabric_failures[0].message)
    elif fabric_passes:
        fabric = ("FabricReady", True, "PreflightPassed", f"{rendered.plan.backend} preflight passed on {fabric_passes} pod(s)")
    else:
        fabric = ("FabricReady", None, "NoPreflightYet", "no prefill or decode pod has run its preflight yet")

    conditions = [condition(t, ok, reason, msg, generation, prev, now) for t, ok, reason, msg in (ready_cond, progress_cond, degraded, fabric)]
    phase = "Ready" if ready else ("Degraded" if degraded[1] else ("Progressing" if any(roles[r]["updatedReplicas"] for r in roles) else "Pending"))
    return {
        "observedGeneration": generation,
        "phase": phase,
        "transferMode": rendered.plan.mode,
        "transferModeReason": rendered.plan.reason,
        "backend": rendered.plan.backend,
        "revision": revision,
        "prefill": roles["prefill"],
        "decode": roles["decode"],
        "router": {"readyReplicas": routers, "url": contract.router_url(name, namespace, router_port)},
        "conditions": conditions,
    }
