"""Kopf registrations: indexes that mirror the cluster, and events that queue a model. No logic here.

- One watch per kind the operator reads: DisaggregatedModels, every kind it renders (render.MANAGED_KINDS)
  and Pods, each filtered to our managed-by label. Each feeds an index (cache.py) and queues the owning model
  (found by its model label) on every event. kopf lists everything at start, which queues every model once.
- The controller (reconcile.py) owns the work queue, the worker threads, retries with backoff and the
  resync; kopf handlers only add keys.
- No handler that persists state on the CR (kopf's create/update/resume keep diff-bases and progress in
  annotations) and no timer or daemon: kopf gives those a finalizer, so deleting a model would hang while
  the operator is down. The resync runs in the controller instead.
- All handlers are `async def` and do no I/O: no thread per event.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import kopf

from disagg_connector import contract

from .cache import CHILD_INDEX_PREFIX, MODEL_NAMES_INDEX, MODELS_INDEX, PODS_INDEX, IndexCache, index_key, slim, slim_pod
from .config import RenderDefaults
from .kube import REQUEST_TIMEOUT, Cluster, EventRecorder, load_api_client
from .metrics import OperatorMetrics
from .reconcile import Controller, Reconciler
from .render import MANAGED_KINDS

log = logging.getLogger(__name__)

MODEL = (contract.API_GROUP, contract.API_VERSION, contract.PLURAL)
MANAGED = {contract.LABEL_MANAGED_BY: contract.OPERATOR_NAME}
# The API server's answer to the health probe, within the chart's probe timeout (5 s)
PROBE_TIMEOUT_SECONDS = 3.0


@dataclass(frozen=True)
class Options:
    """Operator settings from the command line."""

    workers: int = 4
    resync_seconds: float = 300.0
    metrics: OperatorMetrics | None = None  # already serving: cli.py binds its port before kopf starts
    peering: str | None = None  # None: standalone, always active
    priority: int = 0
    clusterwide: bool = True
    defaults: RenderDefaults = field(default_factory=RenderDefaults)  # the chart's modelDefaults, read by cli.py


@dataclass
class OperatorMemo:
    """kopf's ``memo``, handed to every handler: cli.py passes one to ``kopf.run(memo=...)``, no module globals.

    kopf shallow-copies it for each resource it sees: ``cache`` is one shared object, and ``controller`` is
    set by the startup handler, which kopf finishes before it starts any watch (so before any copy)."""

    options: Options = field(default_factory=Options)
    cache: IndexCache = field(default_factory=IndexCache)
    controller: Controller | None = None

    def running(self) -> Controller:
        if self.controller is None:
            raise RuntimeError("the operator has not started")
        return self.controller


def configure(settings: kopf.OperatorSettings) -> None:
    """Kopf settings, on purpose (see docs/design.md, "Kopf, on purpose")."""
    # Watches that go quiet behind load balancers are restarted (kopf #847, #1276).
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    # Only warnings become Kubernetes Events on the CR; info stays in the operator's log.
    settings.posting.level = logging.WARNING
    # Our handlers only queue a key: kopf's "Handler ... succeeded" for every watch event says nothing.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)


class PeeringGate:
    """Whether this replica may work now. kopf pauses its own handlers when a peer of higher (or equal)
    priority is alive (docs/peering.rst); our workers and resync run outside kopf, so they read the same
    peering object and apply the same rule. Cached for a few seconds: one GET per period, not per pass."""

    TTL = 5.0

    def __init__(self, cluster: Cluster, name: str, priority: int, clusterwide: bool):
        self.cluster, self.name, self.priority, self.clusterwide = cluster, name, priority, clusterwide
        self._cached: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def __call__(self, namespace: str) -> bool:
        scope = "" if self.clusterwide else namespace
        with self._lock:
            at, active = self._cached.get(scope, (0.0, True))
            if time.monotonic() - at < self.TTL:
                return active
        active = self._read(scope)
        with self._lock:
            self._cached[scope] = (time.monotonic(), active)
        return active

    def _read(self, namespace: str) -> bool:
        kind = "ClusterKopfPeering" if self.clusterwide else "KopfPeering"
        probe = {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": self.name, "namespace": namespace or None}}
        try:
            peering = self.cluster.get(probe)
        except Exception as error:  # unreadable: keep working; kopf's own pause still holds its handlers
            log.info("peering %s not readable (%s); staying active", self.name, error)
            return True
        return peering_allows(peering or {}, self.priority, time.time())


def peering_allows(peering: Mapping[str, Any], priority: int, now: float) -> bool:
    """kopf's rule: pause while another live peer has a higher priority, or the same one (then all pause)."""
    from datetime import datetime

    same = 0
    for info in (peering.get("status") or {}).values():
        try:
            seen = datetime.fromisoformat(str(info.get("lastseen")).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        if seen + float(info.get("lifetime") or 60) < now:
            continue  # dead
        peer = int(info.get("priority") or 0)
        if peer > priority:
            return False
        same += peer == priority
    return same <= 1  # this replica itself is one of them


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
    configure(settings)
    options = memo.options
    cluster = Cluster(load_api_client())
    metrics = options.metrics or OperatorMetrics(workers=options.workers)
    # The routers' KV-transfer numbers are read on the resync period (and whenever a pod drains).
    # Events name this replica (its pod's name in a cluster) as their reporting instance.
    recorder = EventRecorder(cluster.api_client, instance=socket.gethostname())
    reconciler = Reconciler(memo.cache, cluster, options.defaults, metrics, router_poll_seconds=options.resync_seconds,
                            recorder=recorder)  # fmt: skip
    gate = PeeringGate(cluster, options.peering, options.priority, options.clusterwide) if options.peering else None
    memo.controller = Controller(reconciler, workers=options.workers, resync_seconds=options.resync_seconds,
                                 active=(lambda key: gate(key[0])) if gate else (lambda key: True))  # fmt: skip
    memo.controller.start()
    log.info("operator started: %d workers, resync every %.0f s, API timeout %s s", options.workers,
             options.resync_seconds, REQUEST_TIMEOUT)  # fmt: skip


@kopf.on.probe(id="apiserver", errors=kopf.ErrorsMode.PERMANENT, timeout=PROBE_TIMEOUT_SECONDS + 1)
def apiserver(memo: OperatorMemo, **_: Any) -> str:
    """/healthz (the chart's startup, readiness and liveness probes) fails while this replica cannot reach the
    API server: a pod whose network cannot (a default-deny egress policy, no route to the `kubernetes` Service)
    goes unready and is restarted, `helm install --wait` fails, instead of looking healthy while every request
    fails. kopf keeps an answer 10 s."""
    return memo.running().reconciler.cluster.version(PROBE_TIMEOUT_SECONDS)


@kopf.on.cleanup()
def cleanup(memo: OperatorMemo, **_: Any) -> None:
    if memo.controller is not None:
        memo.controller.stop()


@kopf.index(*MODEL, id=MODELS_INDEX)
async def index_model(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    return {(namespace, name): slim(body)}


@kopf.index(*MODEL, id=MODEL_NAMES_INDEX)
async def index_model_name(namespace: str, name: str, **_: Any) -> dict[tuple[str, str], str]:
    """CR names by their (possibly shortened) model label value: how a child's event finds its model."""
    return {(namespace, contract.model_label_value(name)): name}


async def index_child(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    return {index_key(namespace, labels): slim(body)}


async def index_pod(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    return {index_key(namespace, labels): slim_pod(body)}


@kopf.on.event(*MODEL, id="model_event")
async def model_event(namespace: str, name: str, memo: OperatorMemo, **kwargs: Any) -> None:
    memo.cache.bind(kwargs)
    memo.running().enqueue(namespace, name)


async def child_event(namespace: str, labels: kopf.Labels, memo: OperatorMemo, **kwargs: Any) -> None:
    memo.cache.bind(kwargs)
    for name in memo.cache.models_named(*index_key(namespace, labels)):
        memo.running().enqueue(namespace, name)


for _api_version, _kind, _plural in MANAGED_KINDS:
    kopf.index(_api_version, _plural, labels=MANAGED, id=f"{CHILD_INDEX_PREFIX}{_plural}")(index_child)
    kopf.on.event(_api_version, _plural, labels=MANAGED, id=f"event_{_plural}")(child_event)
kopf.index("v1", "pods", labels=MANAGED, id=PODS_INDEX)(index_pod)
kopf.on.event("v1", "pods", labels=MANAGED, id="event_pods")(child_event)

