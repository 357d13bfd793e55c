"""Health probes of the backends (the I/O behind :class:`pairing.Ejections`).

``GET /health`` of vLLM's API server answers 200 while its engine runs and 503 once the engine is dead
(``vllm/entrypoints/serve/instrumentator/health.py``); shortly after, the API server exits and the port
closes. So a probe passes on 200 only. Probed: ejected and suspect backends when they are due, and every
backend of the table every ``interval`` seconds (0: only the ejected and suspect ones). One probe per
engine URL covers all its data-parallel ranks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp

from disagg_connector.router.discovery import Backend, EndpointTable
from disagg_connector.router.pairing import Ejections

log = logging.getLogger("disagg_router.probe")
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


class Prober:
    def __init__(
        self, session: Callable[[], aiohttp.ClientSession], table: EndpointTable, ejections: Ejections, interval: float
    ) -> None:
        self.session, self.table, self.ejections, self.interval = session, table, ejections, interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        ejections.listeners.append(self._wake.set)

    async def _probe(self, url: str) -> bool:
        try:
            async with self.session().get(url + "/health", timeout=PROBE_TIMEOUT) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False

    async def probe(self, backends: list[Backend]) -> None:
        by_url: dict[str, list[Backend]] = {}
        for b in backends:
            by_url.setdefault(b.base_url, []).append(b)
        results = await asyncio.gather(*(self._probe(url) for url in by_url))
        for (url, group), ok in zip(by_url.items(), results):
            for b in group:
                was = b.key in self.ejections
                self.ejections.probed(b.key, ok)
                if was != (b.key in self.ejections):
                    log.warning("backend %s (%s) %s", b.key, url, "re-admitted" if ok else "ejected: health probe failed")

    async def _run(self) -> None:
        clock = self.ejections.clock
        next_sweep = clock() + self.interval if self.interval else None
        while True:
            backends = {b.key: b for b in self.table.snapshot().backends()}
            self.ejections.forget(set(backends))
            keys = set(self.ejections.due())
            if next_sweep is not None and clock() >= next_sweep:
                keys |= set(backends)
                next_sweep = clock() + self.interval
            if keys:
                await self.probe([backends[k] for k in sorted(keys) if k in backends])
            wake_at = [t for t in (next_sweep, self.ejections.next_due()) if t is not None]
            self._wake.clear()
            timeout = max(0.0, min(wake_at) - clock()) if wake_at else None
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
