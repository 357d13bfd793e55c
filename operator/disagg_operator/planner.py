"""Every decision of a reconcile pass, in one pure function: plan(desired, observed, now) -> Plan.

The executor (executor.py) only carries a Plan out. The rules, in order:

1. **Desired children** are the rendered objects, each stamped with the hash of its manifest (drift.py).
2. **Nothing half-applied.** If any child this pass would write is refused by the API server's dry run, or
   its name is taken by an object this model does not control, the plan has *no* action at all, and the
   status says which child, and why (reasons ChildRejected, OwnershipConflict, Forbidden, QuotaExceeded,
   Conflict). What runs keeps running. The executor learns both facts by probing the tentative plan's
   writes (a GET for each child to create, a server-side dry run for each write) and the planner is asked
   again with them (`Observed.with_probes`): the decision stays here.
3. **Apply** each desired child that is missing or drifted (drift.needs_apply); in dependency order:
   identities and RBAC, Services, disruption budgets and policies, then the engines, then the router.
4. **Delete** children of this model that are no longer desired, except the engine Deployments of older
   revisions: those keep serving until the current revision is Ready, and are retired in the same pass
   that sees it Ready (never earlier, never mixed: the router pairs P and D only within one revision).
5. **Status** is what the world looks like once the plan's deletions are done (status.compute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from . import status as status_mod
from .drift import needs_apply, stamped
from .state import ChildProblem, Desired, Key, Obj, Observed, is_engine_deployment, key_of, revision_of, role_of

# Who may depend on whom: a RoleBinding needs its Role and ServiceAccount, pods need their Services'
# names for DNS, the router discovers the engines. Deletions go after every write.
APPLY_ORDER = ("ServiceAccount", "Role", "RoleBinding", "Service", "PodDisruptionBudget", "NetworkPolicy", "Deployment")
ROUTER_LAST = {"prefill": 0, "decode": 0, "router": 1}


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


Action = Union[Apply, Delete]


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    status: dict[str, Any]
    ready: bool
    problems: tuple[ChildProblem, ...] = ()

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
        "OwnershipConflict", key[0], key[1],
        f"an object of that name already exists, {holder}; the operator never changes or deletes it: "
        "delete or rename it, or rename this model",
    )  # fmt: skip


def _without(observed: Observed, deleted: set[Key]) -> Observed:
    """The world once `deleted` are gone: their pods go too (by revision, for engine Deployments)."""
    revisions = {revision_of(observed.children[k]) for k in deleted if is_engine_deployment(observed.children[k])}
    return Observed(
        children={k: o for k, o in observed.children.items() if k not in deleted},
        pods=tuple(p for p in observed.pods if revision_of(p) is None or revision_of(p) not in revisions),
        foreign=observed.foreign,
        refused=observed.refused,
    )


def plan(desired: Desired, observed: Observed, now: str) -> Plan:
    wanted = {key_of(o): stamped(o) for o in desired.rendered.objects}

    problems = [ownership_conflict(k, observed.foreign[k]) for k in wanted if k in observed.foreign]
    problems += [observed.refused[k] for k in wanted if k in observed.refused]
    if problems:
        status = status_mod.blocked(desired, observed, problems, now)
        return Plan(actions=(), status=status, ready=False, problems=tuple(problems))

    applies = [
        Apply(obj, "update" if k in observed.children else "create")
        for k, obj in sorted(wanted.items(), key=lambda item: _apply_rank(item[1]))
        if needs_apply(obj, observed.children.get(k))
    ]
    readiness = status_mod.readiness(desired, observed)
    stale = {k: o for k, o in observed.children.items() if k not in wanted}
    deletes = [Delete(o, "stale") for k, o in stale.items() if not is_engine_deployment(o)]
    if readiness.ready:
        # The current revision serves on its own now: retire the older pairs.
        deletes += [Delete(o, "retired") for k, o in stale.items() if is_engine_deployment(o)]

    after = _without(observed, {d.key for d in deletes})
    return Plan(
        actions=(*applies, *deletes),
        status=status_mod.compute(desired, after, now),
        ready=readiness.ready,
    )
