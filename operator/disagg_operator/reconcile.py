"""One reconcile pass of a DisaggregatedModel, and the controller that runs passes.

A pass reads top-down:
1. read the model from the cache (gone or being deleted: nothing to do, the garbage collector has it);
2. desire it (state.desire: parse and render; an invalid spec gets `InvalidSpec` in status, nothing running is
   touched);
3. observe (the cache; the routers too when planner.routers_due says so) and plan; if the plan writes, probe
   its writes and plan again with what the probes found (planner.py: nothing half-applied);
4. execute the plan;
5. finish: one function builds the status of whatever the outcome was (status.of_outcome: an invalid spec, a
   bug, the API server away, a plan carried out in full or in part), the pass's Events are recorded, and the
   status is written if it changed.
A pass that could not do all it planned is retried with capped exponential backoff; every model is
also re-queued every resync period, which repairs what no event announced.

The controller owns the work queue and its worker threads. kopf's handlers only add keys to it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from . import autoscaler, events, executor, planner, sizing
from . import status as status_mod
from .api.vocabulary import Reason
from .cache import Cache
from .config import RenderDefaults
from .kube import Cluster, EventRecorder, error_message
from .metrics import CONTROLLER, AutoscalerSample, ModelCondition, OperatorMetrics, model_autoscaling, model_conditions
from .render import gang
from .render.engine import weights_claim
from .router_readings import Interval, ReadingError, RouterReading, interval, parse_router_metrics
from .state import ChildProblem, Desired, Observed, SpecProblems, desire
from .workqueue import WorkQueue

log = logging.getLogger(__name__)

ModelKey = tuple[str, str]  # (namespace, name)
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, OSError)


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class PassResult:
    result: str  # success | blocked | error | invalid | gone
    reason: Reason | None = None  # a condition reason (the errors-by-reason metric's label)
    detail: str = ""
    requeue_after: float | None = None  # a successful pass that must come back (a pod drains)

    @property
    def retry(self) -> bool:
        return self.result in ("blocked", "error")


def _resource_version(obj: Mapping[str, Any] | None) -> int:
    try:
        return int((obj or {}).get("metadata", {}).get("resourceVersion") or 0)
    except ValueError:  # opaque on some servers: then the cache is taken as fresh
        return 0


@dataclass
class _Scaling:
    """The SLO autoscaler's memory of one model, between its decisions."""

    readings: dict[str, RouterReading]  # per router pod: its /metrics at the last decision
    memory: autoscaler.Memory
    at: float | None = None  # monotonic, of the last read
    status: dict[str, Any] | None = None  # status.autoscaling of the last decision


