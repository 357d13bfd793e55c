"""Status from what is observed, and from what a pass could not do: pure functions only.

Ready means serving: a router is ready, some revision has a ready prefill and decode (the router pairs
within a revision), and each role serves at its target or is on its way there (a rollout, a resize)
without a problem that leaves it short by more than spec.rollout.<role>.maxUnavailable. So Ready stays True
through a routine rollout and through a bad image's rollout while the old revision serves (as a
Deployment stays Available); Progressing says a rollout or resize runs, Degraded that something is wrong
while serving. Progressing=False Complete only when the current revision alone serves at the targets
(Readiness.rolled_out). A pod that cannot be scheduled becomes a capacity reason naming the resource; a
crash loop, a failed fabric preflight and a Deployment that cannot create pods have reasons of their own. A
pass that cannot write because of something only a change clears (a child refused by the API server, a
same-named object someone else owns, RBAC, quota) says so in Ready (and Degraded, while something still
serves), naming the child and the API server's message; a write that retrying clears (RETRIED_REASONS)
says so in Progressing while the model serves, and in Ready otherwise. A condition's lastTransitionTime moves only when its status flips, so an
unchanged world yields an identical status and no write.

Besides its own conditions every status carries the two that generic tools read (kstatus, and with it
Flux, kpt and `cli-utils`): `Reconciling` (True while Progressing is) and `Stalled` (True while Ready is
False for a reason no pass can clear without someone changing something: STALLED_REASONS). Both are
derived from Ready and Progressing in one place (_with_generic_conditions), on every path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence, cast

from disagg_connector import contract
from disagg_connector.contract.preflight import parse_termination_message

from . import rollout, sizing
from .api import vocabulary
from .api.vocabulary import (
    DEGRADED, FABRIC_READY, GANG_SCHEDULED, KV_TRANSFER_HEALTHY, PROGRESSING, READY, RECONCILING, STALLED, ConditionType,
    Reason,
)
from .api.models import DisaggregatedModelStatus
from . import gangs
from .render import gang
from .state import Census, ChildProblem, Desired, Obj, Observed, PodView, RouterView, revision_of, role_of

# Scheduler messages count nodes per cause: "0/8 nodes are available: 6 Insufficient vpc.amazonaws.com/efa, ...".
_INSUFFICIENT = re.compile(r"(\d+) Insufficient ([\w./-]*\w)")
CAPACITY_REASONS = {
    contract.ACCELERATOR_RESOURCES["nvidia"]: (Reason.INSUFFICIENT_GPUS, "GPUs"),
    contract.ACCELERATOR_RESOURCES["neuron"]: (Reason.INSUFFICIENT_NEURON_DEVICES, "Neuron devices"),
    contract.EFA_RESOURCE: (Reason.INSUFFICIENT_EFA_DEVICES, "EFA devices"),
    contract.HUGEPAGES_RESOURCE: (Reason.INSUFFICIENT_HUGEPAGES, "2Mi hugepages"),
    "cpu": (Reason.INSUFFICIENT_CPU, "CPU"),
    "memory": (Reason.INSUFFICIENT_MEMORY, "memory"),
}
# Kubernetes's words on a pod (its PodScheduled condition, a container's waiting state), not ours.
_POD_UNSCHEDULABLE, _SCHEDULER_ERROR = "Unschedulable", "SchedulerError"
CRASH_WAITING_REASONS = {"CrashLoopBackOff"}
IMAGE_WAITING_REASONS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName"}
CONDITION_TYPES = tuple(vocabulary.CONDITION_TYPES)
# Ready=False reasons that only a change clears (the spec, a same-named object, RBAC, admission policy, a quota):
# retrying cannot make progress, so kstatus should report Failed instead of waiting out its timeout.
STALLED_REASONS = vocabulary.STALLED_REASONS
# Write failures that retrying clears (the API server busy or away, a write that raced another writer).
RETRIED_REASONS = vocabulary.RETRIED_REASONS
# Worst first: what a revision's router verdicts say, when several routers disagree.
_KV_REASONS = (Reason.PROTOCOL_MISMATCH, Reason.TRANSFERS_FAILING, Reason.DEADLINES_HIT)
# How long after its pod became Ready a router that does not answer /health yet is taken to be starting (its
# process not listening yet) rather than out of the operator's reach (a network policy).
ROUTER_START_GRACE_S = 120


pod_ready = contract.pod_serving


def role_counts(observed: Observed, role: str, revision: str) -> dict[str, int]:
    """In engines (a pod, or a LeaderWorkerSet group for an engine that spans pods). replicas: of the role
    across revisions; updated: of the current revision; ready: current revision engines whose every pod is
    Ready (the only ones that can serve paired with the current revision)."""
    census = observed.census
    return {
        "replicas": census.count_engines(role, terminating=False),
        "readyReplicas": census.count_engines(role, revision, ready=True),
        "updatedReplicas": census.count_engines(role, revision, terminating=False),
    }


def desired_replicas(observed: Observed, role: str, revision: str) -> int | None:
    for deploy in observed.workloads:
        if role_of(deploy) == role and revision_of(deploy) in (revision, None):
            return int(deploy.get("spec", {}).get("replicas", 1))
    return None


@dataclass(frozen=True)
class Readiness:
    """What serves now, and how far the current revision is: counts per role, the roles' targets and how many
    ready engines each may lack during a rollout or a resize (spec.rollout.<role>.maxUnavailable)."""

    revision: str
    roles: Mapping[str, Mapping[str, int]]  # the current revision's counts
    wanted: Mapping[str, int]  # the role targets (sizing.targets)
    routers_ready: int
    routers_wanted: int
    serving: Mapping[str, int] = field(default_factory=dict)  # ready engines per role in revisions with a ready pair
    unavailable: Mapping[str, int] = field(default_factory=dict)  # per role: ready engines it may lack

    @property
    def engines_ready(self) -> bool:
        return all(self.roles[r]["readyReplicas"] >= max(1, self.wanted[r]) for r in contract.ENGINE_ROLES)

    @property
    def routers_ok(self) -> bool:
        return self.routers_ready >= max(1, self.routers_wanted)

    @property
    def rolled_out(self) -> bool:
        """The current revision alone serves at the targets (the end of a rollout or a resize)."""
        return self.engines_ready and self.routers_ready >= self.routers_wanted

    @property
    def serves(self) -> bool:
        """Requests are answered: a router is ready and some revision has a ready prefill and decode."""
        return self.routers_ok and all(self.serving.get(r, 0) > 0 for r in contract.ENGINE_ROLES)

    @property
    def short(self) -> tuple[str, ...]:
        """Roles serving fewer ready engines than their target less what the rollout budget lets them lack."""
        return tuple(r for r in contract.ENGINE_ROLES
                     if self.serving.get(r, 0) < self.wanted[r] - self.unavailable.get(r, 0))  # fmt: skip

    @property
    def scaled_to_zero_as_asked(self) -> bool:
        """A role's target is 0 and every role has the ready engines its target asks (no more can serve)."""
        return (any(self.wanted[r] == 0 for r in contract.ENGINE_ROLES)
                and all(self.roles[r]["readyReplicas"] >= self.wanted[r] for r in contract.ENGINE_ROLES)
                and self.routers_ready >= self.routers_wanted)  # fmt: skip

    def summary(self) -> str:
        engines = ", ".join(f"{r} {self.roles[r]['readyReplicas']}/{self.wanted[r]}" for r in contract.ENGINE_ROLES)
        return f"{engines}, router {self.routers_ready}/{self.routers_wanted} ready at revision {self.revision}"

    def serving_summary(self) -> str:
        return ", ".join(f"{r} {self.serving.get(r, 0)}/{self.wanted[r]}" for r in contract.ENGINE_ROLES) + \
            f" ready engines serve, router {self.routers_ready}/{self.routers_wanted}"


