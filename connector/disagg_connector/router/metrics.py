"""Prometheus metrics of the router (own registry, served at /metrics).

Per request, labelled by revision and path (``push``, ``pull``, ``local`` for prompts below the
disaggregation threshold): histograms of the prefill leg, the wait for the KV (the decode's first token
after both its leg started and the prefill finished: in pull the whole decode leg up to its first token,
in push the part of it after the prefill), time to first token, time per output token (streamed answers:
vLLM sends one SSE event per token unless its --stream-interval batches them) and end to end; failures by cause (the
vocabulary of :mod:`health`). Per backend, read at scrape time from the balancer: in-flight legs,
draining, ejected, the load the policies see; per revision: ready pairs and traffic weight. Stream migrations by cause and outcome, and the gap each added. Routing: the
policies' picks by role, policy and reason; per prefill backend the prompt tokens sent and those the policy
expected cached there (divide for the expected hit ratio; vLLM's own is ``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total``); the sizes of the prefix index and of the KV-event index.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from disagg_connector.contract.health import RouterHealth

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 30, 60, 120, 300)
# Time per output token: milliseconds apart on an H200, tens of them on a busy or small engine.
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_LABELS = ("revision", "mode")


class _Backends(Collector):
    """Backend and revision gauges from the /health summary at scrape time: nothing to keep in sync."""

    def __init__(self, summary: Callable[[], RouterHealth]) -> None:
        self.summary = summary

    def collect(self) -> Iterator[GaugeMetricFamily]:
        h = self.summary()
        labels = ["role", "pod", "backend", "revision"]
        inflight = GaugeMetricFamily("disagg_router_backend_in_flight", "Legs in flight per backend", labels=labels)
        draining = GaugeMetricFamily("disagg_router_backend_draining", "1 while the backend's pod is marked draining", labels=labels)
        ejected = GaugeMetricFamily("disagg_router_backend_ejected", "1 while the backend is ejected (failed, being re-probed)", labels=labels)
        load = GaugeMetricFamily(
            "disagg_router_backend_load",
            "Requests ahead of a new one as the policies see it: the engine's running and waiting at the last read of its "
            "/metrics plus this router's legs since then still in flight (this router's in-flight legs without a fresh read)",
            labels=labels,
        )  # fmt: skip
        waiting = GaugeMetricFamily("disagg_router_backend_waiting", "Requests waiting for room in the engine's scheduler at the "
                                    "last fresh read of its /metrics (vllm:num_requests_waiting_by_reason{reason=\"capacity\"}; "
                                    "vllm:num_requests_waiting where the engine does not split it)", labels=labels)  # fmt: skip
        kv_usage = GaugeMetricFamily("disagg_router_backend_kv_usage", "Share of the engine's KV cache in use at the last fresh "
                                     "read (vllm:kv_cache_usage_perc; a pod's largest over its cores)", labels=labels)  # fmt: skip
        for b in h.backends:
            values = [b.role, b.pod, b.backend, b.revision]
            inflight.add_metric(values, b.inflight)
            draining.add_metric(values, int(b.draining))
            ejected.add_metric(values, int(b.ejected))
            if b.routing is not None:
                load.add_metric(values, b.routing.load)
                if b.routing.waiting is not None:
                    waiting.add_metric(values, b.routing.waiting)
                if b.routing.kv_usage is not None:
                    kv_usage.add_metric(values, b.routing.kv_usage)
        pairs = GaugeMetricFamily("disagg_router_ready_pairs", "Usable prefill/decode pairs per revision", labels=["revision"])
        weight = GaugeMetricFamily("disagg_router_revision_weight", "Share of new requests per revision", labels=["revision"])
        ready = GaugeMetricFamily("disagg_router_ready_backends", "Usable backends per role and revision", labels=["role", "revision"])
        for name, r in h.revisions.items():
            pairs.add_metric([name], r.ready_pairs)
            weight.add_metric([name], r.weight)
            ready.add_metric(["prefill", name], r.prefill)
            ready.add_metric(["decode", name], r.decode)
        yield from (inflight, draining, ejected, load, waiting, kv_usage, pairs, weight, ready)


class RouterMetrics:
    def __init__(self, summary: Callable[[], RouterHealth], registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "disagg_router_requests", "Client requests by revision, path, endpoint and HTTP status",
            ["revision", "mode", "endpoint", "code"], registry=r,
        )  # fmt: skip

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=_LATENCY_BUCKETS, registry=r)

        self.prefill = hist("disagg_router_prefill_seconds", "The prefill leg, dispatch to prefill's answer")
        self.kv_wait = hist(
            "disagg_router_kv_wait_seconds",
            "Decode's first token after its leg started and the prefill finished (the wait for the KV cache)",
        )
        self.ttft = hist("disagg_router_time_to_first_token_seconds", "Request arrival to the first streamed chunk sent to the client")
        self.e2e = hist("disagg_router_request_duration_seconds", "End-to-end request latency as seen by the router")
        self.tpot = Histogram(
            "disagg_router_time_per_output_token_seconds",
            "Streamed answers: the first chunk to the end of the stream over the SSE events after the first",
            _LABELS, buckets=_TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.failures = Counter("disagg_router_failures", "Failed attempts and streams by cause", [*_LABELS, "cause"], registry=r)
        self.retries = Counter("disagg_router_retries", "Retries on another pair with fresh ids", ["revision"], registry=r)
        self.migrations = Counter(
            "disagg_router_migrations",
            "Streams whose decode failed after the first token, by the failed attempt's revision, the cause and what became "
            "of the stream: migrated (continued on another pair), complete (every token was out), refused (the request "
            "cannot be continued faithfully), exhausted (maxMigrations reached), failed (no pair took the continuation), "
            "off (migration is off)",
            ["revision", "cause", "outcome"], registry=r,
        )  # fmt: skip
        self.migration_gap = hist(
            "disagg_router_migration_gap_seconds",
            "What a migration added to the client's stream: its last chunk before the failure to the continuation's first",
        )
        self.migrations_waiting = Gauge(
            "disagg_router_migrations_waiting",
            "Streams whose decode failed waiting in the router for a pair to continue on (none took them at once)", registry=r,
        )  # fmt: skip
        self.despite_ejections = Counter(
            "disagg_router_routed_despite_ejections",
            "Attempts sent to a pair with an ejected backend because ejections left no other (panic routing)", ["revision"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge("disagg_router_requests_in_flight", "Client requests in progress", registry=r)
        self.discovery_errors = Counter("disagg_router_discovery_errors", "Discovery failures (the last table is kept)", registry=r)
        self.discovery_events = Counter("disagg_router_discovery_events", "Pod watch events applied", registry=r)
        self.picks = Counter(
            "disagg_router_picks", "Engines picked, by role, policy and the reason the policy gives (docs/router.md, Policies)",
            ["role", "policy", "reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "disagg_router_prefix_prompt_tokens", "Prompt tokens (estimated) sent to each prefill backend", ["backend"], registry=r
        )
        self.expected_hit_tokens = Counter(
            "disagg_router_prefix_expected_hit_tokens",
            "Of those, the tokens the prefix index expected the backend to hold in its prefix cache", ["backend"], registry=r,
        )  # fmt: skip
        self.prefix_index_entries = Gauge(
            "disagg_router_prefix_index_chunks", "Prompt chunks (64 tokens each, estimated) the prefix index holds over all backends", registry=r
        )
        self.kv_index_blocks = Gauge(
            "disagg_router_kv_index_blocks", "(backend, block) pairs the KV-event index holds over all backends", registry=r
        )
        self.load_reads = Counter("disagg_router_load_reads", "Reads of the engines' /metrics for their load, by result", ["result"], registry=r)
        r.register(_Backends(summary))
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Histogram | Counter, *labels: str) -> Any:
        """metric.labels(*labels), cached: label lookup is a measurable share of a request's cost."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def render(self) -> bytes:
        return generate_latest(self.registry)