class Reconciler:
    def __init__(self, cache: Cache, cluster: Cluster, defaults: RenderDefaults, metrics: OperatorMetrics,
                 now: Callable[[], str] = utc_now, router_poll_seconds: float = 300.0,
                 recorder: EventRecorder | None = None):  # fmt: skip
        self.cache = cache
        self.recorder = recorder
        self.router_poll_seconds = router_poll_seconds
        self._routers_read: dict[ModelKey, planner.RoutersRead] = {}
        self.cluster = cluster
        self.defaults = defaults
        self.metrics = metrics
        self.now = now
        # The status we last wrote per model, with the resourceVersion the write produced: until the cache
        # has caught up with our own write, that is the status this pass starts from.
        self._written: dict[ModelKey, tuple[int, dict[str, Any]]] = {}
        self._scaling: dict[ModelKey, _Scaling] = {}
        self._guard = threading.Lock()

    def reconcile(self, key: ModelKey) -> PassResult:
        namespace, name = key
        body = self.cache.model(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            with self._guard:
                self._written.pop(key, None)
                self._scaling.pop(key, None)
            return PassResult("gone")
        previous = self._previous_status(key, body)
        try:
            return self._reconcile(key, body, previous)
        except Exception as error:  # a bug: say so in status (if the API lets us), retry with backoff
            log.exception("reconcile of %s/%s failed", namespace, name)
            crashed = status_mod.PassOutcome(body["metadata"].get("generation"), previous, crashed=f"{type(error).__name__}: {error}")
            try:
                self._finish(key, body, crashed, [], best_effort=True)
            except Exception:  # the worker thread must live on, whatever failed
                log.exception("status of %s/%s not written either", namespace, name)
            return PassResult("error", Reason.INTERNAL_ERROR)

    def _missing_claim(self, model: Any, observed: Observed, namespace: str) -> str | None:
        """The weights' claim, if an engine pod has a scheduler error and the claim does not exist: the scheduler
        hides a missing claim behind such an error on a gang (status.scheduler_error). A read, only then."""
        claim = weights_claim(model)
        if not claim or not any(status_mod.scheduler_error(p) is not None for p in observed.pods):
            return None
        try:
            live = self.cluster.get({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": namespace}})
        except ApiException as error:  # an RBAC without persistentvolumeclaims get: the scheduler's words only
            log.info("%s/%s: cannot read PersistentVolumeClaim %s: %s", namespace, model.metadata.name, claim, error_message(error))
            return None
        return claim if live is None else None

    def _reconcile(self, key: ModelKey, body: Mapping[str, Any], previous: Mapping[str, Any] | None) -> PassResult:
        namespace, name = key
        meta = body["metadata"]
        desired = desire(body, self.defaults, previous)
        if isinstance(desired, SpecProblems):  # nothing running is touched
            self._finish(key, body, status_mod.PassOutcome(meta.get("generation"), previous, invalid=desired.problems), None)
            return PassResult("invalid", Reason.INVALID_SPEC)
        observed = Observed(children=self.cache.children(namespace, name, meta["uid"]), pods=self.cache.pods(namespace, name))
        now = self.now()
        try:
            if any(o["kind"] == gang.POD_GROUP_KIND for o in desired.rendered.objects):  # an engine spans pods
                served = self.cluster.serves(gang.POD_GROUP_API_VERSION, gang.POD_GROUP_KIND)  # discovery, kept a while
                observed = replace(observed, pod_groups_served=served)
            observed = replace(observed, missing_claim=self._missing_claim(desired.model, observed, namespace))
            if self._routers_due(key, observed):  # HTTP to the router pods, not the API server
                observed = replace(observed, routers=executor.read_routers(observed, status_mod.pod_ready))
            if desired.model.spec.autoscaling is not None:
                observed = replace(observed, autoscaling=self._autoscale(key, desired, observed))
            plan = planner.plan(desired, observed, now)
            if plan.applies:
                probes = executor.probe(plan, self.cluster, desired.ref.uid)
                if probes:
                    plan = planner.plan(desired, observed.with_probes(probes.foreign, probes.refused), now)
            outcome = executor.execute(plan, self.cluster, on_done=self._count)
            if plan.overdue:
                log.warning("%s/%s: %s let go at the drain bound (spec.rollout.drainTimeoutSeconds) though no router "
                            "said they were idle", namespace, name, ", ".join(plan.overdue))  # fmt: skip
        except (*TRANSPORT_ERRORS, ApiException) as error:  # the API server away, or a probe's GET refused (RBAC)
            problem = (ChildProblem(Reason.APPLY_FAILED, "API", "request", error_message(error)) if isinstance(error, ApiException)
                       else ChildProblem(Reason.API_UNAVAILABLE, "API", "server", f"the API server did not answer ({error}); retrying"))  # fmt: skip
            away = status_mod.PassOutcome(meta.get("generation"), previous, desired, observed, failure=problem)
            self._finish(key, body, away, [], best_effort=True)
            return PassResult("error", problem.reason)

        ended = status_mod.PassOutcome(meta.get("generation"), previous, desired, observed, plan.status, outcome.failure,
                                       outcome.done, outcome.total)  # fmt: skip
        self._finish(key, body, ended, lambda status: events.of_pass(desired, observed, plan, outcome.done, outcome.failure, status))
        if plan.problems:
            return PassResult("blocked", plan.problems[0].reason, plan.problems[0].describe())
        if outcome.failure is not None:
            return PassResult("error", outcome.failure.reason, outcome.failure.describe())
        scaling = desired.model.spec.autoscaling
        if scaling is not None:  # back for the next decision
            return PassResult("success", requeue_after=min(plan.requeue_after or scaling.interval_seconds, scaling.interval_seconds))
        return PassResult("success", requeue_after=plan.requeue_after)

    def _finish(self, key: ModelKey, body: Mapping[str, Any], outcome: status_mod.PassOutcome,
                told: Callable[[dict[str, Any]], list[events.Event]] | list[events.Event] | None,
                best_effort: bool = False) -> None:  # fmt: skip
        """The status of the pass's outcome, its Events (`told`: a function of the status, a list, or None for
        the status changes alone), and the status written if it changed. `best_effort`: the API server may be
        what failed, so a status that cannot be written is only logged."""
        status = status_mod.of_outcome(outcome, self.now())
        found = told(status) if callable(told) else (told if told is not None else events.of_status(outcome.previous, status))
        if self.recorder is not None:
            for event in found:
                self.recorder.record(dict(body), event)
        try:
            self._write_if_changed(key, outcome.previous, status)
        except (ApiException, *TRANSPORT_ERRORS):
            if not best_effort:
                raise
            log.info("status of %s/%s not written either: the API server is unavailable", *key)

    def _routers_due(self, key: ModelKey, observed: Observed) -> bool:
        at = time.monotonic()
        with self._guard:
            due = planner.routers_due(observed, self._routers_read.get(key), at, self.router_poll_seconds)
            if due:
                self._routers_read[key] = planner.RoutersRead(at, planner.ready_routers(observed))
        return due

    def _autoscale(self, key: ModelKey, desired: Desired, observed: Observed) -> dict[str, Any] | None:
        """status.autoscaling: a new decision once an interval has passed since the last read of the routers'
        /metrics (HTTP to the router pods), else the last one. The first read only starts the interval."""
        spec = desired.model.spec.autoscaling
        assert spec is not None
        with self._guard:
            state = self._scaling.setdefault(key, _Scaling({}, autoscaler.Memory()))
        started = time.monotonic()
        if state.at is not None and started - state.at < spec.interval_seconds:
            return state.status
        routers = observed.routers if observed.routers is not None else executor.read_routers(observed, status_mod.pod_ready)
        revision = desired.revision
        prefills = {b.backend for r in routers.reports if r for b in r.backends if b.role == "prefill" and b.revision == revision}
        measured, readings = Interval(), {}
        for pod, text in executor.read_router_metrics(observed, status_mod.pod_ready).items():
            if text is None:
                continue
            try:
                readings[pod] = parse_router_metrics(text)
            except ReadingError as error:
                log.info("%s/%s: router pod %s: %s", *key, pod, error)
                continue
            measured = measured.plus(interval(state.readings.get(pod), readings[pod], revision, prefills))
        first, seconds = state.at is None, started - (state.at or started)
        state.readings, state.at = readings, started
        if first:
            return state.status
        census = observed.census
        unschedulable = status_mod.unschedulable_engines(census, revision)
        shapes = {r: getattr(desired.model.spec, r).shape.accelerators for r in autoscaler.ROLES}
        policy = autoscaler.policy_of(spec, shapes)
        seen = autoscaler.Seen(revision, census, sizing.targets(desired, observed), routers, unschedulable,
                               bool(status_mod.old_revisions(observed, revision)), time.time())  # fmt: skip
        obs = autoscaler.observe(policy, seen, measured, seconds, spec.percentile)
        decision, state.memory = autoscaler.decide(policy, obs, state.memory)
        state.status = autoscaler.status_of(decision, obs, policy, self.now())
        return state.status

    def _count(self, action: planner.Action) -> None:
        if isinstance(action, planner.Apply):
            self.metrics.applied.labels(action.obj["kind"]).inc()
        elif isinstance(action, planner.Delete):
            self.metrics.deleted.labels(action.obj["kind"]).inc()

    def _previous_status(self, key: ModelKey, body: Mapping[str, Any]) -> dict[str, Any] | None:
        with self._guard:
            written = self._written.get(key)
        if written and written[0] > _resource_version(body):
            return written[1]
        return body.get("status")

    def _write_if_changed(self, key: ModelKey, previous: Mapping[str, Any] | None, status: dict[str, Any]) -> None:
        old = previous or {}
        if all(old.get(k) == v for k, v in status.items()):
            return
        try:
            written = self.cluster.write_status(key[0], key[1], status)
        except ApiException as error:
            if error.status == 404:  # deleted meanwhile
                return
            raise
        with self._guard:
            self._written[key] = (_resource_version(written), status)


class Controller:
    """The work queue, its workers and the resync: every trigger ends up as a key in the queue."""

    def __init__(self, reconciler: Reconciler, workers: int = 4, resync_seconds: float = 300.0,
                 active: Callable[[ModelKey], bool] = lambda key: True):  # fmt: skip
        self.reconciler = reconciler
        self.metrics = reconciler.metrics
        self.queue: WorkQueue[ModelKey] = WorkQueue()
        self.workers = workers
        self.resync_seconds = resync_seconds
        self.active = active
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def enqueue(self, namespace: str, name: str) -> None:
        self.queue.add((namespace, name))

    def start(self) -> None:
        self.metrics.watch(lambda: (self.queue.depth, self.queue.adds, self.queue.retries), self.phases, self.conditions,
                           self.autoscaling)  # fmt: skip
        for n in range(self.workers):
            self._threads.append(threading.Thread(target=self._work, name=f"reconcile-{n}", daemon=True))
        self._threads.append(threading.Thread(target=self._resync, name="resync", daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.queue.shutdown()

    def phases(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for namespace, name in self.reconciler.cache.model_keys():
            body = self.reconciler.cache.model(namespace, name) or {}
            phase = (body.get("status") or {}).get("phase") or "Unknown"
            counts[phase] = counts.get(phase, 0) + 1
        return counts

    def conditions(self) -> list[ModelCondition]:
        cache = self.reconciler.cache
        return [c for ns, name in cache.model_keys() for c in model_conditions(ns, name, cache.model(ns, name) or {})]

    def autoscaling(self) -> list[AutoscalerSample]:
        cache = self.reconciler.cache
        return [s for ns, name in cache.model_keys() for s in model_autoscaling(ns, name, cache.model(ns, name) or {})]

    def _resync(self) -> None:
        while not self._stop.wait(self.resync_seconds):
            for key in self.reconciler.cache.model_keys():
                if self.active(key):
                    self.queue.add(key)

    def _work(self) -> None:
        while (key := self.queue.get()) is not None:
            try:
                if self.active(key):  # a standby replica leaves the work to the active one
                    self._pass(key)
            finally:
                self.queue.done(key)

    def _pass(self, key: ModelKey) -> None:
        gauge = self.metrics.active_workers.labels(CONTROLLER)
        gauge.inc()
        started = time.monotonic()
        try:
            result = self.reconciler.reconcile(key)
        finally:
            gauge.dec()
            self.metrics.reconcile_time.labels(CONTROLLER).observe(time.monotonic() - started)
        outcome = ("error" if result.result == "error" else "requeue") if result.retry else "success"
        self.metrics.model_passes.labels(*key, outcome).inc()
        if result.retry:
            delay = self.queue.add_rate_limited(key)
            self.metrics.reconcile_total.labels(CONTROLLER, outcome).inc()
            self.metrics.errors_by_reason.labels(result.reason or "Unknown").inc()
            if result.result == "error":
                self.metrics.reconcile_errors.labels(CONTROLLER).inc()
            log.info("%s/%s: %s (%s: %s); next try in %.0f s", *key, result.result, result.reason, result.detail, delay)
        else:
            self.queue.forget(key)
            self.metrics.reconcile_total.labels(CONTROLLER, "success").inc()
            if result.requeue_after is not None:
                self.queue.add_after(key, result.requeue_after)
