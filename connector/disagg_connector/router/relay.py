"""The decode's answer to the client: a whole body as it is, or a stream byte for byte, each chunk as it
comes, never stalling longer than the leg deadline between chunks (:class:`StallTimer`). After the first
byte nothing can be retried: a stream that breaks, stalls or carries the engine's own error event ends
with an SSE error event and ``data: [DONE]``, as vLLM ends a failed stream. The prefill leg is cancelled
before the decode's connection is closed (:func:`legs.abort_legs`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from disagg_connector.contract.vllm_pd import SSE_DONE, SSE_ERROR, sse_error
from disagg_connector.router.discovery import Backend
from disagg_connector.router.legs import DecodeAnswer, LegFailure, Timeline, abort_legs
from disagg_connector.router.outcomes import OutcomeRecorder
from disagg_connector.router.pairing import Ejections

log = logging.getLogger("disagg_router.relay")


@dataclass
class Opened:
    """An attempt whose decode answer has begun: what the relay passes on, and the prefill leg it may
    still have to cancel (push: the decode can answer before P's leg ends)."""

    xid: str
    revision: str
    flow: str  # "push" | "pull" | "local"
    decode: Backend
    answer: DecodeAnswer
    timeline: Timeline
    prefill_task: asyncio.Task[Any] | None = None


class StallTimer:
    """The longest wait for the next chunk of a stream: ``with timer: await read()`` raises TimeoutError
    once the reads of one stream have waited ``limit`` seconds with nothing coming. One timer per
    ``limit`` seconds rather than one per chunk (a per-read ``asyncio.timeout`` was a measurable part of
    the relay's cost): it re-arms itself for the rest when a chunk came meanwhile."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.last = self.loop.time()
        self.waiting = False
        self.fired = False
        self.handle = self.loop.call_later(limit, self._check)

    def _check(self) -> None:
        idle = self.loop.time() - self.last
        if self.waiting and idle >= self.limit:
            self.fired = True
            assert self.task is not None
            self.task.cancel()
        else:
            self.handle = self.loop.call_later(max(self.limit - idle, 0.001) if self.waiting else self.limit, self._check)

    def __enter__(self) -> None:
        self.waiting, self.last = True, self.loop.time()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.waiting = False
        if exc_type is asyncio.CancelledError and self.fired:
            assert self.task is not None
            self.task.uncancel()
            self.fired = False
            raise TimeoutError(f"no chunk for {self.limit:g}s")
        return False

    def close(self) -> None:
        self.handle.cancel()


class Relay:
    def __init__(self, outcomes: OutcomeRecorder, ejections: Ejections, stall_limit: float) -> None:
        self.outcomes, self.ejections, self.stall_limit = outcomes, ejections, stall_limit

    def _answered(self, o: Opened) -> None:
        p = o.prefill_task
        failure = p.exception() if p is not None and p.done() and not p.cancelled() else None
        cause = failure.cause if isinstance(failure, LegFailure) and o.flow != "local" else None
        if cause is not None:
            log.warning("request %s answered, but its prefill leg failed: %s (%s)", o.xid, failure, cause)
        self.outcomes.answered(o.revision, o.flow, o.timeline, cause)

    async def answer(self, request: web.Request, t0: float, o: Opened) -> web.StreamResponse:
        """Relay ``o`` to the client of ``request`` (which arrived at ``t0``). Closes the decode's response."""
        headers = {"Content-Type": o.answer.content_type, "X-Request-Id": o.xid}
        timing = o.timeline.server_timing(t0)
        if timing:
            headers["Server-Timing"] = timing
        resp = o.answer.resp
        if resp is None:
            self._answered(o)
            await abort_legs(o.prefill_task)
            return web.Response(status=o.answer.status, body=o.answer.data, headers=headers)
        finished = False
        try:
            headers["Cache-Control"] = "no-cache"
            out = web.StreamResponse(status=o.answer.status, headers=headers)
            await out.prepare(request)
            await out.write(o.answer.data)
            first = time.monotonic()
            self.outcomes.first_chunk(o.revision, o.flow, first - t0)
            events, last = 0, b""  # SSE events after the first chunk (one token each), for the TPOT
            engine_error = False
            stall = StallTimer(self.stall_limit)
            try:
                while True:
                    try:
                        with stall:
                            chunk = await resp.content.readany()
                    except (TimeoutError, aiohttp.ClientError) as e:
                        cause = "decode_stall" if isinstance(e, TimeoutError) else "decode_stream_broken"
                        self.outcomes.failed(o.revision, o.flow, cause)
                        log.warning("decode stream from %s ended abnormally: %s", o.decode.key, cause)
                        if cause == "decode_stream_broken":
                            self.ejections.suspect(o.decode.key)
                        await out.write(sse_error(502, f"decode engine stream failed ({cause})"))
                        break
                    if not chunk:
                        finished = True
                        break
                    engine_error = engine_error or SSE_ERROR in chunk
                    events += chunk.count(b"\n\n")  # JSON escapes newlines: a blank line only ends an event
                    last = chunk
                    await out.write(chunk)
                    if chunk.endswith(SSE_DONE):
                        # The client has the whole answer and may hang up now: not waiting for the engine to
                        # close its stream keeps such a client from counting as a disconnect (499).
                        finished = True
                        break
            finally:
                stall.close()
            if finished and engine_error:  # the engine ended the stream with its own error event
                finished = False
                self.outcomes.failed(o.revision, o.flow, "decode_stream_broken")
            elif finished:
                self._answered(o)
                tokens = events - last.endswith(SSE_DONE)  # [DONE] carries no token
                if tokens > 0:
                    self.outcomes.per_token(o.revision, o.flow, (time.monotonic() - first) / tokens)
            try:
                await out.write_eof()
            except ConnectionError:
                if not finished:
                    raise
            return out
        except ConnectionError:  # the client went away while we wrote to it
            raise asyncio.CancelledError() from None
        finally:
            await abort_legs(o.prefill_task, decode_follows=not finished)  # prefill first, then the decode
            if finished:
                resp.release()  # the connection goes back to the pool
            else:
                resp.close()
