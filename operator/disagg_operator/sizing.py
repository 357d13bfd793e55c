"""Who sizes an engine role: one writer at a time, and the operator never undoes the others. Pure.

The size of a role lives in its DisaggregatedRole `<model>-<role>` (spec.replicas, the scale subresource),
whose name survives revisions. The rule for what the operator writes there:

- the DisaggregatedRole does not exist yet: it is created with spec.<role>.replicas (clamped to the HPA's
  bounds with autoscaling); or, when the model's status already records a target for the role at this
  generation (someone deleted the DisaggregatedRole), with that target: a size set by `kubectl scale` or
  an HPA survives the role being deleted and recreated, and no serving pod is drained for it;
- with `autoscaling` (an HPA): the HPA owns the size; the operator keeps whatever is there;
- with the model's `spec.autoscaling` in mode Active: the SLO autoscaler owns both roles' sizes. Its last
  decision (status.autoscaling, this pass's or the last interval's) is the target; before its first decision,
  whatever is there (or spec.<role>.replicas for a role not made yet); always within the autoscaler's
  minEngines..maxEngines. A `kubectl scale` in between lasts until the next decision. Admission refuses an
  HPA beside it;
- otherwise: the operator writes spec.<role>.replicas when that field changed since it last wrote it (the
  annotation `disagg.dev/spec-replicas` records the value last written); in between, `kubectl scale` or
  any other scaler of the DisaggregatedRole wins, and the operator keeps its value.

The role's target, which every revision is rolled out to, is the DisaggregatedRole's size after that rule.

Sizing is one stage (`sized`): render gives every child its shape, and the spec's sizes only as the picture of
a model with nothing yet (what `disagg-operator render` prints); a pass writes the sizes decided here, and only
here: the DisaggregatedRoles at the roles' targets, the current revision's engine workloads at the rollout's
step (rollout.py, less what retirement.py keeps), each LeaderWorkerSet group's PodGroup and the pair's
minCount, and PodGroups only where the cluster serves them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from disagg_connector import contract

from .render import gang
from .render.engine import LWS_KIND
from .render.scaling import SPEC_REPLICAS_ANNOTATION, initial_replicas
from .state import Desired, Key, Obj, Observed, is_engine_workload, key_of, revision_of


def scaler_key(desired: Desired, role: str) -> Key:
    return contract.ROLE_KIND, contract.role_scaler_name(desired.ref.name, role)  # type: ignore[arg-type]


def _spec_replicas(obj: Mapping[str, Any] | None) -> int | None:
    value = ((obj or {}).get("spec") or {}).get("replicas")
    return int(value) if value is not None else None


def _recorded_target(desired: Desired, role: str) -> int | None:
    """The role's target as the status last recorded it, if that status is of this spec's generation (a
    spec changed since may have asked for another size: then the spec's wins)."""
    status = desired.previous_status or {}
    target = (status.get(role) or {}).get("targetReplicas")
    if target is None or status.get("observedGeneration") != desired.ref.generation:
        return None
    return int(target)


def _slo_decided(desired: Desired, observed: Observed, role: str) -> tuple[int | None, int, int] | None:
    """With the SLO autoscaler Active: its last decision for the role (None before its first) and its bounds."""
    scaling = desired.model.spec.autoscaling
    if scaling is None or scaling.mode != "Active":
        return None
    bounds = getattr(scaling, role)
    decision = observed.autoscaling or {}
    decided = (decision.get(role) or {}).get("recommended") if decision.get("mode") == "Active" else None
    return (int(decided) if decided is not None else None), bounds.min_engines, bounds.max_engines


def role_target(desired: Desired, observed: Observed, role: str) -> int:
    """One engine role's size after the one-writer rule: what every revision is rolled out to."""
    role_spec = getattr(desired.model.spec, role)
    live = observed.children.get(scaler_key(desired, role))
    live_size = _spec_replicas(live)
    slo = _slo_decided(desired, observed, role)
    if slo is not None:
        decided, least, most = slo
        if decided is None:
            decided = live_size if live is not None and live_size is not None else _recorded_target(desired, role)
        return min(max(decided if decided is not None else role_spec.replicas, least), most)
    if live is None or live_size is None:
        recorded = _recorded_target(desired, role)
        return recorded if recorded is not None else initial_replicas(role_spec)
    last_written = (live.get("metadata", {}).get("annotations") or {}).get(SPEC_REPLICAS_ANNOTATION)
    if role_spec.autoscaling is not None or last_written == str(role_spec.replicas):
        return live_size
    return role_spec.replicas


def targets(desired: Desired, observed: Observed) -> dict[str, int]:
    return {role: role_target(desired, observed, role) for role in contract.ENGINE_ROLES}


# --- the sizes of a pass's children: one stage --------------------------------------------------------------
def engines_key(desired: Desired, role: str) -> Key:
    """The rendered engine workload of a role at the current revision."""
    name = contract.engine_deployment_name(desired.ref.name, role, desired.revision)  # type: ignore[arg-type]
    return next(key_of(o) for o in desired.rendered.objects if o["metadata"]["name"] == name and is_engine_workload(o))


def replicas_of(obj: Mapping[str, Any] | None) -> int:
    return int(((obj or {}).get("spec") or {}).get("replicas") or 0) if obj else 0


def with_replicas(obj: Obj, replicas: int) -> Obj:
    """A copy of a workload or scaler at `replicas` (a pass edits none of its inputs)."""
    out = copy.deepcopy(obj)
    out["spec"]["replicas"] = replicas
    return out


def _pod_groups(children: Mapping[Key, Obj], observed: Observed, gone: set[Key]) -> dict[Key, Obj]:
    """The PodGroups of every LeaderWorkerSet this pass keeps, as many as the larger of its live and planned
    size: a group that comes has its PodGroup before its pods, one that leaves keeps it until its LWS has
    shrunk (and kube-controller-manager's protection finalizer keeps a deleted one while its pods run). An
    LWS whose group 0 is in its revision's pair gets the others' only once a pod of that revision is bound (the
    pair, with the chart's policy; any pod, without it): a pod whose PodGroup does not exist yet waits outside
    the scheduling queue, so the first pair is never beaten to the nodes by a second engine that would serve
    nothing without it."""
    sizes = {k: replicas_of(o) for k, o in observed.children.items() if o["kind"] == LWS_KIND and k not in gone}
    sources = {k: observed.children[k] for k in sizes}
    for k, o in children.items():
        if o["kind"] == LWS_KIND:
            sizes[k], sources[k] = max(sizes.get(k, 0), replicas_of(o)), o
    bound = {p.revision for p in observed.census.pods if (p.obj.get("spec") or {}).get("nodeName")}
    out: dict[Key, Obj] = {}
    for k, lws in sources.items():
        released = gang.pair_of(lws) is None or revision_of(lws) in bound
        # (one made before stays: its group's pods may already use it)
        out |= {key_of(pg): pg for pg in gang.pod_groups(lws, sizes[k]) if released or key_of(pg) in observed.children}
    return out


@dataclass(frozen=True)
class Sized:
    """The children of a pass at this pass's sizes."""

    children: dict[Key, Obj]  # every rendered child but the role scalers, sized; PodGroups only where served
    scalers: dict[Key, tuple[Obj, int]]  # each role's DisaggregatedRole as rendered, and the size it is to have


def sized(desired: Desired, observed: Observed, targets: Mapping[str, int], engines: Mapping[str, int],
          retired: set[Key]) -> Sized:  # fmt: skip
    """Every size of a pass, the one place they are set: `targets` (role_target) for the DisaggregatedRoles and
    the pair's minCount, `engines` (the rollout's step for the current revision, after retirement) for its engine
    workloads, and for each LeaderWorkerSet kept (`retired`: those this pass deletes) its groups' PodGroups."""
    rendered = {key_of(o): o for o in desired.rendered.objects}
    roles = {scaler_key(desired, role): role for role in contract.ENGINE_ROLES}
    scalers = {k: (rendered.pop(k), targets[role]) for k, role in roles.items()}
    for role, replicas in engines.items():
        key = engines_key(desired, role)
        rendered[key] = with_replicas(rendered[key], replicas)
    pair = next((o for o in rendered.values() if gang.is_pair_group(o)), None)
    children = {k: o for k, o in rendered.items() if o["kind"] != gang.POD_GROUP_KIND}
    if observed.pod_groups_served:
        children |= _pod_groups(children, observed, retired)
        if pair is not None:
            pair = copy.deepcopy(pair)
            pair["spec"]["schedulingPolicy"]["gang"]["minCount"] = gang.pair_min_count(desired.model, dict(targets))
            children[key_of(pair)] = pair
    # A pod names a PodGroup only where one is served (served unknown: not asked, as none is rendered), and a
    # revision's Deployment keeps what it was made with: one made where none was served is not changed in place
    # (that would replace its pods outside the rollout's drains); the next revision names it.
    unnamed = {k for k, o in children.items() if o["kind"] == "Deployment" and is_engine_workload(o)
               and (not observed.pod_groups_served or (k in observed.children and not gang.names_pod_group(observed.children[k])))}
    children = {k: gang.without_pod_group(o) if k in unnamed else o for k, o in children.items()}
    return Sized(children, scalers)
