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
  disagg_operator_models{phase}                               read from the cache at scrape time
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTROLLER = "disaggregatedmodel"
# Passes take milliseconds when nothing changes and seconds when an API server is slow.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Live(Collector):
    """Gauges read at scrape time (queue depth, models by phase), so nothing has to keep them current."""

    def __init__(self, queue_stats: Callable[[], tuple[int, int, int]], phases: Callable[[], Mapping[str, int]]):
        self._queue_stats = queue_stats
        self._phases = phases

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        depth, adds, retries = self._queue_stats()
        yield _labelled(GaugeMetricFamily("workqueue_depth", "Current depth of the work queue", labels=["name"]), depth)
        yield _labelled(CounterMetricFamily("workqueue_adds", "Total adds handled by the work queue", labels=["name"]), adds)
        yield _labelled(CounterMetricFamily("workqueue_retries", "Total retries handled by the work queue", labels=["name"]), retries)
        models = GaugeMetricFamily("disagg_operator_models", "DisaggregatedModels by status phase", labels=["phase"])
        for phase, count in sorted(self._phases().items()):
            models.add_metric([phase], count)
        yield models


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

    def watch(self, queue_stats: Callable[[], tuple[int, int, int]], phases: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(_Live(queue_stats, phases))

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Binds now (OSError when it cannot: `run` says so before kopf starts), serves from a daemon thread."""
        start_http_server(port, addr=addr, registry=self.registry)
