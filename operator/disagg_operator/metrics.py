"""The operator's Prometheus metrics, named as controller-runtime names its own (so the dashboards and
alerts people already have for Go operators read ours too), plus what is particular to this operator.

controller-runtime's names, label controller="disaggregatedmodel":
  controller_runtime_reconcile_total{result=success|error|requeue}
  controller_runtime_reconcile_errors_total
  controller_runtime_reconcile_time_seconds (histogram)
  controller_runtime_active_workers, controller_runtime_max_concurrent_reconciles
  workqueue_depth, workqueue_adds_total, workqueue_retries_total (label name="disaggregatedmodel")
Ours:
  disagg_operator_reconcile_errors_by_reason_total{reason}   ChildRejected, OwnershipConflict, ApiUnavailable, ...
  disagg_operator_children_applied_total{kind}, disagg_operator_children_deleted_total{kind}
  disagg_operator_model_passes_total{model_namespace, model, result}   the passes of each model (result as
                                                              controller_runtime_reconcile_total's): that a model
                                                              was reconciled N times since a start
  disagg_operator_models{phase}                               read from the cache at scrape time
  disagg_operator_model_condition{model_namespace, model, type, status, reason}   1 per model and condition
                                                              type, read from the cache at scrape time
  The SLO autoscaler's (spec.autoscaling) targets and last decision, read from the cache at scrape time:
  disagg_operator_autoscaler_engines{model_namespace, model, role, size=current|decided}
  disagg_operator_autoscaler_target_seconds{model_namespace, model, slo=ttft|tpot}
  disagg_operator_autoscaler_measured_seconds{model_namespace, model, slo=ttft|tpot|prefill_leg|local_ttft}   the
                                                              targets' percentile over its last interval (local_ttft:
                                                              of the prompts decode prefilled itself)
  disagg_operator_autoscaler_estimate{model_namespace, model, estimate}   demand and learned capacity
                                                              (status.autoscaling.estimates' keys)
  disagg_operator_autoscaler_blocked{model_namespace, model}  1 while a role that should grow cannot be scheduled
The model's own labels are model_namespace and model, not namespace: a scrape's target label namespace (the
operator's) would rename an exported namespace to exported_namespace.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTROLLER = "disaggregatedmodel"
# The results of a pass, in controller-runtime's words (reconcile.py counts each).
RECONCILE_RESULTS = ("success", "error", "requeue")
# Passes take milliseconds when nothing changes and seconds when an API server is slow.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ModelCondition(NamedTuple):
    """One condition of a DisaggregatedModel's status, as the alerts read it (a rollout stuck: Progressing)."""

    namespace: str
    model: str
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str


def model_conditions(namespace: str, name: str, body: Mapping[str, object]) -> list[ModelCondition]:
    status = body.get("status")
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    return [
        ModelCondition(namespace, name, str(c.get("type", "")), str(c.get("status", "Unknown")), str(c.get("reason", "")))
        for c in conditions or () if isinstance(c, Mapping) and c.get("type")
    ]


# The SLO autoscaler's gauges: family -> (help, its labels besides model_namespace and model).
AUTOSCALER_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "disagg_operator_autoscaler_engines": ("Engines per role of a model with spec.autoscaling: current (when the "
                                           "autoscaler decided) and decided", ("role", "size")),
    "disagg_operator_autoscaler_target_seconds": ("The SLO autoscaler's TTFT and TPOT targets", ("slo",)),
    "disagg_operator_autoscaler_measured_seconds": ("The targets' percentile the routers measured over the SLO "
                                                    "autoscaler's last interval", ("slo",)),
    "disagg_operator_autoscaler_estimate": ("The SLO autoscaler's demand and learned capacity estimates", ("estimate",)),
    "disagg_operator_autoscaler_blocked": ("1 while a role the SLO autoscaler would grow cannot be scheduled", ()),
}  # fmt: skip
# status.autoscaling.measured's keys as the measured family's slo label.
_MEASURED_SLO = {"ttftSeconds": "ttft", "tpotSeconds": "tpot", "prefillLegSeconds": "prefill_leg", "localTtftSeconds": "local_ttft"}


class AutoscalerSample(NamedTuple):
    family: str  # a key of AUTOSCALER_FAMILIES
    namespace: str
    model: str
    labels: tuple[str, ...]  # the family's own labels' values
    value: float


