"""Carries out a Plan through the one I/O module (kube.py), and nothing else: every decision is the
planner's. Two steps, both thin:

- `probe`: what the planner must know before a pass may write anything: for each child it would create,
  whether a same-named object exists that this model does not control (a GET); for each child it would
  write, whether the API server admits it (a server-side dry run: schema, CEL, quota, RBAC, webhooks).
- `execute`: the plan's actions in order, stopping at the first failure (the rest is retried, with
  backoff, by a later pass that plans again from what is then observed).

API errors become a ChildProblem with a stable reason (`problem_from_error`); transport errors (the API
server unreachable) propagate, so the pass fails and is retried.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from kubernetes.client.exceptions import ApiException

from .kube import Cluster, error_message
from .planner import Apply, Delete, Plan
from .state import ChildProblem, Key, Obj

log = logging.getLogger(__name__)


def problem_from_error(kind: str, name: str, status: int | None, message: str) -> ChildProblem:
    """The condition reason for an API server's refusal: what the user would search for."""
    if status == 422 or status == 400:
        reason = "ChildRejected"
    elif status == 403:
        reason = "QuotaExceeded" if "exceeded quota" in message else "Forbidden"
    elif status == 409:
        reason = "Conflict"
    else:
        reason = "ApplyFailed"
    return ChildProblem(reason, kind, name, message)


def _problem(obj: Obj, error: ApiException) -> ChildProblem:
    return problem_from_error(obj["kind"], obj["metadata"]["name"], error.status, error_message(error))


def _controlled_by(obj: Obj, uid: str) -> bool:
    owners = obj.get("metadata", {}).get("ownerReferences") or []
    return any(o.get("uid") == uid and o.get("controller") for o in owners)


@dataclass(frozen=True)
class Probes:
    foreign: dict[Key, Obj] = field(default_factory=dict)
    refused: dict[Key, ChildProblem] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.foreign or self.refused)


def probe(plan: Plan, cluster: Cluster, owner_uid: str) -> Probes:
    foreign: dict[Key, Obj] = {}
    for action in plan.creates:
        live = cluster.get(action.obj)
        if live is not None and not _controlled_by(live, owner_uid):
            foreign[action.key] = live
    refused: dict[Key, ChildProblem] = {}
    for action in plan.dry_runs:
        if action.key in foreign:
            continue
        try:
            cluster.apply(action.obj, dry_run=True)
        except ApiException as error:
            refused[action.key] = _problem(action.obj, error)
    return Probes(foreign, refused)


@dataclass(frozen=True)
class Outcome:
    done: int  # actions carried out
    total: int
    failure: ChildProblem | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def execute(plan: Plan, cluster: Cluster, on_done: Callable[[Apply | Delete], None] = lambda _: None) -> Outcome:
    for done, action in enumerate(plan.actions):
        meta = action.obj["metadata"]
        try:
            if isinstance(action, Apply):
                cluster.apply(action.obj)
            else:
                cluster.delete(action.obj)
        except ApiException as error:
            return Outcome(done, len(plan.actions), _problem(action.obj, error))
        log.info("%s %s %s/%s (%s)", type(action).__name__.lower(), action.obj["kind"], meta["namespace"], meta["name"], action.why)
        on_done(action)
    return Outcome(len(plan.actions), len(plan.actions))
