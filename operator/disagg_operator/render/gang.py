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

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

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


# --- membership: what the pods say about the gangs (status.gang_scheduled) --------------------------------


def wanted_pod_group(name: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> str | None:
    """The PodGroup a pod of ours belongs in, the way the chart's policy names it (templates/gang-policy.yaml, and
    the operator itself for the pods of one-pod engines, `named_pair`): a pod of the pair (LABEL_POD_GROUP, a
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


def _accelerators(pod: Mapping[str, Any]) -> dict[str, int]:
    held: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for resource in contract.ACCELERATOR_RESOURCES.values():
            count = (resources.get("requests") or {}).get(resource, (resources.get("limits") or {}).get(resource))
            if count is not None:
                held[resource] = held.get(resource, 0) + int(count)
    return held


@dataclass(frozen=True)
class Member:
    """One pod of a gang, as the census holds it."""

    name: str
    role: str | None
    engine: contract.EngineGroup  # the engine it is (part of)
    wanted: str  # the PodGroup it belongs in
    in_pair: bool  # that PodGroup is its revision's pair
    actual: str | None  # the PodGroup it is in (spec.schedulingGroup), if any
    node: str | None  # spec.nodeName: bound
    unschedulable: bool  # PodScheduled=False, Unschedulable
    accelerators: Mapping[str, int]

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> "Member | None":
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        labels, annotations, name = meta.get("labels") or {}, meta.get("annotations") or {}, meta.get("name", "")
        wanted = wanted_pod_group(name, labels, annotations)
        if wanted is None:
            return None
        try:
            engine = contract.engine_group(name, labels, annotations)
        except ValueError:
            engine = contract.EngineGroup(name, 1)
        unschedulable = any(c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
                            for c in (pod.get("status") or {}).get("conditions") or [])  # fmt: skip
        return cls(name, labels.get(contract.LABEL_ROLE), engine, wanted, wanted == labels.get(contract.LABEL_POD_GROUP),
                   (spec.get("schedulingGroup") or {}).get("podGroupName"), spec.get("nodeName"), unschedulable,
                   _accelerators(pod))  # fmt: skip


@dataclass(frozen=True)
class PartlyBound:
    """A gang some of whose pods hold nodes while others cannot be scheduled: it serves nothing and holds what
    its bound pods asked for."""

    group: str
    bound: tuple[Member, ...]
    waiting: tuple[Member, ...]

    @property
    def held(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for member in self.bound:
            for resource, count in member.accelerators.items():
                total[resource] = total.get(resource, 0) + count
        return total

    def describe(self) -> str:
        held = ", ".join(f"{count} {resource}" for resource, count in sorted(self.held.items())) or "no accelerator"
        on = ", ".join(f"{m.name} on {m.node}" for m in self.bound)
        return (f"{self.group} is partly bound: {len(self.bound)} of its {len(self.bound) + len(self.waiting)} pods "
                f"hold {held} ({on}) while {', '.join(m.name for m in self.waiting)} cannot be scheduled")  # fmt: skip


@dataclass(frozen=True)
class Membership:
    """The gangs as the pods show them: the pods outside the PodGroup they belong in, and the gangs partly bound."""

    members: tuple[Member, ...]
    outside: tuple[Member, ...]
    partly_bound: tuple[PartlyBound, ...]


def _whole_engines(bound: Iterable[Member]) -> set[str | None]:
    """The roles of which an engine has all its pods among `bound`."""
    count: dict[tuple[str | None, str], int] = {}
    for member in bound:
        count[member.role, member.engine.key] = count.get((member.role, member.engine.key), 0) + 1
    sizes = {(m.role, m.engine.key): m.engine.pods for m in bound}
    return {role for (role, key), n in count.items() if n >= sizes[role, key]}


def membership(pods: Iterable[Mapping[str, Any]], roles_to_run: Iterable[str] = contract.ENGINE_ROLES) -> Membership:
    """Which pods are in their PodGroups, and which gangs are partly bound: some of its pods bound, another that
    cannot be scheduled, and short of its quorum (an LWS group: all its pods; a pair: a whole engine of each role
    in `roles_to_run`). Pods that terminate are not counted (a recreated group waits for them)."""
    members = tuple(m for pod in pods if not (pod.get("metadata") or {}).get("deletionTimestamp") and (m := Member.of(pod)))
    groups: dict[str, list[Member]] = {}
    for member in members:
        groups.setdefault(member.wanted, []).append(member)
    partly = []
    for group, gang in sorted(groups.items()):
        bound = tuple(m for m in gang if m.node)
        waiting = tuple(m for m in gang if not m.node and m.unschedulable)
        if not (bound and waiting):
            continue
        if any(m.in_pair for m in gang) and _whole_engines(bound) >= set(roles_to_run):
            continue  # the pair is there: more pods of one-pod engines bind one by one
        partly.append(PartlyBound(group, bound, waiting))
    return Membership(members, tuple(m for m in members if m.actual != m.wanted), tuple(partly))


# --- will gangs hold? (`disagg-operator validate` and `plan`) ------------------------------------------------

ADMISSION_API_VERSION = "admissionregistration.k8s.io/v1"
POLICY_KIND, BINDING_KIND = "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"


def policy_covers(policies: Iterable[Mapping[str, Any]], bindings: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """The values of LABEL_GANG whose pods a bound MutatingAdmissionPolicy of the cluster selects on create and
    gives a scheduling group (the chart's, templates/gang-policy.yaml, or one of the same shape)."""
    bound = {(b.get("spec") or {}).get("policyName") for b in bindings}
    covered: set[str] = set()
    for policy in policies:
        spec = policy.get("spec") or {}
        if (policy.get("metadata") or {}).get("name") not in bound or "schedulingGroup" not in str(spec.get("mutations")):
            continue
        selector = (spec.get("matchConstraints") or {}).get("objectSelector") or {}
        if contract.LABEL_GANG in (selector.get("matchLabels") or {}):
            covered.add(selector["matchLabels"][contract.LABEL_GANG])
        for expression in selector.get("matchExpressions") or []:
            if expression.get("key") == contract.LABEL_GANG and expression.get("operator") == "In":
                covered.update(expression.get("values") or [])
    return frozenset(covered)


def outlook(dm: DisaggregatedModel, served: bool | None = None, covered: frozenset[str] | None = None) -> tuple[bool | None, str]:
    """Whether the model's gangs will hold, in words: on the cluster looked at (`served`: PodGroups served;
    `covered`: policy_covers, None when not known), or, with neither, what they need."""
    spanning = [f"{r} engines span {getattr(dm.spec, r).shape.pods} pods" for r in contract.ENGINE_ROLES if getattr(dm.spec, r).shape.spans_pods]
    if not (spanning or pairs(dm)):
        return None, "none: no engine spans pods, and prefill and decode differ in priority or scheduler (no pair)"
    what = "; ".join(spanning + (["a revision's first prefill and decode engines are one gang (the pair)"] if pairs(dm) else []))
    needs = "PodGroups served (GenericWorkload)" + ("" if names_pair(dm) else " and the chart's admission policy, which puts an LWS group's pods in their PodGroup")
    if served is None:
        return None, f"{what}: they need {needs} (docs/gang-scheduling.md)"
    if not served:
        return False, f"will not hold: {what}, but the cluster does not serve PodGroups; {INSTALL_HINT}"
    wanted = set() if names_pair(dm) else {contract.GANG_LWS_GROUP, *([contract.GANG_PAIR] if pairs(dm) else [])}
    if covered is None:
        return None, f"{what}: PodGroups are served; whether an admission policy puts the pods in them could not be read"
    if not wanted <= covered:
        labels = ", ".join(f"{contract.LABEL_GANG}={v}" for v in sorted(wanted - covered))
        return False, (f"will not hold: {what}, but no bound MutatingAdmissionPolicy puts pods labelled {labels} in their "
                       f"PodGroup: apply the chart's (`{POLICY_COMMAND}`)")  # fmt: skip
    how = "the pods name their pair themselves" if names_pair(dm) else "the admission policy puts the pods in their PodGroups"
    return True, f"will hold: {what}; PodGroups are served and {how} (the scheduler needs GenericWorkload too: docs/gang-scheduling.md)"


