"""Every decision of a reconcile pass, in one pure function: plan(desired, observed, now) -> Plan.

The executor (executor.py) only carries a Plan out. The rules, in order:

1. **Desired children** are the rendered objects, each stamped with the hash of its manifest (drift.py).
   Each role's size is its DisaggregatedRole's, after the one-writer rule (sizing.py). Every size a pass
   writes (role scalers, the current engines, PodGroups) is set in one stage, sizing.sized, from the targets
   and step 3's sizes; render's sizes (the spec's) are never applied as such.
2. **Nothing half-applied.** If any child this pass would write is refused by the API server's dry run, or
   its name is taken by an object this model does not control, the plan has *no* action at all, and the
   status says which child, and why (reasons ChildRejected, OwnershipConflict, Forbidden, QuotaExceeded,
   Conflict). What runs keeps running. The executor learns both facts by probing the tentative plan's
   writes (a GET for each child to create, a server-side dry run for each write) and the planner is asked
   again with them (`Observed.with_probes`): the decision stays here.
3. **Rollout and scaling** (rollout.py), in engines: the current revision's engine workloads (a Deployment
   of one pod per engine, or a LeaderWorkerSet of one group per engine when an engine spans pods) and those
   of older revisions get the sizes of the next step: the new revision grows into the surge room, the old
   ones shrink in P/D pairs as ready new engines stand in. A workload that shrinks loses exactly the pods
   (or groups) retirement.py picks, each drained first; an old revision whose pods are all gone is deleted.
   Each LeaderWorkerSet group has its PodGroup (render/gang.py), where the cluster serves them.
4. **Apply** each desired child that is missing or drifted (drift.needs_apply), in dependency order:
   identities and RBAC, Services, disruption budgets and policies, the role scale targets, the PodGroups,
   then the engines, the router and the autoscalers. Pod marks go first (a deletion cost must be in place before
   the Deployment shrinks), old revisions' scale-downs and deletions after every write.
5. **Delete** children of this model that are no longer desired (other than engine workloads of older
   revisions, which step 3 retires).
6. **Status** is what the world looks like once the plan's deletions are done (status.compute).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Union

from disagg_connector import contract

from . import rollout, sizing
from . import status as status_mod
from .api.vocabulary import Reason
from .drift import needs_apply, stamped
from .render import gang, gateway
from .render.engine import LWS_KIND
from .retirement import DELETION_COST, LEAVING_COST, Retirement, marked, retire, retire_groups
from .state import (ChildProblem, Desired, Key, Obj, Observed, RouterView, is_engine_workload, key_of, revision_of,
                    role_of)

# Who may depend on whom: a RoleBinding needs its Role and ServiceAccount, the router discovers the
# engines, an HPA targets a DisaggregatedRole.
APPLY_ORDER = ("ServiceAccount", "Role", "RoleBinding", "Service", "PodDisruptionBudget", "NetworkPolicy",
               contract.ROLE_KIND, gang.POD_GROUP_KIND, "Deployment", LWS_KIND, "HorizontalPodAutoscaler",
               gateway.INFERENCE_POOL_KIND, gateway.HTTP_ROUTE_KIND)  # fmt: skip
ROUTER_LAST = {"prefill": 0, "decode": 0, "router": 1}
# While a pod drains, the pass comes back this often: in-flight counts change without Kubernetes events.
DRAIN_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Apply:
    obj: Obj
    why: str  # "create" | "update"

    @property
    def key(self) -> Key:
        return key_of(self.obj)


@dataclass(frozen=True)
class Delete:
    obj: Obj
    why: str  # "stale" | "retired"

    @property
    def key(self) -> Key:
        return key_of(self.obj)


@dataclass(frozen=True)
class Scale:
    """An older revision's Deployment or LeaderWorkerSet, resized through its scale subresource (it is no
    longer rendered)."""

    obj: Obj
    replicas: int
    why: str = "retiring"


@dataclass(frozen=True)
class Annotate:
    """A pod's annotations: the draining mark, the deletion cost (None removes one)."""

    obj: Obj
    annotations: Mapping[str, str | None]
    why: str


@dataclass(frozen=True)
class SetStatus:
    """The status of a child (a DisaggregatedRole: what its scale subresource reports)."""

    obj: Obj
    status: Mapping[str, Any]
    why: str = "status"


Action = Union[Apply, Delete, Scale, Annotate, SetStatus]


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    status: dict[str, Any]
    problems: tuple[ChildProblem, ...] = ()
    requeue_after: float | None = None  # come back then even if nothing else happens (draining)
    draining: tuple[str, ...] = field(default=())
    overdue: tuple[str, ...] = ()  # pods let go at the drain bound without a router saying they were idle

    @property
    def applies(self) -> tuple[Apply, ...]:
        return tuple(a for a in self.actions if isinstance(a, Apply))

    @property
    def creates(self) -> tuple[Apply, ...]:
        return tuple(a for a in self.applies if a.why == "create")

    @property
    def dry_runs(self) -> tuple[Apply, ...]:
        """The writes a dry run can judge now. A RoleBinding to a Role this same plan creates cannot be:
        RBAC's escalation check looks the Role up, and a dry run stores nothing, so it is not there yet."""
        created = {a.key for a in self.creates}
        return tuple(a for a in self.applies
                     if not (a.obj["kind"] == "RoleBinding" and ("Role", a.obj["roleRef"]["name"]) in created))


