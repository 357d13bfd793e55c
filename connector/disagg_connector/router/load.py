"""Each engine's load and prefix-cache counters, read from vLLM's own ``/metrics``, so that every router
replica sees the same numbers (a router's own in-flight count sees only its own traffic).

- **What is read**, per engine core (vLLM labels its series ``engine="<global DP rank>"``):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and its ``reason="capacity"`` part of
  ``vllm:num_requests_waiting_by_reason`` (requests queued for room; the rest wait on their remote KV, which
  a decode asked at once with its prefill always does for a while), ``vllm:kv_cache_usage_perc``,
  ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (tokens), and the KV cache's size
  from ``vllm:cache_config_info`` (labels ``block_size``, ``num_gpu_blocks``). Only those lines are parsed
  (with prometheus_client's parser, :func:`vllm_metrics.read_samples`): a vLLM ``/metrics`` page is mostly histograms, tens of kB.
- **A backend's load** is what its engine said at the last read (running + waiting, those waiting on their KV
  included: they run there next) less this router's legs in
  flight there when the read began (what other routers and clients brought), plus this router's legs in flight now,
  which it knows exactly: between two reads the router's own traffic is the only news, and a read taken during a
  burst that has since finished does not make the engine look busy (on the H200, 16 streams that had just ended on
  one decode sent the next 16 all to the other). A read older than :data:`STALE_READS` intervals counts as none, and
  the load is then this router's in-flight count alone, as with ``least-outstanding``. A decode backend (a pod)
  sums its engine cores; a prefill backend is one core.
- **A restart** shows as a counter that went backwards: :meth:`LoadBoard.restarted` tells the prefix index to
  forget what it believed that engine cached.

:class:`LoadBoard` is pure state (tests feed it text); :class:`LoadScraper` is the asyncio task that reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import aiohttp

from disagg_connector.vllm_metrics import (
    CACHE_CONFIG_INFO, KV_USAGE, PREFIX_HITS, PREFIX_QUERIES, RUNNING, WAITING, WAITING_BY_REASON, WAITING_FOR_CAPACITY, read_samples,
)  # fmt: skip
from disagg_connector.router.discovery import Backend

log = logging.getLogger("disagg_router.load")

_READ = (RUNNING, WAITING, WAITING_BY_REASON, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS)
# A read this many intervals old is no longer the engine's state.
STALE_READS = 3


@dataclass(frozen=True)
class EngineCounters:
    """One engine core at one read."""

    running: float = 0.0
    waiting: float = 0.0  # every request waiting: for room, and for its remote KV
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    cache_tokens: int | None = None  # block_size x num_gpu_blocks, when vLLM says
    waiting_for_capacity: float | None = None  # of ``waiting``, those queued for room (reason "capacity"), when vLLM says

    @property
    def queued(self) -> float:
        """Requests waiting for room in the engine: what says it is short of capacity (all waiting where vLLM does
        not split them by reason)."""
        return self.waiting if self.waiting_for_capacity is None else self.waiting_for_capacity


def parse_engine_metrics(text: str | bytes) -> dict[str, EngineCounters]:
    """``/metrics`` text -> counters per ``engine`` label. Lines of other series are skipped unparsed."""
    values: dict[str, dict[str, float]] = defaultdict(dict)
    cache: dict[str, int] = {}
    for s in read_samples(text, (*_READ, CACHE_CONFIG_INFO), only_their_lines=True):
        if s.name == CACHE_CONFIG_INFO:
            try:
                cache[s.engine] = int(s.labels["block_size"]) * int(s.labels["num_gpu_blocks"])
            except (KeyError, ValueError):
                pass
        elif s.name == WAITING_BY_REASON:
            if s.labels.get("reason") == WAITING_FOR_CAPACITY:
                values[s.engine][WAITING_FOR_CAPACITY] = values[s.engine].get(WAITING_FOR_CAPACITY, 0.0) + s.value
        else:
            values[s.engine][s.name] = values[s.engine].get(s.name, 0.0) + s.value
    return {
        engine: EngineCounters(
            v.get(RUNNING, 0.0), v.get(WAITING, 0.0), v.get(KV_USAGE, 0.0), v.get(PREFIX_QUERIES, 0.0), v.get(PREFIX_HITS, 0.0),
            cache.get(engine), v.get(WAITING_FOR_CAPACITY),
        )
        for engine, v in values.items()
    }


@dataclass(frozen=True)
class Reading:
    counters: EngineCounters
    at: float  # monotonic
    inflight_before: int  # this router's legs in flight on the backend when the read began


class LoadBoard:
    """The last reading of every backend, and this router's legs in flight there when it was taken. Pure state."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self.readings: dict[str, Reading] = {}
        self.restarts: dict[str, int] = defaultdict(int)  # per backend key: engine restarts seen
        self.on_restart: Callable[[str], None] = lambda key: None

    def record(self, b: Backend, engines: dict[str, EngineCounters], inflight_before: int) -> None:
        """A read of ``b``'s pod: its own core's counters (a prefill rank) or its cores summed (a decode pod)."""
        if b.role == "prefill" and b.dp_size > 1:
            mine = [engines[str(b.identity.dp_rank)]] if str(b.identity.dp_rank) in engines else []
        else:
            mine = list(engines.values())
        if not mine:
            return
        sizes = [e.cache_tokens for e in mine if e.cache_tokens is not None]
        now = EngineCounters(
            sum(e.running for e in mine), sum(e.waiting for e in mine), max(e.kv_usage for e in mine),
            sum(e.prefix_queries for e in mine), sum(e.prefix_hits for e in mine), sum(sizes) if sizes else None,
            sum(e.queued for e in mine),
        )  # fmt: skip
        before = self.readings.get(b.key)
        if before is not None and now.prefix_queries < before.counters.prefix_queries:
            self.restarts[b.key] += 1
            self.on_restart(b.key)
        self.readings[b.key] = Reading(now, self.clock(), inflight_before)

    def fresh(self, key: str, now: float | None = None) -> Reading | None:
        r = self.readings.get(key)
        if r is None or self.interval <= 0 or (self.clock() if now is None else now) - r.at > STALE_READS * self.interval:
            return None
        return r

    def load(self, key: str, inflight: int) -> float:
        """Requests ahead of a new one on this backend: the engine's running + waiting at the last fresh read less
        this router's legs in flight then, plus this router's ``inflight`` now; without a fresh read, ``inflight``."""
        return self._ahead(key, self.fresh(key), inflight)

    def loads(self, keys: Iterable[str], inflight: Mapping[str, int]) -> tuple[dict[str, float], bool]:
        """:meth:`load` of each of ``keys`` (``inflight``: this router's legs per key) at one look at the clock, and
        whether any of them had a fresh read: what a pick asks, in one pass."""
        now = self.clock()
        out: dict[str, float] = {}
        any_fresh = False
        for key in keys:
            r = self.fresh(key, now)
            any_fresh = any_fresh or r is not None
            out[key] = self._ahead(key, r, inflight.get(key, 0))
        return out, any_fresh

    def _ahead(self, key: str, r: Reading | None, inflight: int) -> float:
        if r is None:
            return float(inflight)
        # The others' requests as the engine counted them, and this router's own as it knows them now: its legs that
        # finished since the read are no load any more, those sent since are.
        return max(0.0, r.counters.running + r.counters.waiting - r.inflight_before) + inflight

    def cache_tokens(self, key: str) -> int | None:
        r = self.readings.get(key)
        return r.counters.cache_tokens if r is not None else None

    def forget(self, keep: set[str]) -> None:
        for key in [k for k in self.readings if k not in keep]:
            del self.readings[key]