def model_autoscaling(namespace: str, name: str, body: Mapping[str, Any]) -> list[AutoscalerSample]:
    """A model's SLO autoscaler gauges: its targets (spec) and its last decision (status); none without
    spec.autoscaling."""
    spec = (body.get("spec") or {}).get("autoscaling")
    if not isinstance(spec, Mapping):
        return []
    out = [AutoscalerSample("disagg_operator_autoscaler_target_seconds", namespace, name, (slo,), float(spec[key]) / 1000)
           for slo, key in (("ttft", "ttftMilliseconds"), ("tpot", "tpotMilliseconds")) if key in spec]
    decision = (body.get("status") or {}).get("autoscaling")
    if not isinstance(decision, Mapping):
        return out
    for role in ("prefill", "decode"):
        for size, key in (("current", "current"), ("decided", "recommended")):
            if isinstance(decision.get(role), Mapping) and key in decision[role]:
                out.append(AutoscalerSample("disagg_operator_autoscaler_engines", namespace, name, (role, size), float(decision[role][key])))
    out += [AutoscalerSample("disagg_operator_autoscaler_measured_seconds", namespace, name, (slo,), float(v))
            for key, slo in _MEASURED_SLO.items() if isinstance(v := (decision.get("measured") or {}).get(key), (int, float))]
    out += [AutoscalerSample("disagg_operator_autoscaler_estimate", namespace, name, (str(k),), float(v))
            for k, v in (decision.get("estimates") or {}).items() if isinstance(v, (int, float))]
    out.append(AutoscalerSample("disagg_operator_autoscaler_blocked", namespace, name, (), float(bool(decision.get("blocked")))))
    return out


class _Live(Collector):
    """Gauges read at scrape time (queue depth, models by phase, their conditions), so nothing has to keep them current."""

    def __init__(self, queue_stats: Callable[[], tuple[int, int, int]], phases: Callable[[], Mapping[str, int]],
                 conditions: Callable[[], Iterable[ModelCondition]], autoscaling: Callable[[], Iterable[AutoscalerSample]]):
        self._queue_stats = queue_stats
        self._phases = phases
        self._conditions = conditions
        self._autoscaling = autoscaling

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        depth, adds, retries = self._queue_stats()
        yield _labelled(GaugeMetricFamily("workqueue_depth", "Current depth of the work queue", labels=["name"]), depth)
        yield _labelled(CounterMetricFamily("workqueue_adds", "Total adds handled by the work queue", labels=["name"]), adds)
        yield _labelled(CounterMetricFamily("workqueue_retries", "Total retries handled by the work queue", labels=["name"]), retries)
        models = GaugeMetricFamily("disagg_operator_models", "DisaggregatedModels by status phase", labels=["phase"])
        for phase, count in sorted(self._phases().items()):
            models.add_metric([phase], count)
        yield models
        condition = GaugeMetricFamily("disagg_operator_model_condition", "1 per condition of a DisaggregatedModel's status",
                                      labels=["model_namespace", "model", "type", "status", "reason"])
        for c in self._conditions():
            condition.add_metric([c.namespace, c.model, c.type, c.status, c.reason], 1)
        yield condition
        families = {name: GaugeMetricFamily(name, text, labels=["model_namespace", "model", *labels])
                    for name, (text, labels) in AUTOSCALER_FAMILIES.items()}  # fmt: skip
        for s in self._autoscaling():
            families[s.family].add_metric([s.namespace, s.model, *s.labels], s.value)
        yield from families.values()


def _labelled(family: GaugeMetricFamily | CounterMetricFamily, value: float) -> GaugeMetricFamily | CounterMetricFamily:
    family.add_metric([CONTROLLER], value)
    return family


class OperatorMetrics:
    def __init__(self, workers: int, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconcile_total = Counter("controller_runtime_reconcile", "Total reconciliations per controller",
                                       ["controller", "result"], registry=r)
        self.reconcile_errors = Counter("controller_runtime_reconcile_errors", "Total reconciliation errors per controller",
                                        ["controller"], registry=r)
        self.reconcile_time = Histogram("controller_runtime_reconcile_time_seconds", "Length of time per reconciliation",
                                        ["controller"], buckets=BUCKETS, registry=r)
        self.active_workers = Gauge("controller_runtime_active_workers", "Number of currently used workers",
                                    ["controller"], registry=r)
        Gauge("controller_runtime_max_concurrent_reconciles", "Maximum number of concurrent reconciles",
              ["controller"], registry=r).labels(CONTROLLER).set(workers)
        self.errors_by_reason = Counter("disagg_operator_reconcile_errors_by_reason", "Passes that failed or were blocked, by reason",
                                        ["reason"], registry=r)
        self.applied = Counter("disagg_operator_children_applied", "Children written by server-side apply", ["kind"], registry=r)
        self.deleted = Counter("disagg_operator_children_deleted", "Children deleted", ["kind"], registry=r)
        self.model_passes = Counter("disagg_operator_model_passes", "Reconcile passes per DisaggregatedModel, by result",
                                    ["model_namespace", "model", "result"], registry=r)
        # At 0 from the start, as controller-runtime initialises them: a query over them has data before the first error.
        self.reconcile_errors.labels(CONTROLLER)
        for result in RECONCILE_RESULTS:
            self.reconcile_total.labels(CONTROLLER, result)

    def watch(self, queue_stats: Callable[[], tuple[int, int, int]], phases: Callable[[], Mapping[str, int]],
              conditions: Callable[[], Iterable[ModelCondition]] = tuple,
              autoscaling: Callable[[], Iterable[AutoscalerSample]] = tuple) -> None:
        self.registry.register(_Live(queue_stats, phases, conditions, autoscaling))

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Binds now (OSError when it cannot: `run` says so before kopf starts), serves from a daemon thread."""
        start_http_server(port, addr=addr, registry=self.registry)