def _apply_rank(obj: Obj) -> tuple[int, int]:
    return APPLY_ORDER.index(obj["kind"]), ROUTER_LAST.get(role_of(obj) or "", 0)


def ownership_conflict(key: Key, found: Obj) -> ChildProblem:
    owners = [f"{o.get('kind')} {o.get('name')}" for o in found.get("metadata", {}).get("ownerReferences") or [] if o.get("controller")]
    holder = f"controlled by {owners[0]}" if owners else "not created by this model"
    return ChildProblem(
        Reason.OWNERSHIP_CONFLICT, key[0], key[1],
        f"an object of that name already exists, {holder}; the operator never changes or deletes it: "
        "delete or rename it, or rename this model",
    )  # fmt: skip


_replicas = sizing.replicas_of


def _pods_of(observed: Observed, role: str, revision: str | None) -> list[Obj]:
    return [p.obj for p in observed.census.select(role, revision)]


def _retire(workload: Obj | None, pods: list[Obj], want: int, routers: RouterView | None, now: str, bound_s: float) -> Retirement:
    """Retirement of a role's engines of one revision: pod by pod (a Deployment), or group by group from the
    top (a LeaderWorkerSet)."""
    if workload is None:
        return Retirement(replicas=want)
    by = retire_groups if workload["kind"] == LWS_KIND else retire
    return by(pods, _replicas(workload), want, routers, now, bound_s)


@dataclass
class _Engines:
    """The engine side of one pass: engine workload sizes per revision, and the pod work that retirement needs."""

    current_replicas: dict[str, int] = field(default_factory=dict)  # role -> size of the current revision
    pod_actions: list[Action] = field(default_factory=list)
    old_actions: list[Action] = field(default_factory=list)
    draining: dict[str, str] = field(default_factory=dict)  # pod still draining -> what holds it, in words ("": none said)
    overdue: list[str] = field(default_factory=list)  # let go at the drain bound, not seen idle

    def add(self, result: Retirement, now: str) -> None:
        self.pod_actions += _retirement_actions(result) + [
            Annotate(p, {contract.ANNOTATION_DRAINING: now}, "leaving") for p in result.mark]
        self.draining.update((p, result.holding.get(p, "")) for p in result.waiting)
        self.overdue += result.overdue


def drain_bounds(desired: Desired) -> dict[str, float]:
    """Per role, how long a draining pod may stay when its routers cannot say it is idle (retirement.py)."""
    spec = desired.model.spec
    prefill_kv = spec.router.request_deadline_seconds + spec.kv_transfer.lease_seconds
    return {"prefill": min(spec.rollout.drain_timeout_seconds, prefill_kv), "decode": spec.rollout.drain_timeout_seconds}


def _retirement_actions(result: Retirement) -> list[Action]:
    actions: list[Action] = [Annotate(p, {contract.ANNOTATION_DRAINING: None, DELETION_COST: None}, "stays")
                             for p in result.unmark]  # fmt: skip
    actions += [Annotate(p, {DELETION_COST: LEAVING_COST}, "drained") for p in result.cost]
    return actions


def _plan_engines(desired: Desired, observed: Observed, targets: Mapping[str, int], now: str) -> _Engines:
    spec, revision = desired.model.spec, desired.revision
    bounds = drain_bounds(desired)
    budgets = {r: rollout.budget(targets[r], getattr(spec.rollout, r).max_surge, getattr(spec.rollout, r).max_unavailable)
               for r in contract.ENGINE_ROLES}  # fmt: skip
    current = {r: observed.children.get(sizing.engines_key(desired, r)) for r in contract.ENGINE_ROLES}
    old_workloads: dict[str, dict[str, Obj]] = {}
    for obj in observed.workloads:
        if is_engine_workload(obj) and revision_of(obj) != revision:
            old_workloads.setdefault(revision_of(obj) or "", {})[role_of(obj) or ""] = obj
    newest_first = tuple(sorted(old_workloads, reverse=True, key=lambda v: max(
        (d.get("metadata", {}).get("creationTimestamp") or "") for d in old_workloads[v].values())))

    def count(obj: Obj | None, role: str, rev: str) -> rollout.Count:
        return rollout.Count(_replicas(obj), observed.census.count_engines(role, rev, ready=True))

    step = rollout.next_step(
        budgets,
        {r: count(current[r], r, revision) for r in contract.ENGINE_ROLES},
        {v: {r: count(old_workloads[v].get(r), r, v) for r in contract.ENGINE_ROLES} for v in old_workloads},
        newest_first,
    )
    out = _Engines()
    for role in contract.ENGINE_ROLES:
        result = _retire(current[role], _pods_of(observed, role, revision), step.new[role], observed.routers, now, bounds[role])
        out.current_replicas[role] = result.replicas
        out.add(result, now)
    for old in newest_first:
        for role, workload in old_workloads[old].items():
            want = step.old[old].get(role, 0)
            result = _retire(workload, _pods_of(observed, role, old), want, observed.routers, now, bounds[role])
            out.add(result, now)
            if result.replicas == 0 and not result.busy:
                out.old_actions.append(Delete(workload, "retired"))
            elif result.replicas < _replicas(workload):
                out.old_actions.append(Scale(workload, result.replicas))
    return out


