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

import json
import logging
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from disagg_connector import contract
from disagg_connector.contract.health import HealthDocumentError, parse_health

from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from .api.vocabulary import Reason
from .kube import Cluster, error_message
from .planner import Action, Annotate, Apply, Delete, Plan, Scale, SetStatus
from .render import INSTALL_HINTS
from .state import ChildProblem, Key, Obj, Observed, RouterView, controlled_by, role_of

log = logging.getLogger(__name__)


def problem_from_error(kind: str, name: str, status: int | None, message: str) -> ChildProblem:
    """The condition reason for an API server's refusal: what the user would search for."""
    # Server-side apply answers 500 "failed to create typed patch object" for a value of the wrong type
    # (a list where the schema wants a map, say): a refusal of the content like a 422.
    # A PodGroup naming a PriorityClass that does not exist is refused by admission with a 403: the content is
    # wrong, not the operator's RBAC.
    if (status in (400, 422) or (status == 500 and "failed to create typed patch object" in message)
            or (status == 403 and "no PriorityClass with name" in message)):
        reason = Reason.CHILD_REJECTED
    elif status == 403:
        reason = Reason.QUOTA_EXCEEDED if "exceeded quota" in message else Reason.FORBIDDEN
    elif status == 409:
        reason = Reason.CONFLICT
    else:
        reason = Reason.APPLY_FAILED
    return ChildProblem(reason, kind, name, message)


def _problem(obj: Obj, error: ApiException | ResourceNotFoundError) -> ChildProblem:
    kind, name = obj["kind"], obj["metadata"]["name"]
    if isinstance(error, ResourceNotFoundError):  # the API server's discovery does not list the kind
        hint = INSTALL_HINTS.get(kind, "install its CustomResourceDefinition")
        return ChildProblem(Reason.KIND_NOT_INSTALLED, kind, name, f"this cluster does not serve {kind} ({obj['apiVersion']}): {hint}")
    return problem_from_error(kind, name, error.status, error_message(error))


@dataclass(frozen=True)
class Probes:
    foreign: dict[Key, Obj] = field(default_factory=dict)
    refused: dict[Key, ChildProblem] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.foreign or self.refused)


def probe(plan: Plan, cluster: Cluster, owner_uid: str) -> Probes:
    foreign: dict[Key, Obj] = {}
    refused: dict[Key, ChildProblem] = {}
    for action in plan.creates:
        try:
            live = cluster.get(action.obj)
        except ResourceNotFoundError as error:
            refused[action.key] = _problem(action.obj, error)
            continue
        if live is not None and not controlled_by(live, owner_uid):
            foreign[action.key] = live
    for action in plan.dry_runs:
        if action.key in foreign or action.key in refused:
            continue
        try:
            cluster.apply(action.obj, dry_run=True)
        except (ApiException, ResourceNotFoundError) as error:
            refused[action.key] = _problem(action.obj, error)
    return Probes(foreign, refused)


ROUTER_HEALTH_TIMEOUT = 2.0


def read_routers(observed: Observed, ready: Callable[[Obj], bool]) -> RouterView:
    """Each ready router pod's /health (in-flight and draining per backend), None for one that does not
    answer: the retirement of a draining pod waits for what every router says."""
    reports, names = [], []
    for pod in observed.pods:
        ip = pod.get("status", {}).get("podIP")
        if role_of(pod) != "router" or not ready(pod) or not ip:
            continue
        host = f"[{ip}]" if ":" in ip else ip
        names.append(pod["metadata"]["name"])
        try:
            with urllib.request.urlopen(f"http://{host}:{contract.ROUTER_PORT}/health", timeout=ROUTER_HEALTH_TIMEOUT) as r:
                reports.append(parse_health(json.load(r)))
        except (OSError, ValueError, HealthDocumentError) as error:
            log.info("router pod %s: no health report (%s)", pod["metadata"]["name"], error)
            reports.append(None)
    return RouterView(tuple(reports), tuple(names))


def read_router_metrics(observed: Observed, ready: Callable[[Obj], bool]) -> dict[str, str | None]:
    """Each ready router pod's /metrics text (the SLO autoscaler's measurements), None for one that does not
    answer."""
    texts: dict[str, str | None] = {}
    for pod in observed.pods:
        ip = pod.get("status", {}).get("podIP")
        if role_of(pod) != "router" or not ready(pod) or not ip:
            continue
        host = f"[{ip}]" if ":" in ip else ip
        try:
            with urllib.request.urlopen(f"http://{host}:{contract.ROUTER_PORT}/metrics", timeout=ROUTER_HEALTH_TIMEOUT) as r:
                texts[pod["metadata"]["name"]] = r.read().decode()
        except (OSError, ValueError) as error:
            log.info("router pod %s: no /metrics (%s)", pod["metadata"]["name"], error)
            texts[pod["metadata"]["name"]] = None
    return texts


@dataclass(frozen=True)
class Outcome:
    done: int  # actions carried out
    total: int
    failure: ChildProblem | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def _carry_out(action: Action, cluster: Cluster) -> None:
    if isinstance(action, Apply):
        cluster.apply(action.obj)
    elif isinstance(action, Delete):
        cluster.delete(action.obj)
    elif isinstance(action, Scale):
        cluster.scale(action.obj, action.replicas)
    elif isinstance(action, Annotate):
        cluster.annotate(action.obj, dict(action.annotations))
    elif isinstance(action, SetStatus):
        cluster.set_status(action.obj, dict(action.status))
    else:  # pragma: no cover - a new action type without its I/O
        raise TypeError(action)


def execute(plan: Plan, cluster: Cluster, on_done: Callable[[Action], None] = lambda _: None) -> Outcome:
    for done, action in enumerate(plan.actions):
        meta = action.obj["metadata"]
        try:
            _carry_out(action, cluster)
        except (ApiException, ResourceNotFoundError) as error:
            return Outcome(done, len(plan.actions), _problem(action.obj, error))
        log.info("%s %s %s/%s (%s)", type(action).__name__.lower(), action.obj["kind"], meta["namespace"], meta["name"], action.why)
        on_done(action)
    return Outcome(len(plan.actions), len(plan.actions))
