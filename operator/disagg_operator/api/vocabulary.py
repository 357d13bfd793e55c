"""Every condition type and reason the operator writes on a DisaggregatedModel, declared once.

Each reason has the condition it appears in, its class and one line that says what it means or what to do.
The class is what generic readers act on:

- ``ok``: all is as it should be.
- ``transient``: clears by itself (pods starting, a rollout, the API server busy, a write that raced).
- ``capacity``: the cluster lacks what the pods ask for: add nodes or devices, or ask for less.
- ``failing``: pods fail (an image, a crash, the fabric): look at them; a fix may need a change.
- ``needs-change``: no pass can progress until someone changes the spec or the cluster (kstatus `Stalled`).

Read from here: status.py (STALLED_REASONS, RETRIED_REASONS), the Argo CD health script's `passing` table
(checked by tests/unit/operator/api/test_vocabulary.py), kstatus's Stalled set, docs/reasons.md (generated), and the
reasons of the Events the operator records on the model (EVENT_REASONS, and the condition reasons). Reasons made in the data plane (the preflight
program's, the router's KV verdicts) are declared in the data plane's contract (PreflightReason, KVReason: the
data plane never imports the operator) and taken from there into Reason, so each string is written once.

The names are typed: condition types, condition reasons and Event reasons are StrEnums (ConditionType, Reason,
EventReason), whose members are the very strings on the wire (`Reason.CRASH_LOOP == "CrashLoop"`). Code writes
`Reason.CRASH_LOOP`, never the bare string: a misspelt name is an AttributeError, not a reason no alert knows.
A member without its line of doc, or a line without its member, fails the import of this module (_check).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from disagg_connector.contract.health import KVReason, RouterEventReason
from disagg_connector.contract.preflight import PreflightReason

ReasonClass = Literal["ok", "transient", "capacity", "failing", "needs-change"]


class ConditionType(StrEnum):
    """The type of every condition the operator writes (a StrEnum: its members are the strings on the wire)."""

    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    FABRIC_READY = "FabricReady"
    KV_TRANSFER_HEALTHY = "KVTransferHealthy"
    GANG_SCHEDULED = "GangScheduled"
    RECONCILING = "Reconciling"
    STALLED = "Stalled"


READY, PROGRESSING, DEGRADED = ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED
FABRIC_READY, KV_TRANSFER_HEALTHY = ConditionType.FABRIC_READY, ConditionType.KV_TRANSFER_HEALTHY
GANG_SCHEDULED, RECONCILING, STALLED = ConditionType.GANG_SCHEDULED, ConditionType.RECONCILING, ConditionType.STALLED

CONDITION_TYPES: dict[ConditionType, str] = {
    READY: "The model serves: a router and a ready prefill/decode pair of one revision, each role at the size asked "
           "or on its way there within spec.rollout.<role>.maxUnavailable.",
    PROGRESSING: "A rollout, a resize or a drain runs (True), or the current revision alone serves at the targets.",
    DEGRADED: "Something is wrong while the model serves (a failing pod, short of its size for a reason).",
    FABRIC_READY: "The preflight of prefill and decode pods found the NIXL backend and the EFA devices.",
    KV_TRANSFER_HEALTHY: "The routers see KV transfers succeed in every revision (their own numbers).",
    GANG_SCHEDULED: "Each engine's pods (a PodGroup per LeaderWorkerSet group), or a revision's first prefill and "
                    "decode pods (one-pod engines), are bound all together or not at all. Shown where the cluster serves "
                    "PodGroups, and where it does not for an engine that spans pods.",
    RECONCILING: "For kstatus readers (Flux): True while Progressing is.",
    STALLED: "For kstatus readers (Flux): True while Ready is False for a reason no retry clears.",
}


class Reason(StrEnum):
    """Every condition reason: the operator's own, and the data plane's (the preflight's PreflightReason and the
    routers' KV verdicts, KVReason, declared in disagg_connector.contract and taken from there). A misspelt
    member is an AttributeError where it is used; a member without its line in REASONS fails this import."""

    READY = "Ready"
    SCALED_TO_ZERO = "ScaledToZero"
    WAITING_FOR_PODS = "WaitingForPods"
    ROLLOUT_IN_PROGRESS = "RolloutInProgress"
    SCALING = "Scaling"
    COMPLETE = "Complete"
    AS_EXPECTED = "AsExpected"
    REDUCED_CAPACITY = "ReducedCapacity"
    INVALID_SPEC = "InvalidSpec"
    CHILD_REJECTED = "ChildRejected"
    OWNERSHIP_CONFLICT = "OwnershipConflict"
    KIND_NOT_INSTALLED = "KindNotInstalled"
    FORBIDDEN = "Forbidden"
    QUOTA_EXCEEDED = "QuotaExceeded"
    POD_CREATION_FAILED = "PodCreationFailed"
    CONFLICT = "Conflict"
    API_UNAVAILABLE = "ApiUnavailable"
    APPLY_FAILED = "ApplyFailed"
    INTERNAL_ERROR = "InternalError"
    CRASH_LOOP = "CrashLoop"
    IMAGE_PULL_FAILED = "ImagePullFailed"
    INSUFFICIENT_GPUS = "InsufficientGPUs"
    INSUFFICIENT_NEURON_DEVICES = "InsufficientNeuronDevices"
    INSUFFICIENT_EFA_DEVICES = "InsufficientEFADevices"
    INSUFFICIENT_HUGEPAGES = "InsufficientHugepages"
    INSUFFICIENT_CPU = "InsufficientCPU"
    INSUFFICIENT_MEMORY = "InsufficientMemory"
    UNSCHEDULABLE = "Unschedulable"
    PREFLIGHT_PASSED = "PreflightPassed"
    NO_PREFLIGHT_YET = "NoPreflightYet"
    PREFLIGHT_FAILED = "PreflightFailed"
    NIXL_IMPORT_FAILED = PreflightReason.NIXL_IMPORT_FAILED.value
    NIXL_BACKEND_UNAVAILABLE = PreflightReason.NIXL_BACKEND_UNAVAILABLE.value
    EFA_DEVICES_MISSING = PreflightReason.EFA_DEVICES_MISSING.value
    ACCELERATORS_MISSING = PreflightReason.ACCELERATORS_MISSING.value
    HUGEPAGES_MISSING = PreflightReason.HUGEPAGES_MISSING.value
    SHARED_MEMORY_TOO_SMALL = PreflightReason.SHARED_MEMORY_TOO_SMALL.value
    POD_GROUPS = "PodGroups"
    POD_GROUPS_NOT_SERVED = "PodGroupsNotServed"
    PODS_OUTSIDE_GROUPS = "PodsOutsideGroups"
    PARTLY_BOUND = "PartlyBound"
    GROUP_UNSCHEDULABLE = "GroupUnschedulable"
    TRANSFERS_SUCCEEDING = KVReason.TRANSFERS_SUCCEEDING.value
    TRANSFERS_FAILING = KVReason.TRANSFERS_FAILING.value
    DEADLINES_HIT = KVReason.DEADLINES_HIT.value
    PROTOCOL_MISMATCH = KVReason.PROTOCOL_MISMATCH.value
    NO_TRANSFER_COMPLETED = KVReason.NO_TRANSFER_COMPLETED.value
    NO_TRAFFIC_YET = KVReason.NO_TRAFFIC_YET.value
    NOT_CHECKED_YET = "NotCheckedYet"
    NO_ROUTER_READY = "NoRouterReady"
    ROUTER_STARTING = "RouterStarting"
    ROUTER_UNREACHABLE = "RouterUnreachable"


@dataclass(frozen=True)
class ReasonDoc:
    name: Reason
    conditions: tuple[ConditionType, ...]  # the condition types it appears in
    klass: ReasonClass
    doc: str


def _r(name: Reason, conditions: str, klass: ReasonClass, doc: str) -> ReasonDoc:
    return ReasonDoc(name, tuple(ConditionType(c) for c in conditions.split()), klass, doc)


REASONS: tuple[ReasonDoc, ...] = (
    # --- serving and progress ---------------------------------------------------------------------------
    _r(Reason.READY, "Ready", "ok", "The model serves at the size asked (or is on its way there within the rollout budget)."),
    _r(Reason.SCALED_TO_ZERO, "Ready", "ok", "A role is scaled to 0 as asked: done, though nothing serves until it scales up."),
    _r(Reason.WAITING_FOR_PODS, "Ready Progressing", "transient", "Pods of the current revision are starting."),
    _r(Reason.ROLLOUT_IN_PROGRESS, "Progressing", "transient", "A new revision replaces the old in pod steps; the message says what still serves and what drains."),
    _r(Reason.SCALING, "Progressing", "transient", "A role resizes; pods that leave drain first (the message names what holds each)."),
    _r(Reason.COMPLETE, "Progressing Reconciling", "ok", "The current revision alone serves at the targets."),
    _r(Reason.AS_EXPECTED, "Degraded Stalled", "ok", "Nothing is wrong."),
    _r(Reason.REDUCED_CAPACITY, "Degraded", "capacity", "Serving below the size asked, beyond the rollout budget, for the reason in the message."),
    # --- what a pass could not do -----------------------------------------------------------------------
    _r(Reason.INVALID_SPEC, "Ready Progressing Stalled Reconciling", "needs-change", "The spec cannot be served (admission was bypassed): fix the fields named."),
    _r(Reason.CHILD_REJECTED, "Ready Degraded Stalled Reconciling", "needs-change", "The API server refuses a child: its message names the field; nothing was changed."),
    _r(Reason.OWNERSHIP_CONFLICT, "Ready Degraded Stalled Reconciling", "needs-change", "An object of a child's name exists and is not this model's: delete or rename it, or rename the model."),
    _r(Reason.KIND_NOT_INSTALLED, "Ready Degraded Stalled Reconciling", "needs-change", "The cluster does not serve a kind a child needs (LeaderWorkerSet for engines that span pods; InferencePool and HTTPRoute for spec.gateway): install it as the message says."),
    _r(Reason.FORBIDDEN, "Ready Degraded Stalled Reconciling", "needs-change", "The operator's RBAC does not allow a write: install the chart's ClusterRole."),
    _r(Reason.QUOTA_EXCEEDED, "Ready Degraded Stalled Reconciling", "needs-change", "A ResourceQuota refuses a child or its pods: raise the quota or ask for less."),
    _r(Reason.POD_CREATION_FAILED, "Ready Degraded Stalled Reconciling", "needs-change", "A ReplicaSet cannot create pods (PodSecurity, a missing PriorityClass, a LimitRange): the API server's words follow."),
    _r(Reason.CONFLICT, "Ready Degraded Progressing", "transient", "A write raced another writer; retried at once."),
    _r(Reason.API_UNAVAILABLE, "Ready Degraded Progressing", "transient", "The API server did not answer; retried with backoff."),
    _r(Reason.APPLY_FAILED, "Ready Degraded Progressing", "transient", "A write failed for another reason (the API server's words follow); retried with backoff."),
    _r(Reason.INTERNAL_ERROR, "Ready Progressing", "failing", "The operator failed on this model (a bug): see its log; retried with backoff."),
    # --- pods -----------------------------------------------------------------------------------------------
    _r(Reason.CRASH_LOOP, "Ready Degraded", "failing", "A container crash-loops: its last exit message follows."),
    _r(Reason.IMAGE_PULL_FAILED, "Ready Degraded", "failing", "An image cannot be pulled: check its name and the pull secrets."),
    _r(Reason.INSUFFICIENT_GPUS, "Ready Degraded", "capacity", "No node has enough free nvidia.com/gpu."),
    _r(Reason.INSUFFICIENT_NEURON_DEVICES, "Ready Degraded", "capacity", "No node has enough free aws.amazon.com/neuron."),
    _r(Reason.INSUFFICIENT_EFA_DEVICES, "Ready Degraded", "capacity", "No node has enough free vpc.amazonaws.com/efa."),
    _r(Reason.INSUFFICIENT_HUGEPAGES, "Ready Degraded", "capacity", "No node has enough free 2Mi hugepages."),
    _r(Reason.INSUFFICIENT_CPU, "Ready Degraded", "capacity", "No node has enough free CPU."),
    _r(Reason.INSUFFICIENT_MEMORY, "Ready Degraded", "capacity", "No node has enough free memory."),
    _r(Reason.UNSCHEDULABLE, "Ready Degraded", "capacity", "A pod fits no node for another reason (selectors, taints, affinity): the scheduler's words follow."),
    # --- the fabric (the preflight program's own reasons, disagg_connector.contract.preflight.REASONS) --------------
    _r(Reason.PREFLIGHT_PASSED, "FabricReady", "ok", "The preflight passed on the pods counted."),
    _r(Reason.NO_PREFLIGHT_YET, "FabricReady", "transient", "No prefill or decode pod has run its preflight yet."),
    _r(Reason.PREFLIGHT_FAILED, "Ready Degraded FabricReady", "failing", "The preflight failed without a message of ours: see the init container's log."),
    _r(Reason.NIXL_IMPORT_FAILED, "Ready Degraded FabricReady", "failing", "NIXL cannot be imported in the engine image: use an image with NIXL."),
    _r(Reason.NIXL_BACKEND_UNAVAILABLE, "Ready Degraded FabricReady", "failing", "The NIXL backend (LIBFABRIC, UCX) is not in the image or cannot start."),
    _r(Reason.EFA_DEVICES_MISSING, "Ready Degraded FabricReady", "failing", "The pod sees fewer EFA devices than it asks for: check the EFA device plugin."),
    _r(Reason.ACCELERATORS_MISSING, "Ready Degraded FabricReady", "failing", "The pod sees fewer accelerators than it asks for."),
    _r(Reason.HUGEPAGES_MISSING, "Ready Degraded FabricReady", "failing", "The pod has fewer 2Mi hugepages than EFA needs."),
    _r(Reason.SHARED_MEMORY_TOO_SMALL, "Ready Degraded FabricReady", "failing", "/dev/shm is smaller than spec.network.efa.sharedMemory."),
    # --- gangs, for engines that span pods (render/gang.py) ------------------------------------------------------
    _r(Reason.POD_GROUPS, "GangScheduled", "ok", "Each LeaderWorkerSet group has its PodGroup, or each revision its prefill/decode pair's: the scheduler binds them together or not at all."),
    _r(Reason.POD_GROUPS_NOT_SERVED, "GangScheduled", "capacity", "The cluster does not serve scheduling.k8s.io/v1beta1 PodGroups: an engine's pods are bound one by one, and a group that fits in part holds the GPUs of the pods bound. Turn on GenericWorkload (docs/gang-scheduling.md)."),
    _r(Reason.PODS_OUTSIDE_GROUPS, "GangScheduled", "needs-change", "PodGroups are served, but engine pods are in no PodGroup (or another than theirs): the chart's admission policy, which puts an LWS group's pods in their PodGroup, is missing or does not match them. Install the chart, or its policy alone (docs/gang-scheduling.md); pods made before it stay outside until recreated."),
    _r(Reason.PARTLY_BOUND, "Ready Degraded GangScheduled", "capacity", "A gang is partly bound: some of its pods hold a node and their accelerators while the others cannot be scheduled, so it serves nothing. The message names it, what it holds and why the gang did not hold."),
    _r(Reason.GROUP_UNSCHEDULABLE, "Ready Degraded", "capacity", "An engine that spans pods cannot be bound as a whole: none of its pods holds a node; the message names the engine and what it lacks."),
    # --- KV transfer, from the routers (disagg_connector.contract.health verdicts) ---------------------------
    _r(Reason.TRANSFERS_SUCCEEDING, "KVTransferHealthy", "ok", "Requests of every revision got their KV recently."),
    _r(Reason.TRANSFERS_FAILING, "KVTransferHealthy", "failing", "Decode engines fail to receive the KV cache: see the revision in the message."),
    _r(Reason.DEADLINES_HIT, "KVTransferHealthy", "failing", "Legs or the wait for the KV cache pass the router's deadline."),
    _r(Reason.PROTOCOL_MISMATCH, "KVTransferHealthy", "needs-change", "A prefill answered in another transfer mode than its pods announce."),
    _r(Reason.NO_TRANSFER_COMPLETED, "KVTransferHealthy", "transient", "Requests came, none got as far as a KV transfer yet."),
    _r(Reason.NO_TRAFFIC_YET, "KVTransferHealthy", "transient", "No disaggregated request has been served yet."),
    _r(Reason.NOT_CHECKED_YET, "KVTransferHealthy", "transient", "The routers have not been asked yet."),
    _r(Reason.NO_ROUTER_READY, "KVTransferHealthy", "transient", "The router is not up yet: no router pod is ready to ask."),
    _r(Reason.ROUTER_STARTING, "KVTransferHealthy", "transient", "The router pods became ready moments ago (under 2 minutes) and do not answer on /health yet."),
    _r(Reason.ROUTER_UNREACHABLE, "KVTransferHealthy", "failing", "No router pod answered on /health though ready for 2 minutes or more: check that network policies let the operator in."),
)


class EventReason(StrEnum):
    """Reasons of the Events recorded on a model besides the condition reasons above: the operator's (events.py) and
    the routers' (RouterEventReason, declared in disagg_connector.contract and taken from there)."""

    ROLLOUT_STARTED = "RolloutStarted"
    ROLLOUT_STEP = "RolloutStep"
    ROLLOUT_COMPLETE = "RolloutComplete"
    SCALED = "Scaled"
    POD_DRAINING = "PodDraining"
    POD_RETIRED = "PodRetired"
    DRAIN_TIMED_OUT = "DrainTimedOut"
    REVISION_RETIRED = "RevisionRetired"
    STREAMS_MIGRATED = RouterEventReason.STREAMS_MIGRATED.value
    STREAMS_CUT = RouterEventReason.STREAMS_CUT.value
    AUTOSCALER_RECOMMENDS = "AutoscalerRecommends"
    AUTOSCALER_SCALED = "AutoscalerScaled"
    AUTOSCALER_BLOCKED = "AutoscalerBlocked"


# What each Event reason means (a refused child, a failed write, Ready lost and KV transfers failing use the
# condition reasons above).
EVENT_REASONS: dict[EventReason, str] = {
    EventReason.ROLLOUT_STARTED: "A new revision started replacing the old one.",
    EventReason.ROLLOUT_STEP: "A revision's role changed size in a rollout (new pods come, old ones go).",
    EventReason.ROLLOUT_COMPLETE: "The new revision serves alone.",
    EventReason.SCALED: "A role changed size to its target (spec, kubectl scale, an HPA).",
    EventReason.POD_DRAINING: "A pod that leaves was marked draining: the routers send it nothing new.",
    EventReason.POD_RETIRED: "A draining pod is idle (no router has anything in flight on it) and goes.",
    EventReason.DRAIN_TIMED_OUT: "A draining pod went at spec.rollout.drainTimeoutSeconds without a router saying it was idle.",
    EventReason.REVISION_RETIRED: "An old revision's Deployment was deleted once its pods were gone.",
    EventReason.AUTOSCALER_RECOMMENDS: "The SLO autoscaler (spec.autoscaling, Advisory) decided on other sizes than the "
    "roles have: status.autoscaling says which and why (docs/autoscaling.md).",
    EventReason.AUTOSCALER_SCALED: "The SLO autoscaler (spec.autoscaling, Active) set other sizes than the roles had: "
    "status.autoscaling says which and why; a role that shrinks drains its leaving engines first.",
    EventReason.AUTOSCALER_BLOCKED: "The SLO autoscaler would grow a role whose engines cannot be scheduled: it holds "
    "that role's size and says the scheduler's reason (more nodes, or a smaller budget).",
    EventReason.STREAMS_MIGRATED: "A router: a decode engine failed mid-stream and every stream on it went on, "
    "continued on another pair (or already whole); clients saw a pause (docs/router.md, stream migration).",
    EventReason.STREAMS_CUT: "A router: a decode engine failed mid-stream and some of its streams were cut (an error "
    "event, no [DONE]): the note says why; see docs/alerts.md, DisaggStreamsCut.",
}

BY_NAME: dict[str, ReasonDoc] = {r.name: r for r in REASONS}
# Event reasons of the table above that need someone's attention.
WARNING_EVENT_REASONS = frozenset({EventReason.DRAIN_TIMED_OUT, EventReason.STREAMS_CUT, EventReason.AUTOSCALER_BLOCKED})


def _check() -> None:
    """One line of doc per member, no more (at import: a reason without its line cannot ship), and the data
    plane's reasons are reasons of the conditions they go into."""
    for enum, table in ((Reason, [r.name for r in REASONS]), (ConditionType, list(CONDITION_TYPES)),
                        (EventReason, list(EVENT_REASONS))):  # fmt: skip
        if sorted(table) != sorted(enum) or len(set(table)) != len(table):
            raise ImportError(f"vocabulary: {enum.__name__} and its table differ: {sorted(set(enum) ^ set(table))}")
    for made, where in ((PreflightReason, FABRIC_READY), (KVReason, KV_TRANSFER_HEALTHY)):
        wrong = [r for r in made if where not in BY_NAME[r].conditions]
        if wrong:
            raise ImportError(f"vocabulary: {made.__name__} {wrong} not declared as {where} reasons")


_check()


def event_type(reason: str) -> Literal["Normal", "Warning"]:
    """An Event's type from its reason: Warning for a condition reason that is not good news (any class but
    ok) and for the Event reasons that need attention; Normal otherwise."""
    known = BY_NAME.get(reason)
    if known is not None:
        return "Normal" if known.klass == "ok" else "Warning"
    return "Warning" if reason in WARNING_EVENT_REASONS or reason not in EVENT_REASONS else "Normal"


def of_class(klass: ReasonClass, condition: ConditionType | None = None) -> tuple[Reason, ...]:
    return tuple(r.name for r in REASONS if r.klass == klass and (condition is None or condition in r.conditions))


# Ready=False reasons only a change clears: kstatus reads Stalled=True as Failed instead of waiting.
STALLED_REASONS = of_class("needs-change", READY)
# Write failures that retrying clears: while the model serves they go to Progressing, not Ready.
RETRIED_REASONS = tuple(r for r in of_class("transient", READY) if r != Reason.WAITING_FOR_PODS)


def markdown_table() -> str:
    """docs/reasons.md's table (regenerated with DISAGG_UPDATE_GOLDEN=1, checked by a test)."""
    lines = ["| condition | meaning |", "|---|---|"]
    lines += [f"| `{t}` | {doc} |" for t, doc in CONDITION_TYPES.items()]
    lines += ["", "| reason | conditions | class | meaning |", "|---|---|---|---|"]
    lines += [f"| `{r.name}` | {', '.join(r.conditions)} | {r.klass} | {r.doc} |" for r in REASONS]
    lines += ["", "| Event reason (besides the reasons above) | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {doc} |" for name, doc in EVENT_REASONS.items()]
    return "\n".join(lines) + "\n"