def _serving(observed: Observed) -> dict[str, int]:
    """Ready engines per role across the revisions that have a ready pair (the router pairs within a revision)."""
    paired = observed.census.paired_revisions()
    return {role: sum(1 for e in observed.census.engines(role, ready=True) if e.revision in paired) for role in contract.ENGINE_ROLES}


def readiness(desired: Desired, observed: Observed, targets: Mapping[str, int]) -> Readiness:
    revision, spec = desired.revision, desired.model.spec
    budgets = {r: rollout.budget(targets[r], getattr(spec.rollout, r).max_surge, getattr(spec.rollout, r).max_unavailable)
               for r in contract.ENGINE_ROLES}  # fmt: skip
    return Readiness(
        revision=revision,
        roles={role: role_counts(observed, role, revision) for role in contract.ENGINE_ROLES},
        wanted=dict(targets),
        routers_ready=observed.census.count("router", ready=True),
        routers_wanted=desired_replicas(observed, "router", revision) or 0,
        serving=_serving(observed),
        unavailable={r: b.unavailable for r, b in budgets.items()},
    )


def something_serves(observed: Observed) -> bool:
    return observed.census.count(ready=True) > 0


def old_revisions(observed: Observed, revision: str) -> set[str]:
    return {r for d in observed.workloads if (r := revision_of(d)) and r != revision}


