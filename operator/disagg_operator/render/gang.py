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

Where every engine is one pod the operator names the pair in the pods' templates itself (`names_pair`), so the
pair holds without the policy. What the pods and the cluster then say of the gangs is gangs.py's.
"""

from __future__ import annotations

from typing import Any, Mapping

from disagg_connector import contract

from ..api.models import DisaggregatedModel, RoleSpec
from .meta import metadata

POD_GROUP_API_VERSION, POD_GROUP_KIND, POD_GROUP_PLURAL = "scheduling.k8s.io/v1beta1", "PodGroup", "podgroups"
INSTALL_HINT = (
    "gangs come from Kubernetes' Workload API: turn on the GenericWorkload "
    "feature gate on kube-apiserver, kube-controller-manager and kube-scheduler and serve scheduling.k8s.io/v1beta1 "
    "(docs/gang-scheduling.md)"
)
# Pods of one-pod engines outside their pair, though their template names it where PodGroups are served.
UNNAMED_HINT = (
    "Their Deployment was made before the cluster served PodGroups, or by an operator that did not name the pair, "
    "and is not changed in place (that would replace its pods outside a rollout's drains): the model's next "
    "revision names it (docs/gang-scheduling.md)"
)
# The policy alone, for an operator installed another way than the chart (its cluster-wide objects only).
POLICY_COMMAND = (
    "helm template disagg-operator charts/disagg-operator --show-only templates/gang-policy.yaml "
    "--api-versions scheduling.k8s.io/v1beta1/PodGroup --api-versions admissionregistration.k8s.io/v1/MutatingAdmissionPolicy "
    "| kubectl apply -f -"
)
POLICY_HINT = (
    "The chart's MutatingAdmissionPolicy, which puts each labelled pod in its PodGroup, is missing or does not match "
    "them: install the chart (gangScheduling.admissionPolicy.enabled, on by default) or its policy alone "
    f"(`{POLICY_COMMAND}`); pods made before it stay outside until recreated (docs/gang-scheduling.md)"
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


# What a pod template hashed into the revision says of its PodGroup, when the operator names the pair itself: the
# pair of the revision the hash makes (`name_pair` writes the name once the revision is known).
PAIR_OF_ITS_REVISION = "pair-of-its-revision"


def names_pair(dm: DisaggregatedModel) -> bool:
    """Whether the operator puts the pods of a revision's pair in their PodGroup itself: where every engine is one
    pod, each pod template (one per revision) can name the revision's pair, so the pair holds without the chart's
    admission policy. An LWS's template is shared by all its groups and cannot name group 0's (the policy does)."""
    return pairs(dm) and not any(getattr(dm.spec, r).shape.spans_pods for r in contract.ENGINE_ROLES)


def pair_scheduling_group(dm: DisaggregatedModel) -> dict[str, Any]:
    """The pod spec's field that puts a pod in its revision's pair (`names_pair`), as hashed."""
    return {"schedulingGroup": {"podGroupName": PAIR_OF_ITS_REVISION}} if names_pair(dm) else {}


def name_pair(template: dict[str, Any], dm: DisaggregatedModel, revision: str) -> dict[str, Any]:
    """The pod template with its revision's pair named, where it names one."""
    if ((template.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName") != PAIR_OF_ITS_REVISION:
        return template
    group = {"podGroupName": contract.pair_pod_group_name(dm.metadata.name, revision)}
    return {**template, "spec": {**template["spec"], "schedulingGroup": group}}


def names_pod_group(workload: dict[str, Any]) -> bool:
    """Whether an engine Deployment's pods name their PodGroup themselves."""
    return "schedulingGroup" in ((workload.get("spec") or {}).get("template") or {}).get("spec", {})


def without_pod_group(workload: dict[str, Any]) -> dict[str, Any]:
    """An engine Deployment whose pods name no PodGroup, for a cluster that serves none (a pod naming one that
    cannot exist would wait forever; an API server without GenericWorkload drops the field, which would read as drift)."""
    if not names_pod_group(workload):
        return workload
    pod = workload["spec"]["template"]
    spec = {k: v for k, v in pod["spec"].items() if k != "schedulingGroup"}
    return {**workload, "spec": {**workload["spec"], "template": {**pod, "spec": spec}}}


def pair_label(dm: DisaggregatedModel, revision: str) -> dict[str, str]:
    """The revision's pair PodGroup, named on its engines' pods. Outside the revision hash (it holds the revision);
    `pairs` follows the roles' priority and scheduler, which are in the hash."""
    return {contract.LABEL_POD_GROUP: contract.pair_pod_group_name(dm.metadata.name, revision)} if pairs(dm) else {}


def wanted_pod_group(name: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> str | None:
    """The PodGroup a pod of ours belongs in, the way the chart's policy names it (templates/gang-policy.yaml, and
    the operator itself for the pods of one-pod engines, `name_pair`): a pod of the pair (LABEL_POD_GROUP, a
    one-pod engine's or one of LWS group 0's) in its revision's pair, any other LWS pod in its leader's group."""
    kind = labels.get(contract.LABEL_GANG)
    if kind == contract.GANG_PAIR:
        return labels.get(contract.LABEL_POD_GROUP)
    lws = labels.get(contract.LWS_NAME_LABEL)
    if kind != contract.GANG_LWS_GROUP or not lws:
        return None
    leader = annotations.get(contract.LWS_LEADER_NAME_ANNOTATION) or name
    pair = labels.get(contract.LABEL_POD_GROUP)
    return pair if pair and leader == pod_group_name(lws, 0) else leader
