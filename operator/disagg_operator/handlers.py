"""Kopf registrations: thin triggers of one reconcile. No logic lives here.

Triggers:
- the DisaggregatedModel itself: resume (operator start), create, update of spec or metadata;
- its children: any event of a Deployment or Pod that carries our managed-by label reconciles the
  owning model. This replaces a periodic timer: kopf timers put a finalizer on every CR (a deletion
  would hang while the operator is down), and watching children reacts in seconds instead of a
  period, while an unchanged world produces no events and so no work.

Handlers are plain `def`: they call the synchronous kubernetes client, so kopf runs them in its
thread pool instead of blocking the event loop.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from disagg_connector import contract

from .config import RenderDefaults
from .kube import Cluster, load_api_client
from .reconcile import Reconciler

log = logging.getLogger(__name__)

MODEL = (contract.API_GROUP, contract.API_VERSION, contract.PLURAL)
MANAGED = {contract.LABEL_MANAGED_BY: contract.OPERATOR_NAME}
ANNOTATION_PREFIX = contract.API_GROUP

_reconciler: Reconciler | None = None


def reconciler() -> Reconciler:
    global _reconciler
    if _reconciler is None:
        _reconciler = Reconciler(Cluster(load_api_client()), RenderDefaults.from_env())
    return _reconciler


def configure(settings: kopf.OperatorSettings) -> None:
    """Kopf settings, on purpose (see docs/design.md, "Kopf, on purpose")."""
    # Our own annotation prefix: no collision with other kopf operators, one GitOps ignore rule.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"  # never added: no handler needs one
    # Watches that go quiet behind load balancers are restarted (kopf #847, #1276).
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    # Only warnings become Kubernetes Events on the CR; info stays in the operator's log.
    settings.posting.level = logging.WARNING
    # Sync handlers run in this pool: enough for many models reconciling at once on 1-2 CPUs.
    settings.execution.max_workers = 16
    # A failed reconcile (API down, conflict) is retried after this many seconds.
    settings.execution.default_backoff = 10


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    configure(settings)
    reconciler()


@kopf.on.resume(*MODEL)
@kopf.on.create(*MODEL)
@kopf.on.update(*MODEL)
def reconcile_model(namespace: str, name: str, **_: Any) -> None:
    reconciler().trigger(namespace, name)


def _owner(labels: dict[str, str], meta: dict[str, Any]) -> str | None:
    for owner in meta.get("ownerReferences") or []:
        if owner.get("kind") == contract.KIND and owner.get("controller"):
            return str(owner["name"])
    return None


@kopf.index(*MODEL)
async def model_by_label(namespace: str, name: str, **_: Any) -> dict[tuple[str, str], str]:
    """CR names by their (possibly shortened) model label value: pods are owned by ReplicaSets, so a
    pod event finds its model through its label. Async: no I/O, and no thread per indexed object."""
    return {(namespace, contract.model_label_value(name)): name}


@kopf.on.event("deployments", labels=MANAGED)
def deployment_event(meta: kopf.Meta, namespace: str, labels: dict[str, str], **_: Any) -> None:
    owner = _owner(dict(labels), dict(meta))
    if owner:
        reconciler().trigger(namespace, owner)


@kopf.on.event("pods", labels=MANAGED)
def pod_event(namespace: str, labels: dict[str, str], model_by_label: kopf.Index, **_: Any) -> None:
    names = model_by_label.get((namespace, labels.get(contract.LABEL_MODEL, "")), [])
    for name in names:
        reconciler().trigger(namespace, name, full=False)
