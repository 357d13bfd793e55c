"""Every condition type and reason the operator writes on a DisaggregatedModel, declared once.

Each reason has the condition it appears in, its class and one line that says what it means or what to do.
The class is what generic readers act on:

- ``ok``: all is as it should be.
- ``transient``: clears by itself (pods starting, a rollout, the API server busy, a write that raced).
- ``capacity``: the cluster lacks what the pods ask for: add nodes or devices, or ask for less.
- ``failing``: pods fail (an image, a crash, the fabric): look at them; a fix may need a change.
- ``needs-change``: no pass can progress until someone changes the spec or the cluster (kstatus `Stalled`).

Read from here: status.py (STALLED_REASONS, RETRIED_REASONS), the Argo CD health script's `passing` table
(checked by tests/unit/test_vocabulary.py), kstatus's Stalled set, docs/reasons.md (generated), and the
reasons of the Events the operator records on the model (EVENT_REASONS, and the condition reasons). Reasons made in the data plane (the preflight
program's, the router's KV verdicts) are declared here as well, and a test checks that the connector's lists
match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReasonClass = Literal["ok", "transient", "capacity", "failing", "needs-change"]

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
FABRIC_READY, KV_TRANSFER_HEALTHY, GANG_SCHEDULED = "FabricReady", "KVTransferHealthy", "GangScheduled"
RECONCILING, STALLED = "Reconciling", "Stalled"

CONDITION_TYPES: dict[str, str] = {
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


@dataclass(frozen=True)
class Reason:
    name: str
    conditions: tuple[str, ...]  # the condition types it appears in
    klass: ReasonClass
    doc: str


def _r(name: str, conditions: str, klass: ReasonClass, doc: str) -> Reason:
    return Reason(name, tuple(conditions.split()), klass, doc)


REASONS: tuple[Reason, ...] = (
    # --- serving and progress ---------------------------------------------------------------------------
    _r("Ready", "Ready", "ok", "The model serves at the size asked (or is on its way there within the rollout budget)."),
    _r("ScaledToZero", "Ready", "ok", "A role is scaled to 0 as asked: done, though nothing serves until it scales up."),
    _r("WaitingForPods", "Ready Progressing", "transient", "Pods of the current revision are starting."),
    _r("RolloutInProgress", "Progressing", "transient", "A new revision replaces the old in pod steps; the message says what still serves and what drains."),
    _r("Scaling", "Progressing", "transient", "A role resizes; pods that leave drain first (the message names what holds each)."),
    _r("Complete", "Progressing Reconciling", "ok", "The current revision alone serves at the targets."),
    _r("AsExpected", "Degraded Stalled", "ok", "Nothing is wrong."),
    _r("ReducedCapacity", "Degraded", "capacity", "Serving below the size asked, beyond the rollout budget, for the reason in the message."),
    # --- what a pass could not do -----------------------------------------------------------------------
    _r("InvalidSpec", "Ready Progressing Stalled Reconciling", "needs-change", "The spec cannot be served (admission was bypassed): fix the fields named."),
    _r("ChildRejected", "Ready Degraded Stalled Reconciling", "needs-change", "The API server refuses a child: its message names the field; nothing was changed."),
    _r("OwnershipConflict", "Ready Degraded Stalled Reconciling", "needs-change", "An object of a child's name exists and is not this model's: delete or rename it, or rename the model."),
    _r("KindNotInstalled", "Ready Degraded Stalled Reconciling", "needs-change", "The cluster does not serve a kind a child needs (LeaderWorkerSet for engines that span pods; InferencePool and HTTPRoute for spec.gateway): install it as the message says."),
    _r("Forbidden", "Ready Degraded Stalled Reconciling", "needs-change", "The operator's RBAC does not allow a write: install the chart's ClusterRole."),
    _r("QuotaExceeded", "Ready Degraded Stalled Reconciling", "needs-change", "A ResourceQuota refuses a child or its pods: raise the quota or ask for less."),
    _r("PodCreationFailed", "Ready Degraded Stalled Reconciling", "needs-change", "A ReplicaSet cannot create pods (PodSecurity, a missing PriorityClass, a LimitRange): the API server's words follow."),
    _r("Conflict", "Ready Degraded Progressing", "transient", "A write raced another writer; retried at once."),
    _r("ApiUnavailable", "Ready Degraded Progressing", "transient", "The API server did not answer; retried with backoff."),
    _r("ApplyFailed", "Ready Degraded Progressing", "transient", "A write failed for another reason (the API server's words follow); retried with backoff."),
    _r("InternalError", "Ready Progressing", "failing", "The operator failed on this model (a bug): see its log; retried with backoff."),
    # --- pods -----------------------------------------------------------------------------------------------
    _r("CrashLoop", "Ready Degraded", "failing", "A container crash-loops: its last exit message follows."),
    _r("ImagePullFailed", "Ready Degraded", "failing", "An image cannot be pulled: check its name and the pull secrets."),
    _r("InsufficientGPUs", "Ready Degraded", "capacity", "No node has enough free nvidia.com/gpu."),
    _r("InsufficientNeuronDevices", "Ready Degraded", "capacity", "No node has enough free aws.amazon.com/neuron."),
    _r("InsufficientEFADevices", "Ready Degraded", "capacity", "No node has enough free vpc.amazonaws.com/efa."),
    _r("InsufficientHugepages", "Ready Degraded", "capacity", "No node has enough free 2Mi hugepages."),
    _r("InsufficientCPU", "Ready Degraded", "capacity", "No node has enough free CPU."),
    _r("InsufficientMemory", "Ready Degraded", "capacity", "No node has enough free memory."),
    _r("Unschedulable", "Ready Degraded", "capacity", "A pod fits no node for another reason (selectors, taints, affinity): the scheduler's words follow."),
    # --- the fabric (the preflight program's own reasons, disagg_connector.contract.preflight.REASONS) --------------
    _r("PreflightPassed", "FabricReady", "ok", "The preflight passed on the pods counted."),
    _r("NoPreflightYet", "FabricReady", "transient", "No prefill or decode pod has run its preflight yet."),
    _r("PreflightFailed", "Ready Degraded FabricReady", "failing", "The preflight failed without a message of ours: see the init container's log."),
    _r("NixlImportFailed", "Ready Degraded FabricReady", "failing", "NIXL cannot be imported in the engine image: use an image with NIXL."),
    _r("NixlBackendUnavailable", "Ready Degraded FabricReady", "failing", "The NIXL backend (LIBFABRIC, UCX) is not in the image or cannot start."),
    _r("EfaDevicesMissing", "Ready Degraded FabricReady", "failing", "The pod sees fewer EFA devices than it asks for: check the EFA device plugin."),
    _r("AcceleratorsMissing", "Ready Degraded FabricReady", "failing", "The pod sees fewer accelerators than it asks for."),
    _r("HugepagesMissing", "Ready Degraded FabricReady", "failing", "The pod has fewer 2Mi hugepages than EFA needs."),
    _r("SharedMemoryTooSmall", "Ready Degraded FabricReady", "failing", "/dev/shm is smaller than spec.network.efa.sharedMemory."),
    # --- gangs, for engines that span pods (render/gang.py) ------------------------------------------------------
    _r("PodGroups", "GangScheduled", "ok", "Each LeaderWorkerSet group has its PodGroup, or each revision its prefill/decode pair's: the scheduler binds them together or not at all."),
    _r("PodGroupsNotServed", "GangScheduled", "capacity", "The cluster does not serve scheduling.k8s.io/v1beta1 PodGroups: an engine's pods are bound one by one, and a group that fits in part holds the GPUs of the pods bound. Turn on GenericWorkload (docs/gang-scheduling.md)."),
    _r("GroupUnschedulable", "Ready Degraded", "capacity", "An engine that spans pods cannot be bound as a whole: none of its pods holds a node; the message names the engine and what it lacks."),
    # --- KV transfer, from the routers (disagg_connector.contract.health verdicts) ---------------------------
    _r("TransfersSucceeding", "KVTransferHealthy", "ok", "Requests of every revision got their KV recently."),
    _r("TransfersFailing", "KVTransferHealthy", "failing", "Decode engines fail to receive the KV cache: see the revision in the message."),
    _r("DeadlinesHit", "KVTransferHealthy", "failing", "Legs or the wait for the KV cache pass the router's deadline."),
    _r("ProtocolMismatch", "KVTransferHealthy", "needs-change", "A prefill answered in another transfer mode than its pods announce."),
    _r("NoTransferCompleted", "KVTransferHealthy", "transient", "Requests came, none got as far as a KV transfer yet."),
    _r("NoTrafficYet", "KVTransferHealthy", "transient", "No disaggregated request has been served yet."),
    _r("NotCheckedYet", "KVTransferHealthy", "transient", "The routers have not been asked yet."),
    _r("NoRouterReady", "KVTransferHealthy", "transient", "The router is not up yet: no router pod is ready to ask."),
    _r("RouterStarting", "KVTransferHealthy", "transient", "The router pods became ready moments ago (under 2 minutes) and do not answer on /health yet."),
    _r("RouterUnreachable", "KVTransferHealthy", "failing", "No router pod answered on /health though ready for 2 minutes or more: check that network policies let the operator in."),
)

# Reasons of the Events the operator records on a model (events.py) besides the condition reasons above
# (a refused child, a failed write, Ready lost and KV transfers failing use those).
EVENT_REASONS: dict[str, str] = {
    "RolloutStarted": "A new revision started replacing the old one.",
    "RolloutStep": "A revision's role changed size in a rollout (new pods come, old ones go).",
    "RolloutComplete": "The new revision serves alone.",
    "Scaled": "A role changed size to its target (spec, kubectl scale, an HPA).",
    "PodDraining": "A pod that leaves was marked draining: the routers send it nothing new.",
    "PodRetired": "A draining pod is idle (no router has anything in flight on it) and goes.",
    "DrainTimedOut": "A draining pod went at spec.rollout.drainTimeoutSeconds without a router saying it was idle.",
    "RevisionRetired": "An old revision's Deployment was deleted once its pods were gone.",
}

BY_NAME: dict[str, Reason] = {r.name: r for r in REASONS}
# Event reasons of the table above that need someone's attention.
WARNING_EVENT_REASONS = frozenset({"DrainTimedOut"})


def event_type(reason: str) -> Literal["Normal", "Warning"]:
    """An Event's type from its reason: Warning for a condition reason that is not good news (any class but
    ok) and for the Event reasons that need attention; Normal otherwise."""
    known = BY_NAME.get(reason)
    if known is not None:
        return "Normal" if known.klass == "ok" else "Warning"
    return "Warning" if reason in WARNING_EVENT_REASONS or reason not in EVENT_REASONS else "Normal"


def of_class(klass: ReasonClass, condition: str | None = None) -> tuple[str, ...]:
    return tuple(r.name for r in REASONS if r.klass == klass and (condition is None or condition in r.conditions))


# Ready=False reasons only a change clears: kstatus reads Stalled=True as Failed instead of waiting.
STALLED_REASONS = of_class("needs-change", READY)
# Write failures that retrying clears: while the model serves they go to Progressing, not Ready.
RETRIED_REASONS = tuple(r for r in of_class("transient", READY) if r != "WaitingForPods")


def markdown_table() -> str:
    """docs/reasons.md's table (regenerated with DISAGG_UPDATE_GOLDEN=1, checked by a test)."""
    lines = ["| condition | meaning |", "|---|---|"]
    lines += [f"| `{t}` | {doc} |" for t, doc in CONDITION_TYPES.items()]
    lines += ["", "| reason | conditions | class | meaning |", "|---|---|---|---|"]
    lines += [f"| `{r.name}` | {', '.join(r.conditions)} | {r.klass} | {r.doc} |" for r in REASONS]
    lines += ["", "| Event reason (besides the reasons above) | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {doc} |" for name, doc in EVENT_REASONS.items()]
    return "\n".join(lines) + "\n"
