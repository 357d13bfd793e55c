"""Prometheus metrics of the router (own registry, served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)

from disagg_connector.router.discovery import Backend, Snapshot

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "disagg_router_requests", "Client requests by mode, endpoint and HTTP status", ["mode", "endpoint", "code"], registry=r
        )
        self.ttft = Histogram(
            "disagg_router_time_to_first_token_seconds",
            "Time from request arrival to the first streamed chunk sent to the client",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "disagg_router_request_duration_seconds",
            "End-to-end request latency as seen by the router",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "disagg_router_failures", "Failed legs and requests by cause", ["mode", "cause"], registry=r
        )
        self.retries = Counter("disagg_router_retries", "Retries on another pair with a fresh id", ["mode"], registry=r)
        self.in_flight = Gauge("disagg_router_requests_in_flight", "Client requests in progress", registry=r)
        self.backend_in_flight = Gauge(
            "disagg_router_backend_in_flight", "Outstanding legs per backend", ["role", "backend", "revision"], registry=r
        )
        self.backends = Gauge(
            "disagg_router_ready_backends", "Ready backends discovered, per role and revision", ["role", "revision"], registry=r
        )
        self.discovery_errors = Counter(
            "disagg_router_discovery_errors", "Discovery failures (the last table is kept)", registry=r
        )
        self.discovery_events = Counter("disagg_router_discovery_events", "Pod watch events applied", registry=r)

    def on_inflight(self, b: Backend, n: int) -> None:
        self.backend_in_flight.labels(b.role, b.key, b.revision).set(n)

    def on_table(self, snap: Snapshot) -> None:
        self.backends.clear()
        live = set()
        for r in snap.revisions:
            self.backends.labels("prefill", r.revision).set(len(r.prefill))
            self.backends.labels("decode", r.revision).set(len(r.decode))
            live.update((b.role, b.key, b.revision) for b in (*r.prefill, *r.decode))
        for sample in list(self.backend_in_flight.collect()[0].samples):
            labels = (sample.labels["role"], sample.labels["backend"], sample.labels["revision"])
            if labels not in live and sample.value == 0:
                self.backend_in_flight.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
