"""Gangs: one PodGroup per LeaderWorkerSet group, so that an engine's pods bind all together or not at all.

Kubernetes' Workload API (scheduling.k8s.io/v1beta1, feature GenericWorkload) gang-schedules the pods of a
PodGroup; LWS v0.9.0 makes none. The chart's MutatingAdmissionPolicy puts every pod labelled
`contract.LABEL_GANG` in the PodGroup named after its group's leader pod, `<LWS name>-<group index>`, and
these are the PodGroups of those names (docs/gang-scheduling.md). A PodGroup is derived from its
LeaderWorkerSet alone, so the planner makes the same ones for the LWS it renders and for older revisions'.
"""

from __future__ import annotations

from typing import Any

from disagg_connector import contract

POD_GROUP_API_VERSION, POD_GROUP_KIND, POD_GROUP_PLURAL = "scheduling.k8s.io/v1beta1", "PodGroup", "podgroups"
INSTALL_HINT = (
    "engines that span pods are gang scheduled through Kubernetes' Workload API: turn on the GenericWorkload "
    "feature gate on kube-apiserver, kube-controller-manager and kube-scheduler and serve scheduling.k8s.io/v1beta1 "
    "(docs/gang-scheduling.md)"
)


def pod_group_name(lws_name: str, index: int) -> str:
    """The name of group `index`'s leader pod, which the admission policy gives every pod of the group."""
    return f"{lws_name}-{index}"


def pod_groups(lws: dict[str, Any], groups: int) -> list[dict[str, Any]]:
    """The PodGroups of groups 0 .. `groups`-1 of `lws` (rendered or observed): all `size` pods of a group or
    none, at the priority of its pods (the scheduler refuses a group whose pods' priority differs from its own),
    owned and labelled like the LWS (the model's child, cleaned up with it)."""
    meta, template = lws["metadata"], lws["spec"]["leaderWorkerTemplate"]
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
        for index in range(groups)
    ]
