"""What the pods and the cluster say of the gangs (render/gang.py makes them). Pure.

- `membership`: from the pods the census holds, which are outside the PodGroup they belong in (the chart's
  admission policy missing) and which gangs are bound only in part (some pods holding nodes and accelerators,
  others refused): status.gang_scheduled and Ready's message read it.
- `outlook`: whether a model's gangs will hold on a cluster (PodGroups served, a bound policy that covers its
  gang labels: `policy_covers`), for `disagg-operator validate --cluster` and `plan --from-cluster`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from disagg_connector import contract

from .api.models import DisaggregatedModel
from .render.gang import INSTALL_HINT, POLICY_COMMAND, names_pair, pairs, wanted_pod_group


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
    if wanted and covered is None:
        return None, f"{what}: PodGroups are served; whether an admission policy puts the pods in them could not be read"
    if not wanted <= (covered or frozenset()):
        labels = ", ".join(f"{contract.LABEL_GANG}={v}" for v in sorted(wanted - (covered or frozenset())))
        return False, (f"will not hold: {what}, but no bound MutatingAdmissionPolicy puts pods labelled {labels} in their "
                       f"PodGroup: apply the chart's (`{POLICY_COMMAND}`)")  # fmt: skip
    how = "the pods name their pair themselves" if names_pair(dm) else "the admission policy puts the pods in their PodGroups"
    return True, f"will hold: {what}; PodGroups are served and {how} (the scheduler needs GenericWorkload too: docs/gang-scheduling.md)"