def _role_scaler_statuses(desired: Desired, observed: Observed) -> list[Action]:
    actions: list[Action] = []
    for role in contract.ENGINE_ROLES:
        key = sizing.scaler_key(desired, role)
        live = observed.children.get(key)
        if live is None:
            continue  # created by this pass: its status comes with the next one
        selector = ",".join(f"{k}={v}" for k, v in contract.selector_labels(desired.ref.name, role).items())  # type: ignore[arg-type]
        want = {"replicas": observed.census.count_engines(role, terminating=False),
                "readyReplicas": observed.census.count_engines(role, ready=True),
                "selector": selector, "revision": desired.revision}  # fmt: skip
        if {k: (live.get("status") or {}).get(k) for k in want} != want:
            actions.append(SetStatus(live, want))
    return actions


def _without(observed: Observed, deleted: set[Key]) -> Observed:
    """The world once `deleted` are gone: their pods go too (by revision, for engine workloads)."""
    revisions = {revision_of(observed.children[k]) for k in deleted if is_engine_workload(observed.children[k])}
    return replace(observed, children={k: o for k, o in observed.children.items() if k not in deleted},
                   pods=tuple(p for p in observed.pods if revision_of(p) is None or revision_of(p) not in revisions))


@dataclass(frozen=True)
class RoutersRead:
    """When a model's routers were last asked (monotonic seconds), and which router pods were ready then."""

    at: float
    ready: frozenset[str]


def ready_routers(observed: Observed) -> frozenset[str]:
    return frozenset(p.name for p in observed.census.select("router", ready=True))


def routers_due(observed: Observed, last: RoutersRead | None, at: float, poll_seconds: float) -> bool:
    """Whether this pass must also ask the routers (HTTP to their pods): while a pod drains (drained means
    idle, and only they can say), at once when the ready router pods changed since the last read, and once
    per poll period otherwise (KVTransferHealthy)."""
    if any(map(marked, observed.pods)) or last is None:
        return True
    return at - last.at >= poll_seconds or ready_routers(observed) != last.ready


def plan(desired: Desired, observed: Observed, now: str) -> Plan:
    targets = sizing.targets(desired, observed)
    scaler_keys = [sizing.scaler_key(desired, role) for role in contract.ENGINE_ROLES]
    children = [k for k in (key_of(o) for o in desired.rendered.objects) if k not in scaler_keys] + scaler_keys
    problems = [ownership_conflict(k, observed.foreign[k]) for k in children if k in observed.foreign]
    problems += [observed.refused[k] for k in children if k in observed.refused]
    if problems:
        status = status_mod.blocked(desired, observed, targets, problems, now)
        return Plan(actions=(), status=status, problems=tuple(problems))

    engines = _plan_engines(desired, observed, targets, now)
    retired = {a.key for a in engines.old_actions if isinstance(a, Delete)}
    # Every size of this pass, in one stage (sizing.sized): the roles' scalers, the current engines, the PodGroups.
    sized = sizing.sized(desired, observed, targets, engines.current_replicas, retired)
    # A role scaler is stamped as rendered (with the spec's size): a size someone else scaled it to is then
    # no drift, and only a change of the spec's replicas is a write (sizing.py).
    scalers = {k: sizing.with_replicas(stamped(scaler), n) for k, (scaler, n) in sized.scalers.items()}
    wanted = {**{k: stamped(o) for k, o in sized.children.items()}, **scalers}
    applies = [
        Apply(obj, "update" if k in observed.children else "create")
        for k, obj in sorted(wanted.items(), key=lambda item: _apply_rank(item[1]))
        if needs_apply(obj, observed.children.get(k))
    ]
    # An older revision's pair PodGroup stays while that revision's engines do (its pods may be recreated).
    kept_revisions = {revision_of(o) for k, o in observed.children.items() if is_engine_workload(o) and k not in retired}
    stale = [Delete(o, "stale") for k, o in observed.children.items() if k not in wanted and not is_engine_workload(o)
             and not (gang.is_pair_group(o) and revision_of(o) in kept_revisions)]  # fmt: skip
    after = _without(observed, {d.key for d in stale} | retired)
    return Plan(
        actions=(*engines.pod_actions, *applies, *engines.old_actions, *stale, *_role_scaler_statuses(desired, observed)),
        status=status_mod.compute(desired, after, targets, now,
                                  draining=engines.draining),
        requeue_after=DRAIN_POLL_SECONDS if engines.draining else None,
        draining=tuple(engines.draining),
        overdue=tuple(engines.overdue),
    )