class LoadScraper:
    """Reads every backend's pod ``/metrics`` each ``interval`` (one GET per pod, its ranks share it), and tells
    ``on_backends`` which backends are current, so that what is kept of those that left goes (with reads off too)."""

    PRUNE_SECONDS = 5.0  # how often the backends are pruned when reads are off

    def __init__(
        self, session: Callable[[], aiohttp.ClientSession], backends: Callable[[], Iterable[Backend]], board: LoadBoard,
        inflight: Mapping[str, int],
    ) -> None:
        self.session, self.backends, self.board = session, backends, board
        self.inflight = inflight  # this router's legs in flight per backend key (the balancer's, live)
        self.on_read: Callable[[bool], None] = lambda ok: None  # each pod's read, whether it answered
        self.on_backends: Callable[[set[str]], None] = lambda keep: None
        self._task: asyncio.Task[None] | None = None

    async def read_once(self) -> None:
        by_pod: dict[str, list[Backend]] = defaultdict(list)
        for b in self.backends():
            by_pod[b.base_url].append(b)
        keep = {b.key for bs in by_pod.values() for b in bs}
        self.board.forget(keep)
        self.on_backends(keep)
        if self.board.interval > 0:
            await asyncio.gather(*(self._read(url, bs) for url, bs in by_pod.items()))

    async def _read(self, url: str, backends: list[Backend]) -> None:
        inflight_before = {b.key: self.inflight.get(b.key, 0) for b in backends}
        try:
            timeout = aiohttp.ClientTimeout(total=max(self.board.interval, 0.5))
            async with self.session().get(url + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                engines = parse_engine_metrics(await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            # An engine that does not answer keeps its last reading until it goes stale: the probe ejects it if dead.
            self.on_read(False)
            log.debug("reading %s/metrics failed: %s", url, e)
            return
        self.on_read(True)
        for b in backends:
            self.board.record(b, engines, inflight_before[b.key])

    async def _run(self) -> None:
        period = self.board.interval if self.board.interval > 0 else self.PRUNE_SECONDS
        while True:
            started = time.monotonic()
            try:
                await self.read_once()
            except Exception:  # noqa: BLE001 - a bug here must not stop the reads for good
                log.exception("reading the engines' load failed")
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))  # the read period, not a wait for an event

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="load-scraper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
