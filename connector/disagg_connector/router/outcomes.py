"""What happened to requests, written once into both ledgers: the Prometheus metrics (:mod:`metrics`) and
the per-revision outcome counts behind ``/health`` (:mod:`stats`). Dispatch and relay say what happened;
this module knows which ledger counts what (``/health`` counts disaggregated dispatches only: a local
request is neither a success nor a failure of a revision's KV transfer).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from disagg_connector.router.discovery import Backend
from disagg_connector.router.incidents import Incidents
from disagg_connector.router.legs import Timeline
from disagg_connector.router.metrics import RouterMetrics
from disagg_connector.router.migration import MIGRATED
from disagg_connector.router.policy import Pick
from disagg_connector.router.stats import RouterStats


log = logging.getLogger("disagg_router.dispatch")
PANIC_LOG_EVERY_S = 10.0


class OutcomeRecorder:
    def __init__(self, metrics: RouterMetrics, stats: RouterStats, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics, self.stats, self.clock = metrics, stats, clock
        self.incidents = Incidents()  # the Events on the model (incidents.EventPoster posts them)
        self._panic_logged_at: float | None = None
        self._zeroed: set[tuple[str, str]] = set()  # (revision, flow) whose series exist at 0

    def request_started(self) -> None:
        self.metrics.in_flight.inc()

    def request_ended(self, revision: str, flow: str, kind: str, status: int, seconds: float) -> None:
        """The client's request answered (or abandoned): ``revision`` and ``flow`` of its last attempt,
        empty when no attempt was made."""
        m = self.metrics
        m.in_flight.dec()
        m.child(m.requests, revision, flow, kind, str(status)).inc()
        m.child(m.e2e, revision, flow).observe(seconds)

    def picked(self, pick: Pick, prompt_tokens: int | None = None) -> Backend:
        """A policy's pick (why, per role and policy); for a prefill, the prefix it expects cached there."""
        b = pick.backend
        m = self.metrics
        m.child(m.picks, b.role, pick.policy, pick.reason).inc()
        if prompt_tokens is not None:
            m.child(m.expected_hit_tokens, b.key).inc(pick.expected_hit_tokens)
            m.child(m.prompt_tokens, b.key).inc(prompt_tokens)
            self.stats.prefix_expected(b.key, pick.expected_hit_tokens, prompt_tokens)
        return b

    def despite_ejections(self, revision: str, ejected: int) -> None:
        """An attempt sent to a pair with an ejected backend: ejection left no pair (panic routing). Counted; logged
        at most every PANIC_LOG_EVERY_S (a storm of them is one condition)."""
        self.metrics.child(self.metrics.despite_ejections, revision).inc()
        now = self.clock()
        if self._panic_logged_at is None or now - self._panic_logged_at >= PANIC_LOG_EVERY_S:
            self._panic_logged_at = now
            log.warning("every pair lost a backend to ejection (%d ejected): routing to ejected backends of revision %s "
                        "until a probe re-admits one", ejected, revision)  # fmt: skip

    def attempt(self, revision: str, flow: str, retry: bool) -> None:
        """An attempt dispatched to a pair (``flow`` push|pull) or a decode alone (``local``) of ``revision``."""
        if (revision, flow) not in self._zeroed:  # at 0 from a revision's first attempt: a panel shows 0, not "no data"
            self._zeroed.add((revision, flow))
            self.metrics.child(self.metrics.retries, revision)
            self.metrics.child(self.metrics.despite_ejections, revision)
            self.metrics.child(self.metrics.migrations, revision, "decode_stream_broken", MIGRATED)
            self.metrics.child(self.metrics.migration_gap, revision, flow)
        if retry:
            self.metrics.child(self.metrics.retries, revision).inc()
        if flow == "local":
            self.stats.local(revision)
        else:
            self.stats.dispatched(revision)

    def failed(self, revision: str, flow: str, cause: str) -> None:
        """An attempt or a stream failed (``cause``: the vocabulary of :mod:`contract.health`)."""
        self.metrics.child(self.metrics.failures, revision, flow, cause).inc()
        if revision and flow != "local":
            self.stats.failed(revision, cause)

    def migration(self, revision: str, engine: str, cause: str, outcome: str) -> None:
        """A stream's decode (pod ``engine``) failed after its first token (``cause``): what became of the stream
        (metrics.migrations, and the failed engine's incident)."""
        self.metrics.child(self.metrics.migrations, revision, cause, outcome).inc()
        self.incidents.record(engine, revision, cause, outcome, self.clock())

    def migration_waiting(self, change: int) -> None:
        """A stream whose decode failed began (+1) or ended (-1) waiting for a pair to continue on."""
        self.metrics.migrations_waiting.inc(change)

    def migration_gap(self, revision: str, flow: str, seconds: float) -> None:
        """A continuation's first chunk reached the client ``seconds`` after its last chunk before the failure."""
        self.metrics.child(self.metrics.migration_gap, revision, flow).observe(seconds)

    def first_chunk(self, revision: str, flow: str, seconds: float) -> None:
        self.metrics.child(self.metrics.ttft, revision, flow).observe(seconds)

    def per_token(self, revision: str, flow: str, seconds: float) -> None:
        self.metrics.child(self.metrics.tpot, revision, flow).observe(seconds)

    def answered(self, revision: str, flow: str, timeline: Timeline, prefill_failure: str | None) -> None:
        """The client got its whole answer: the timings of its legs, and a success for its revision. A
        push prefill leg that failed meanwhile (``prefill_failure``: its decode answered anyway, e.g. by
        prefilling itself) counts against the revision's KV transfer instead."""
        m = self.metrics
        if timeline.prefill is not None:
            m.child(m.prefill, revision, flow).observe(timeline.prefill)
        if timeline.kv_wait is not None:
            m.child(m.kv_wait, revision, flow).observe(timeline.kv_wait)
        if flow == "local":
            return
        if prefill_failure is not None:
            self.failed(revision, flow, prefill_failure)
        else:
            self.stats.succeeded(revision)
