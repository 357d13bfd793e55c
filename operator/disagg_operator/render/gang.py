"""Gangs: PodGroups, so that what must run together is bound all together or not at all.

Kubernetes' Workload API (scheduling.k8s.io/v1beta1, feature GenericWorkload) gang-schedules the pods of a
PodGroup; LWS v0.9.0 makes none. The chart's MutatingAdmissionPolicies put every pod labelled
`contract.LABEL_GANG` in its PodGroup, and these are the PodGroups of those names (docs/gang-scheduling.md):

- a revision's first pair: one PodGroup per revision (`pair_pod_group`, named by the pods' LABEL_POD_GROUP)
  holding its prefill and decode pods, or, of a role whose engine spans pods, the pods of its LWS group 0; its
  minCount is one engine of each role (all their pods), so the first pair is bound together or not at all (a
  pair of one half serves nothing and holds its accelerators). Once bound, the gang counts the pods bound: a
  group 0 recreated later waits for all its pods again, while other pods of one-pod engines bind one by one;
- every other LeaderWorkerSet group: its own PodGroup, named after the group's leader pod (`<LWS name>-<group
  index>`), derived from its LeaderWorkerSet alone, so the planner makes the same ones for the LWS it renders
  and for older revisions'.
"""

from __future__ import annotations

from typing import Any

from disagg_connector import contract

from ..api.models import DisaggregatedModel, RoleSpec
from .meta import metadata

POD_GROUP_API_VERSION, POD_GROUP_KIND, POD_GROUP_PLURAL = "scheduling.k8s.io/v1beta1", "PodGroup", "podgroups"
INSTALL_HINT = (
    "gangs come from Kubernetes' Workload API: turn on the GenericWorkload "
    "feature gate on kube-apiserver, kube-controller-manager and kube-scheduler and serve scheduling.k8s.io/v1beta1 "
    "(docs/gang-scheduling.md)"
)


def pod_group_name(lws_name: str, index: int) -> str:
    """The name of group `index`'s leader pod, which the admission policy gives every pod of the group."""
    return f"{lws_name}-{index}"


def pair_of(lws: dict[str, Any]) -> str | None:
    """The pair PodGroup an LWS's group 0 is in (its pods' LABEL_POD_GROUP), if any."""
    return (lws["spec"]["leaderWorkerTemplate"]["workerTemplate"].get("metadata") or {}).get("labels", {}).get(contract.LABEL_POD_GROUP)


def pod_groups(lws: dict[str, Any], groups: int) -> list[dict[str, Any]]:
    """The PodGroups of groups 0 .. `groups`-1 of `lws` (rendered or observed; group 0 is in its revision's pair
    when its pods name one): all `size` pods of a group or none, at the priority of its pods (the scheduler
    refuses a group whose pods' priority differs from its own), owned and labelled like the LWS (the model's
    child, cleaned up with it)."""
    meta, template = lws["metadata"], lws["spec"]["leaderWorkerTemplate"]
    first = 1 if pair_of(lws) else 0
    priority_class = (template["workerTemplate"].get("spec") or {}).get("priorityClassName")
    spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": int(template.get("size") or 1)}}}
    if priority_class:
        spec = {"priorityClassName": priority_class, **spec}
    owned = {k: meta[k] for k in ("namespace", "ownerReferences") if k in meta}
    return [
        {
            "apiVersion": POD_GROUP_API_VERSION,
            "kind": POD_GROUP_KIND,
            "metadata": {
                "name": pod_group_name(meta["name"], index),
                **owned,
                "labels": {**meta.get("labels", {}), contract.LWS_NAME_LABEL: meta["name"],
                           contract.LWS_GROUP_INDEX_LABEL: str(index)},  # fmt: skip
            },
            "spec": spec,
        }
        for index in range(first, groups)
    ]


def pairs(dm: DisaggregatedModel) -> bool:
    """Whether a revision's first prefill and decode engines form one gang: when both roles' pods have the
    priority and the scheduler that one PodGroup's pods must share."""
    roles: list[RoleSpec] = [getattr(dm.spec, r) for r in contract.ENGINE_ROLES]
    return len({r.priority_class_name for r in roles}) == 1 and len({r.scheduler_name for r in roles}) == 1


def pair_min_count(dm: DisaggregatedModel, sizes: dict[str, int]) -> int:
    """All pods of one engine of each role that is to run (a role scaled to 0 does not hold the other back)."""
    return max(1, sum(getattr(dm.spec, r).shape.pods for r, size in sizes.items() if size > 0))


def pair_pod_group(dm: DisaggregatedModel, revision: str, min_count: int) -> dict[str, Any]:
    """The PodGroup of a revision's prefill and decode pods (`pairs`)."""
    model = dm.metadata.name
    labels = {**contract.common_labels(model, "pod-group"), contract.LABEL_REVISION: revision,
              contract.LABEL_GANG: contract.GANG_PAIR}  # fmt: skip
    spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": min_count}}}
    if dm.spec.prefill.priority_class_name:
        spec = {"priorityClassName": dm.spec.prefill.priority_class_name, **spec}
    return {
        "apiVersion": POD_GROUP_API_VERSION,
        "kind": POD_GROUP_KIND,
        "metadata": metadata(dm, contract.pair_pod_group_name(model, revision), labels),
        "spec": spec,
    }


def is_pair_group(obj: dict[str, Any]) -> bool:
    return obj["kind"] == POD_GROUP_KIND and (obj["metadata"].get("labels") or {}).get(contract.LABEL_GANG) == contract.GANG_PAIR


def pod_label(dm: DisaggregatedModel, role: RoleSpec) -> dict[str, str]:
    """The label by which the chart's policy puts a pod in its PodGroup (none when its pods are bound one by one)."""
    if role.shape.spans_pods:
        return {contract.LABEL_GANG: contract.GANG_LWS_GROUP}
    return {contract.LABEL_GANG: contract.GANG_PAIR} if pairs(dm) else {}


def pair_label(dm: DisaggregatedModel, revision: str) -> dict[str, str]:
    """The revision's pair PodGroup, named on its engines' pods. Outside the revision hash (it holds the revision);
    `pairs` follows the roles' priority and scheduler, which are in the hash."""
    return {contract.LABEL_POD_GROUP: contract.pair_pod_group_name(dm.metadata.name, revision)} if pairs(dm) else {}