@dataclass(frozen=True)
class Problem:
    reason: Reason
    message: str


def scheduler_error(pod: Obj) -> str | None:
    """The scheduler's words when it failed on the pod rather than found no node (PodScheduled=False,
    SchedulerError): kube-scheduler 1.37 reports so a gang's pod-group cycle in which a member cannot be placed
    for a reason it does not carry over, such as a missing PersistentVolumeClaim."""
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == _SCHEDULER_ERROR:
            return cond.get("message", "")
    return None


def unschedulable_engines(census: Census, revision: str) -> dict[str, tuple[int, str]]:
    """Per engine role, the engines of `revision` with a pod the scheduler cannot place, and the scheduler's words
    of the first (the SLO autoscaler's AutoscalerBlocked; such engines are no capacity)."""
    out = {}
    for role in contract.ENGINE_ROLES:
        stuck = [(v.engine.key, p) for v in census.select(role, revision) if (p := _unschedulable(v.obj)) is not None]
        out[role] = (len({k for k, _ in stuck}), stuck[0][1].message if stuck else "")
    return out


def _unschedulable(pod: Obj, missing_claim: str | None = None) -> Problem | None:
    name = pod["metadata"]["name"]
    if (error := scheduler_error(pod)) is not None:
        if missing_claim is not None:  # what the scheduler would say of the pod alone
            return Problem(Reason.UNSCHEDULABLE, f"{role_of(pod)} pod {name} cannot be scheduled: persistentvolumeclaim "
                           f'"{missing_claim}" not found (spec.model.source.uri): create it, or name a claim that exists; '
                           f"the scheduler says: {error}")  # fmt: skip
        return Problem(Reason.UNSCHEDULABLE, f"{role_of(pod)} pod {name} cannot be scheduled: the scheduler fails on it: {error}")
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == _POD_UNSCHEDULABLE:
            text = cond.get("message", "")
            # The resource that rules out the most nodes first: that is what to add (or ask less of).
            counted = sorted(((int(n), r) for n, r in _INSUFFICIENT.findall(text)), key=lambda c: -c[0])
            known = [r for _, r in counted if r in CAPACITY_REASONS]
            if known:
                reason = CAPACITY_REASONS[known[0]][0]
                what = ", ".join(f"{m} ({CAPACITY_REASONS[m][1]})" for m in known)
                return Problem(reason, f"{role_of(pod)} pod {name} cannot be scheduled: no node has enough {what}. {text}")
            return Problem(Reason.UNSCHEDULABLE, f"{role_of(pod)} pod {name} cannot be scheduled: {text}")
    return None


def _scheduling_problem(pods: list[PodView], missing_claim: str | None = None) -> Problem | None:
    """The first pod that cannot be scheduled, or the first engine of several pods that cannot be, named as one:
    with a gang none of its pods is bound, and what it lacks is in one member's message (the others wait for
    their group), so the reason is that member's, or GroupUnschedulable."""
    problems = {p.name: problem for p in pods if (problem := _unschedulable(p.obj, missing_claim))}
    # a pod that lacks something first: one that only waits for its gang says less
    first = min((p for p in pods if p.name in problems), key=lambda p: problems[p.name].reason == Reason.UNSCHEDULABLE, default=None)
    if first is None or first.engine.pods == 1:
        return problems[first.name] if first else None
    members = [p for p in pods if p.engine.key == first.engine.key and p.revision == first.revision and p.name in problems]
    lacking = next((problems[p.name] for p in members if problems[p.name].reason != Reason.UNSCHEDULABLE), None)
    words = "; ".join(problems[p.name].message for p in members)
    return Problem(lacking.reason if lacking else Reason.GROUP_UNSCHEDULABLE,
                   f"{first.role} engine {first.engine.key} ({first.engine.pods} pods, bound together or not at all): "
                   f"{len(members)} of its pods cannot be scheduled: {words}")


def _with_partly_bound(problem: Problem | None, membership: gangs.Membership) -> Problem | None:
    """A gang partly bound holds accelerators and serves nothing: Ready's message names it and what it holds."""
    if not membership.partly_bound:
        return problem
    words = "; ".join(p.describe() for p in membership.partly_bound)
    return Problem(problem.reason, f"{problem.message}; {words}") if problem else Problem(Reason.PARTLY_BOUND, words)


