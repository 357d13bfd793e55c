"""What the SLO autoscaler reads from a model's routers, and how one interval is cut from two reads. Pure: the
executor fetches the routers' /metrics text; this parses it and subtracts.

A router's /metrics holds, per revision (`revision` label) and path (`mode`: push, pull, or local for a prompt the
router had decode prefill itself), the histograms the targets are judged on: time to first token
(`disagg_router_time_to_first_token_seconds`; the local path's apart too, decode's work), the prefill leg, queue and compute on the prefill
engine (`disagg_router_prefill_seconds`), and time per output token (`disagg_router_time_per_output_token_seconds`);
and per prefill backend the prompt tokens it was sent and those the policy expected cached
(`disagg_router_prefix_prompt_tokens_total`, `disagg_router_prefix_expected_hit_tokens_total`): their difference is
the prompt tokens prefill had to compute. Histograms and counters are cumulative since the router started: an
interval is one read less the one before (a router that restarted in between counts from zero), summed over the
routers, and a percentile of an interval is read from its buckets as Prometheus's histogram_quantile does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

TTFT = "disagg_router_time_to_first_token_seconds"
PREFILL_LEG = "disagg_router_prefill_seconds"
TPOT = "disagg_router_time_per_output_token_seconds"
HISTOGRAMS = (TTFT, PREFILL_LEG, TPOT)
LOCAL = "local"  # the `mode` of a request decode prefilled itself (below the disaggregation threshold)
PROMPT_TOKENS = "disagg_router_prefix_prompt_tokens"
EXPECTED_HIT_TOKENS = "disagg_router_prefix_expected_hit_tokens"


class ReadingError(ValueError):
    """A router's /metrics that is not Prometheus text."""


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (+Inf last), as Prometheus keeps them, and the observations' sum."""

    buckets: tuple[tuple[float, float], ...] = ()
    total: float = 0.0  # the series' _sum

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def minus(self, earlier: "Histogram") -> "Histogram":
        """The observations since `earlier`; all of them when the counts went back (the router restarted) or
        the buckets differ."""
        if [b for b, _ in earlier.buckets] != [b for b, _ in self.buckets] or any(
            n < m for (_, n), (_, m) in zip(self.buckets, earlier.buckets)
        ):
            return self
        return Histogram(tuple((b, n - m) for (b, n), (_, m) in zip(self.buckets, earlier.buckets)), self.total - earlier.total)

    def plus(self, other: "Histogram") -> "Histogram":
        if not self.buckets:
            return other
        if not other.buckets:
            return self
        if [b for b, _ in other.buckets] != [b for b, _ in self.buckets]:
            raise ReadingError("routers with different histogram buckets cannot be summed")
        return Histogram(tuple((b, n + m) for (b, n), (_, m) in zip(self.buckets, other.buckets)), self.total + other.total)

    def quantile(self, q: float) -> float | None:
        """histogram_quantile(q): linear within the bucket that holds the rank; the highest finite bound when the
        rank falls in +Inf; None without observations."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = bound, cumulative
        return lower


@dataclass(frozen=True)
class RouterReading:
    """One router's /metrics at one read: the histograms per (name, revision, mode), the prefix counters per backend."""

    histograms: Mapping[tuple[str, str, str], Histogram] = field(default_factory=dict)
    prompt_tokens: Mapping[str, float] = field(default_factory=dict)  # backend key -> total
    expected_hit_tokens: Mapping[str, float] = field(default_factory=dict)


def parse_router_metrics(text: str) -> RouterReading:
    """A router's /metrics text -> :class:`RouterReading` (other series are skipped)."""
    buckets: dict[tuple[str, str, str], dict[float, float]] = {}
    sums: dict[tuple[str, str, str], float] = {}
    counters: dict[str, dict[str, float]] = {PROMPT_TOKENS: {}, EXPECTED_HIT_TOKENS: {}}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in HISTOGRAMS:
                for s in family.samples:
                    key = (family.name, s.labels.get("revision", ""), s.labels.get("mode", ""))
                    if s.name.endswith("_bucket"):
                        buckets.setdefault(key, {})[float(s.labels["le"])] = s.value
                    elif s.name.endswith("_sum"):
                        sums[key] = s.value
            elif family.name in counters:
                for s in family.samples:
                    if s.name.endswith("_total"):
                        counters[family.name][s.labels.get("backend", "")] = s.value
    except (ValueError, KeyError) as error:
        raise ReadingError(f"not Prometheus text: {error}") from None
    return RouterReading({k: Histogram(tuple(sorted(v.items())), sums.get(k, 0.0)) for k, v in buckets.items()},
                         counters[PROMPT_TOKENS], counters[EXPECTED_HIT_TOKENS])  # fmt: skip


@dataclass(frozen=True)
class Interval:
    """What the routers saw of one revision between two reads."""

    ttft: Histogram = field(default_factory=Histogram)  # every request's
    prefill_leg: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    uncached_prompt_tokens: float = 0.0
    local_ttft: Histogram = field(default_factory=Histogram)  # of the requests decode prefilled itself

    @property
    def requests(self) -> int:
        return int(self.ttft.count)

    def plus(self, other: "Interval") -> "Interval":
        return Interval(self.ttft.plus(other.ttft), self.prefill_leg.plus(other.prefill_leg), self.tpot.plus(other.tpot),
                        self.uncached_prompt_tokens + other.uncached_prompt_tokens, self.local_ttft.plus(other.local_ttft))  # fmt: skip


def _counter_delta(now: Mapping[str, float], before: Mapping[str, float], keys: Iterable[str]) -> float:
    total = 0.0
    for k in keys:
        n, b = now.get(k, 0.0), before.get(k, 0.0)
        total += n - b if n >= b else n  # a counter that went back: the router restarted
    return total


def interval(before: RouterReading | None, now: RouterReading, revision: str, backends: Iterable[str]) -> Interval:
    """One router's interval of `revision` (its prefill `backends`: their keys), from the read `before` (None:
    this router's first read, which only sets the start) to `now`."""
    if before is None:
        return Interval()
    keys = list(backends)

    def hist(name: str, mode: str | None = None) -> Histogram:
        """The revision's series of `name` over the interval, every path's added up (or only `mode`'s); each
        series less its own earlier read."""
        out = Histogram()
        for key, h in now.histograms.items():
            if key[:2] == (name, revision) and mode in (None, key[2]):
                out = out.plus(h.minus(before.histograms.get(key, Histogram())))
        return out

    uncached = _counter_delta(now.prompt_tokens, before.prompt_tokens, keys) - _counter_delta(
        now.expected_hit_tokens, before.expected_hit_tokens, keys)  # fmt: skip
    return Interval(hist(TTFT), hist(PREFILL_LEG), hist(TPOT), max(uncached, 0.0), hist(TTFT, LOCAL))
