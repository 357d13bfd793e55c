"""Outcome counts per revision: the numbers behind /health (and the failure counters of /metrics).

Pure bookkeeping with an injectable clock. Cumulative counts, plus a sliding window of
``window_seconds`` kept in a few coarse buckets, so a revision that healed shows it within a window.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from disagg_connector.contract.health import Outcomes

WINDOW_SECONDS = 60.0
_BUCKETS = 12


@dataclass
class _Bucket:
    start: float
    requests: int = 0
    succeeded: int = 0
    failures: Counter[str] = field(default_factory=Counter)


@dataclass
class RevisionCounters:
    requests: int = 0
    succeeded: int = 0
    local: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    last_success: float | None = None
    window: deque[_Bucket] = field(default_factory=deque)


class RouterStats:
    def __init__(self, window_seconds: float = WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_seconds = window_seconds
        self.clock = clock
        self.revisions: dict[str, RevisionCounters] = {}
        # per prefill backend: prompt tokens sent, and those the policy expected cached there
        self.prefix_tokens: Counter[str] = Counter()
        self.prefix_expected_hits: Counter[str] = Counter()
        self._bucket_seconds = window_seconds / _BUCKETS

    def prefix_expected(self, backend: str, hit_tokens: int, prompt_tokens: int) -> None:
        self.prefix_expected_hits[backend] += hit_tokens
        self.prefix_tokens[backend] += prompt_tokens

    def _rev(self, revision: str) -> RevisionCounters:
        r = self.revisions.get(revision)
        if r is None:
            r = self.revisions[revision] = RevisionCounters()
        return r

    def _bucket(self, r: RevisionCounters, now: float) -> _Bucket:
        self._expire(r, now)
        if not r.window or now - r.window[-1].start >= self._bucket_seconds:
            r.window.append(_Bucket(now))
        return r.window[-1]

    def _expire(self, r: RevisionCounters, now: float) -> None:
        while r.window and now - r.window[0].start >= self.window_seconds:
            r.window.popleft()

    def dispatched(self, revision: str) -> None:
        """A disaggregated dispatch (both legs) to a pair of this revision."""
        r = self._rev(revision)
        r.requests += 1
        self._bucket(r, self.clock()).requests += 1

    def local(self, revision: str) -> None:
        self._rev(revision).local += 1

    def succeeded(self, revision: str) -> None:
        now = self.clock()
        r = self._rev(revision)
        r.succeeded += 1
        r.last_success = now
        self._bucket(r, now).succeeded += 1

    def failed(self, revision: str, cause: str) -> None:
        r = self._rev(revision)
        r.failures[cause] += 1
        self._bucket(r, self.clock()).failures[cause] += 1

    def totals(self, revision: str) -> Outcomes:
        r = self._rev(revision)
        return Outcomes(r.requests, r.succeeded, dict(r.failures))

    def recent(self, revision: str) -> Outcomes:
        r = self._rev(revision)
        self._expire(r, self.clock())
        failures: Counter[str] = Counter()
        for b in r.window:
            failures.update(b.failures)
        return Outcomes(sum(b.requests for b in r.window), sum(b.succeeded for b in r.window), dict(failures))

    def last_success_age(self, revision: str) -> float | None:
        last = self._rev(revision).last_success
        return None if last is None else self.clock() - last