def _container_problem(pod: Obj) -> Problem | None:
    name = pod["metadata"]["name"]
    status = pod.get("status", {})
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") in CRASH_WAITING_REASONS:
            detail = f" (exit code {last.get('exitCode')}: {last.get('message') or last.get('reason')})" if last else ""
            return Problem(Reason.CRASH_LOOP, f"{role_of(pod)} pod {name}: container {cs.get('name')} is crash-looping{detail}")
        if waiting.get("reason") in IMAGE_WAITING_REASONS:
            return Problem(Reason.IMAGE_PULL_FAILED, f"{role_of(pod)} pod {name}: {waiting.get('message') or waiting.get('reason')}")
    return None


def _pod_creation_problem(deployment: Obj) -> Problem | None:
    """The ReplicaSet cannot create pods (quota, PodSecurity, a missing PriorityClass, a LimitRange): the
    Deployment controller copies the ReplicaSet's ReplicaFailure condition up, with the API server's words."""
    for cond in deployment.get("status", {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            text = cond.get("message", "")
            reason = Reason.QUOTA_EXCEEDED if "exceeded quota" in text else Reason.POD_CREATION_FAILED
            name = deployment["metadata"]["name"]
            return Problem(reason, f"{role_of(deployment)} Deployment {name} cannot create pods: {text}")
    return None


def _preflight_results(pods: Iterable[Obj]) -> tuple[list[Problem], int]:
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
                    reason, message = parsed or (Reason.PREFLIGHT_FAILED, state.get("message") or state.get("reason") or "")
                    failures.append(Problem(Reason(reason), f"{role_of(pod)} pod {pod['metadata']['name']}: {message}"))
                break
    return failures, passes


def condition(
    type_: ConditionType, ok: bool | None, reason: Reason, message: str, generation: int | None, previous: Mapping[str, Any], now: str
) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    before = _previous_conditions(previous).get(type_)
    changed = before is None or before.get("status") != status
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def _previous_conditions(previous_status: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (previous_status or {}).get("conditions") or [] if "type" in c}


def _typed(status: dict[str, Any]) -> dict[str, Any]:
    """The status through its API model: a misspelled or misplaced key fails here, not silently in the
    API server's pruning."""
    return DisaggregatedModelStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True)


def _with_generic_conditions(
    status: dict[str, Any], generation: int | None, previous: Mapping[str, Any], now: str
) -> dict[str, Any]:
    """The status with kstatus's abnormal-true conditions derived from Ready and Progressing (kstatus reads
    Reconciling=True as InProgress before anything else, Stalled=True as Failed: cli-utils
    pkg/kstatus/status/generic.go), then typed."""
    found = {c["type"]: c for c in status.get("conditions") or []}
    ready, progressing = found.get(READY) or {}, found.get(PROGRESSING) or {}
    stalled = ready.get("status") == "False" and ready.get("reason") in STALLED_REASONS
    if stalled:
        why = cast(Reason, ready["reason"])  # one of STALLED_REASONS
        found[STALLED] = condition(STALLED, True, why, ready.get("message", ""), generation, previous, now)
        found[RECONCILING] = condition(RECONCILING, False, why, "no pass can progress until that changes",
                                         generation, previous, now)  # fmt: skip
    else:
        found[STALLED] = condition(STALLED, False, Reason.AS_EXPECTED, "", generation, previous, now)
        reconciling = progressing.get("status") == "True"
        found[RECONCILING] = condition(RECONCILING, reconciling, cast(Reason, progressing.get("reason", Reason.COMPLETE)),
                                         progressing.get("message", "") if reconciling else "", generation, previous, now)  # fmt: skip
    conditions = [found[t] for t in CONDITION_TYPES if t in found]
    return _typed({**status, "conditions": conditions})


def unservable(
    reason: Reason, message: str, next_step: str, generation: int | None, previous_status: Mapping[str, Any] | None,
    now: str, phase: str = "Invalid",
) -> dict[str, Any]:
    """The pass could not get as far as a plan: say why and what to do; keep the counts already reported."""
    # vllmVersion too: what the engines run, which the next valid spec keeps (resolve.held_release)
    kept = {k: v for k, v in (previous_status or {}).items()
            if k in ("prefill", "decode", "router", "revision", "vllmVersion", "autoscaling")}
    conditions = [
        condition(READY, False, reason, message, generation, previous_status or {}, now),
        condition(PROGRESSING, False, reason, next_step, generation, previous_status or {}, now),
    ]  # fmt: skip
    return _with_generic_conditions({**kept, "observedGeneration": generation, "phase": phase, "conditions": conditions},
                                    generation, previous_status or {}, now)


def invalid_status(
    problems: list[str], generation: int | None, previous_status: Mapping[str, Any] | None, now: str
) -> dict[str, Any]:
    """The spec passed admission (or none ran) but cannot be served: say what to change, keep the rest."""
    return unservable(Reason.INVALID_SPEC, "; ".join(problems), "fix the spec; nothing running was changed",
                      generation, previous_status, now)  # fmt: skip


def _old_serving(observed: Observed, revision: str, old: set[str]) -> str:
    parts = []
    for v in sorted(old):
        ready = {r: observed.census.count_engines(r, v, ready=True) for r in contract.ENGINE_ROLES}
        parts.append(f"{v} (prefill {ready['prefill']}, decode {ready['decode']} ready)")
    return ", ".join(parts)


def compute(desired: Desired, observed: Observed, targets: Mapping[str, int], now: str,
            draining: Mapping[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The status of what is observed, assuming this pass can do what it plans. `draining`: pods that are
    leaving -> what still holds each, in words (empty when nothing is known)."""
    draining = draining or {}
    ref, plan, revision = desired.ref, desired.rendered.plan, desired.revision
    previous = desired.previous_status or {}
    facts = readiness(desired, observed, targets)
    engine_pods = [p for r in contract.ENGINE_ROLES for p in observed.census.select(r, terminating=False)]
    # An older revision is still rolling out while its Deployments or its pods remain (the garbage collector
    # takes the pods after the Deployments: status counts them until they terminate).
    old = old_revisions(observed, revision) | {p.revision for p in engine_pods if p.revision and p.revision != revision}
    current_pods = [p.obj for p in engine_pods if p.revision == revision]
    current_deployments = [d for d in observed.workloads if revision_of(d) in (revision, None)]
    fabric_failures, fabric_passes = _preflight_results(current_pods)
    membership = gangs.membership(observed.pods, [r for r in contract.ENGINE_ROLES if targets.get(r, 0) > 0])
    capacity = _with_partly_bound(_scheduling_problem([p for p in engine_pods if p.revision == revision], observed.missing_claim), membership)
    crash = next(filter(None, map(_container_problem, observed.pods)), None)
    creation = next(filter(None, map(_pod_creation_problem, current_deployments)), None)
    summary = facts.summary()

    first_problem = (fabric_failures[0] if fabric_failures else None) or crash or creation or capacity
    # Ready means serving: True while some revision has a ready pair and the roles serve at their targets, or
    # are on their way there (a rollout, a resize) without a problem that leaves them short beyond the budget.
    serving = facts.serving_summary()
    if facts.serves and not (facts.short and first_problem):
        ready_cond = (READY, True, Reason.READY, summary if facts.rolled_out else serving)
    elif facts.scaled_to_zero_as_asked:
        # As asked (like a Deployment at 0 replicas): done, though nothing serves until the role scales up.
        ready_cond = (READY, True, Reason.SCALED_TO_ZERO, f"a role is scaled to 0 as asked; nothing is served until it scales up: {summary}")
    elif first_problem:
        below = f"serving below the size asked ({serving}): " if facts.serves else ""
        ready_cond = (READY, False, first_problem.reason, below + first_problem.message)
    elif any(facts.wanted[r] == 0 for r in contract.ENGINE_ROLES):
        ready_cond = (READY, False, Reason.WAITING_FOR_PODS, f"a role is scaled to 0 and the other is not ready yet: {summary}")
    else:
        ready_cond = (READY, False, Reason.WAITING_FOR_PODS, summary)

    leaving = "; draining " + ", ".join(f"{pod} ({why})" if why else pod for pod, why in draining.items()) if draining else ""
    # A problem that does not stop serving (a surge pod without a node, a crash of the new revision) holds
    # the rollout up: Progressing says so.
    held = f"; {first_problem.reason}: {first_problem.message}" if first_problem and ready_cond[1] else ""
    if old:
        progress_cond = (PROGRESSING, True, Reason.ROLLOUT_IN_PROGRESS,
                         f"revision {revision} is rolling out ({summary}); still serving: "
                         f"{_old_serving(observed, revision, old)}{leaving}{held}")
    elif draining:
        progress_cond = (PROGRESSING, True, Reason.SCALING, f"{summary}{leaving}{held}")
    elif not (facts.rolled_out or facts.scaled_to_zero_as_asked):
        progress_cond = (PROGRESSING, True, Reason.WAITING_FOR_PODS, f"{summary}{held}")
    else:
        progress_cond = (PROGRESSING, False, Reason.COMPLETE, f"revision {revision} is fully rolled out")

    # A failed preflight before a crash loop, as for Ready: a kubelet restarts the failed preflight in back-off
    # (CrashLoopBackOff), and the preflight's own reason says what to change.
    degraded_problem = (fabric_failures[0] if fabric_failures else None) or crash or (creation if something_serves(observed) else None)
    if degraded_problem:
        degraded = (DEGRADED, True, degraded_problem.reason, degraded_problem.message)
    elif facts.serves and facts.short and first_problem:
        degraded = (DEGRADED, True, Reason.REDUCED_CAPACITY, f"serving below the desired size ({serving}): {first_problem.message}")
    else:
        degraded = (DEGRADED, False, Reason.AS_EXPECTED, "")

    if fabric_failures:
        fabric = (FABRIC_READY, False, fabric_failures[0].reason, fabric_failures[0].message)
    elif fabric_passes:
        fabric = (FABRIC_READY, True, Reason.PREFLIGHT_PASSED, f"{plan.backend} preflight passed on {fabric_passes} pod(s)")
    else:
        fabric = (FABRIC_READY, None, Reason.NO_PREFLIGHT_YET, "no prefill or decode pod has run its preflight yet")

    ready_ages = router_ready_ages(observed, observed.routers.names, now) if observed.routers is not None else ()
    kv = (KV_TRANSFER_HEALTHY, *kv_transfer(observed.routers, previous, ready_ages))
    gang_condition = [g] if (g := gang_scheduled(desired, observed, membership)) else []
    conditions = [condition(t, ok, reason, msg, ref.generation, previous, now)
                  for t, ok, reason, msg in (ready_cond, progress_cond, degraded, fabric, kv, *gang_condition)]  # fmt: skip
    return _with_generic_conditions({
        "observedGeneration": ref.generation,
        "phase": _phase(facts, ready_cond[1], degraded[1]),
        "transferMode": plan.mode,
        "transferModeReason": plan.reason,
        "backend": plan.backend,
        "vllmVersion": plan.vllm_version,
        "revision": revision,
        **({"autoscaling": dict(observed.autoscaling)} if observed.autoscaling is not None else {}),
        "prefill": {**facts.roles["prefill"], "targetReplicas": facts.wanted["prefill"]},
        "decode": {**facts.roles["decode"], "targetReplicas": facts.wanted["decode"]},
        "router": {"readyReplicas": facts.routers_ready, "url": contract.router_url(ref.name, ref.namespace, desired.model.spec.router.service.port)},
        "conditions": conditions,
    }, ref.generation, previous, now)  # fmt: skip


def gang_scheduled(desired: Desired, observed: Observed, membership: gangs.Membership) -> tuple[ConditionType, bool, Reason, str] | None:
    """GangScheduled, for a model with PodGroups (render/gang.py) whose cluster was asked whether it serves them:
    True only while every pod of a gang is in its PodGroup (spec.schedulingGroup, as the census holds the pods)
    and no gang is partly bound; a partly bound gang is named first, with what it holds and why."""
    spec = desired.model.spec
    spanning = [f"{r} ({getattr(spec, r).shape.pods} pods)" for r in contract.ENGINE_ROLES if getattr(spec, r).shape.spans_pods]
    pairs = gang.pairs(desired.model)
    if not (spanning or pairs) or observed.pod_groups_served is None:
        return None
    if not observed.pod_groups_served and not spanning:
        return None  # pods bound one by one, as on most clusters today: no news for one-pod engines
    if not observed.pod_groups_served:
        cause = (Reason.POD_GROUPS_NOT_SERVED, f"the pods of the engines of {' and '.join(spanning)} are bound one by one, "
                 f"and a group that fits only in part holds the accelerators of the pods bound: {gang.INSTALL_HINT}")  # fmt: skip
    elif membership.outside:
        names = ", ".join(f"{m.name} (in {m.actual or 'none'}, not {m.wanted})" for m in membership.outside[:4])
        more = f" and {len(membership.outside) - 4} more" if len(membership.outside) > 4 else ""
        fix = gang.UNNAMED_HINT if gang.names_pair(desired.model) else gang.POLICY_HINT
        cause = (Reason.PODS_OUTSIDE_GROUPS, f"{len(membership.outside)} of the model's {len(membership.members)} gang pods are not "
                 f"in their PodGroup: {names}{more}; they are bound one by one. {fix}")  # fmt: skip
    else:
        cause = None
    if membership.partly_bound:
        why = f"; why: {cause[1]}" if cause else ""
        return (GANG_SCHEDULED, False, Reason.PARTLY_BOUND, "; ".join(p.describe() for p in membership.partly_bound) + why)
    if cause:
        return (GANG_SCHEDULED, False, *cause)
    what = [f"each engine of {' and '.join(spanning)} is one PodGroup: its pods are bound all together or not at all"] if spanning else []
    what += ["a revision's first prefill and decode engines are bound together or not at all"] if pairs else []
    return (GANG_SCHEDULED, True, Reason.POD_GROUPS, "; ".join(what))


def kv_transfer(routers: RouterView | None, previous: Mapping[str, Any],
                ready_ages: Sequence[float | None] = ()) -> tuple[bool | None, Reason, str]:  # fmt: skip
    """KVTransferHealthy from the routers' own numbers (contract.health.Verdict per revision, over its recent
    window): False as soon as a router sees transfers failing, deadlines hit or a protocol mismatch in a
    revision; True when they succeed; Unknown before there is anything to judge. Between two reads of the
    routers the condition stays as it was. `ready_ages`: how long each router pod asked has been Ready
    (router_ready_ages), for the words when none answered (silent_routers)."""
    if routers is None:
        before = _previous_conditions(previous).get(KV_TRANSFER_HEALTHY)
        if before is not None:
            ok = {"True": True, "False": False}.get(before.get("status"))
            return ok, cast(Reason, before.get("reason", "")), before.get("message", "")  # as an earlier pass wrote it
        return None, Reason.NOT_CHECKED_YET, "the routers have not been asked yet"
    if not routers.reports:
        return None, Reason.NO_ROUTER_READY, "the router is not up yet: no router pod is ready to ask"
    if all(r is None for r in routers.reports):
        return (None, *silent_routers(ready_ages))
    verdicts = [v for r in routers.reports if r is not None for v in r.verdicts().values()]
    bad = sorted((v for v in verdicts if v.healthy is False), key=lambda v: _KV_REASONS.index(v.reason) if v.reason in _KV_REASONS else 9)
    if bad:
        return False, Reason(bad[0].reason), "; ".join(sorted({v.message for v in bad}))
    good = [v for v in verdicts if v.healthy]
    if good:
        return True, Reason.TRANSFERS_SUCCEEDING, "; ".join(sorted({v.message for v in good}))
    waiting = [v for v in verdicts if v.healthy is None]
    if waiting:
        return None, Reason(waiting[0].reason), "; ".join(sorted({v.message for v in waiting}))
    return None, Reason.NO_TRAFFIC_YET, "the routers know no revision with a ready pair yet"


def silent_routers(ready_ages: Sequence[float | None]) -> tuple[Reason, str]:
    """Reason and message when no ready router pod answered /health. Starting while every one of them became
    Ready less than ROUTER_START_GRACE_S ago (its process may not listen yet); after that (or when it is not
    known since when) unreachable: the operator is kept out, most often by a network policy."""
    where = f"port {contract.ROUTER_PORT} (/health)"
    if ready_ages and all(age is not None and age < ROUTER_START_GRACE_S for age in ready_ages):
        return Reason.ROUTER_STARTING, (f"the router is starting: its pods became ready less than {ROUTER_START_GRACE_S}s ago "
                                  f"and do not answer on {where} yet")  # fmt: skip
    return Reason.ROUTER_UNREACHABLE, (f"no router pod answered on {where}, though ready for {ROUTER_START_GRACE_S}s or more: "
                                 "check that network policies let the operator reach the router")  # fmt: skip


def router_ready_ages(observed: Observed, names: Iterable[str], now: str) -> tuple[float | None, ...]:
    """Seconds each named router pod has been Ready (its Ready condition's lastTransitionTime to `now`); None
    where the pod, the time or `now` cannot be read."""
    pods = {p.get("metadata", {}).get("name"): p for p in observed.pods}
    return tuple(_ready_age(pods.get(name), now) for name in names)


def _ready_age(pod: Obj | None, now: str) -> float | None:
    ready = next((c for c in ((pod or {}).get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
    since = ready.get("lastTransitionTime") if ready.get("status") == "True" else None
    try:
        return (_instant(now) - _instant(since)).total_seconds() if since else None
    except ValueError:
        return None


def _instant(value: str) -> datetime:
    at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if at.tzinfo is None:
        raise ValueError(f"no time zone in {value!r}")
    return at


def _phase(facts: Readiness, ready: bool | None, degraded: bool | None) -> str:
    if ready:
        return "Ready"
    if degraded:
        return "Degraded"
    return "Progressing" if any(facts.roles[r]["updatedReplicas"] for r in contract.ENGINE_ROLES) else "Pending"


def _with_failure(desired: Desired, status: Mapping[str, Any], reason: Reason, message: str, serving: bool, now: str) -> dict[str, Any]:
    """Ready=False with the pass's own reason (and Degraded while the model still serves); the counts and
    the other conditions stay as observed. Transitions are judged against the status the pass began with."""
    previous, generation = desired.previous_status or {}, desired.ref.generation
    kept = {c["type"]: c for c in status.get("conditions") or []}
    kept[READY] = condition(READY, False, reason, message, generation, previous, now)
    if serving:
        kept[DEGRADED] = condition(DEGRADED, True, reason, message, generation, previous, now)
    conditions = [kept[t] for t in CONDITION_TYPES if t in kept]
    phase = "Degraded" if serving else status.get("phase")
    return _with_generic_conditions({**status, "phase": phase, "conditions": conditions}, generation, previous, now)


def blocked(desired: Desired, observed: Observed, targets: Mapping[str, int], problems: Iterable[ChildProblem],
            now: str) -> dict[str, Any]:  # fmt: skip
    """Nothing of this pass was written, because of these problems (the first one's reason leads)."""
    found = list(problems)
    message = "nothing was changed: " + "; ".join(p.describe() for p in found)
    base = compute(desired, observed, targets, now)
    return _with_failure(desired, base, found[0].reason, message, something_serves(observed), now)


def write_failed(
    desired: Desired, observed: Observed, planned: Mapping[str, Any], failure: ChildProblem, done: int, total: int, now: str
) -> dict[str, Any]:
    """A write failed after `done` of `total` actions; the rest is retried with backoff. A failure that the
    retries clear by themselves does not stop a model that serves from being Ready: Progressing says it."""
    message = f"{done} of {total} changes made, then {failure.describe()}; retrying"
    ready = next((c for c in planned.get("conditions") or [] if c.get("type") == READY), {})
    if failure.reason in RETRIED_REASONS and ready.get("status") == "True":
        previous, generation = desired.previous_status or {}, desired.ref.generation
        kept = {c["type"]: c for c in planned.get("conditions") or []}
        kept[PROGRESSING] = condition(PROGRESSING, True, failure.reason, message, generation, previous, now)
        conditions = [kept[t] for t in CONDITION_TYPES if t in kept]
        return _with_generic_conditions({**planned, "conditions": conditions}, generation, previous, now)
    return _with_failure(desired, planned, failure.reason, message, something_serves(observed), now)


@dataclass(frozen=True)
class PassOutcome:
    """How a pass ended, all that the status of any outcome needs (KubeRay's calculateStatus(instance, err)):
    an internal error (`crashed`), an invalid spec (`invalid`), or a plan (`planned`: the status it would
    make) carried out in part (`failure` after `done` of `total` actions; `ApiUnavailable` when the API server
    was away before anything was planned, then `planned` is None)."""

    generation: int | None
    previous: Mapping[str, Any] | None
    desired: Desired | None = None
    observed: Observed | None = None
    planned: Mapping[str, Any] | None = None
    failure: ChildProblem | None = None
    done: int = 0
    total: int = 0
    invalid: tuple[str, ...] = ()
    crashed: str | None = None


def of_outcome(outcome: PassOutcome, now: str) -> dict[str, Any]:
    """The one function that builds the status of a pass, whatever its outcome."""
    if outcome.crashed is not None:
        return unservable(Reason.INTERNAL_ERROR, f"the operator failed on this model ({outcome.crashed}); see its log",
                          "retrying with backoff", outcome.generation, outcome.previous, now,
                          phase=(outcome.previous or {}).get("phase") or "Pending")  # fmt: skip
    if outcome.invalid:
        return invalid_status(list(outcome.invalid), outcome.generation, outcome.previous, now)
    desired, observed = outcome.desired, outcome.observed
    assert desired is not None and observed is not None, "a plan's outcome needs its desired and observed worlds"
    planned = outcome.planned
    if planned is None:  # nothing was planned: what is observed, as it is
        planned = compute(desired, observed, sizing.targets(desired, observed), now)
    if outcome.failure is not None:
        return write_failed(desired, observed, planned, outcome.failure, outcome.done, outcome.total, now)
    return dict(planned)
