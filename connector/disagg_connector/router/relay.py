"""The decode's answer to the client: a whole body as it is, or a stream event by event as it comes, never
stalling longer than the leg deadline between chunks (:class:`StallTimer`).

After the first byte nothing can be retried, but a stream can be continued: when the decode's stream breaks,
stalls or ends in the engine's own error event, and the request allows it (:mod:`migration`), the relay asks the
dispatcher for a continuation on another pair (``Migration.reopen``) and splices it into the client's stream, at
most ``limit`` times per request. A stream that cannot be continued ends with an error event that says why and no
``data: [DONE]``, so that no client takes the truncated answer for a whole one. The prefill leg is cancelled
before the decode's connection is closed (:func:`legs.abort_legs`). Without migration (``--max-migrations 0``)
the stream is relayed byte for byte, and ends the same way when it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from disagg_connector.contract.vllm_pd import SSE_DONE, SSE_ERROR, sse_error_message
from disagg_connector.router.discovery import Backend
from disagg_connector.router.legs import DecodeAnswer, LegFailure, Timeline, abort_legs
from disagg_connector.router.migration import (
    COMPLETE, EXHAUSTED, FAILED, MIGRATED, OFF, REFUSALS, REFUSED, Trail, continuation_body, end_event, wants_usage,
)
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


# Tells a client whose stream waits for a pair to continue on that it is still there (an SSE comment).
Keepalive = Callable[[], Awaitable[None]]
# Opens a continuation: the failed attempt, the continuation's /v1/completions body, the stack that holds the
# continuation's decode count and response until the relay ends, and the client's keepalive while it waits for a
# pair. Raises LegFailure when no pair takes it.
Reopen = Callable[[Opened, dict[str, Any], contextlib.ExitStack, Keepalive], Awaitable[Opened]]
# SSE comment lines are ignored by clients (the SSE spec; OpenAI's SDK): they only keep the connection busy.
KEEPALIVE_EVENT = b": waiting for an engine to continue this stream\n\n"


@dataclass
class Migration:
    """What the relay needs to continue one request's stream elsewhere."""

    kind: str  # "completions" | "chat"
    body: dict[str, Any]  # the client's
    limit: int  # continuations allowed (maxMigrations)
    refused: str | None  # a key of migration.REFUSALS known from the request itself
    reopen: Reopen


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


class _Passthrough:
    """The bytes of a stream relayed as they come (no migration): only an engine's ``[DONE]`` after its own
    error event is held back, so that a failed stream never ends like a whole one."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.done = False
        self.events = 0

    def feed(self, chunk: bytes) -> bytes:
        if self.error is None and SSE_ERROR in chunk:
            at = chunk.index(SSE_ERROR)
            self.error = sse_error_message(chunk[at:])
            return chunk[:at]
        if self.error is not None:
            return b""  # the engine's error event and its [DONE]: the relay ends this stream
        self.events += chunk.count(b"\n\n")  # JSON escapes newlines: a blank line only ends an event
        self.done = chunk.endswith(SSE_DONE)
        return chunk


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

    async def answer(self, request: web.Request, t0: float, o: Opened, migration: Migration | None = None) -> web.StreamResponse:
        """Relay ``o`` to the client of ``request`` (which arrived at ``t0``). Closes the decode's response."""
        headers = {"Content-Type": o.answer.content_type, "X-Request-Id": o.xid}
        timing = o.timeline.server_timing(t0)
        if timing:
            headers["Server-Timing"] = timing
        if o.answer.resp is None:
            self._answered(o)
            await abort_legs(o.prefill_task)
            return web.Response(status=o.answer.status, body=o.answer.data, headers=headers)
        headers["Cache-Control"] = "no-cache"
        out = web.StreamResponse(status=o.answer.status, headers=headers)
        await out.prepare(request)
        reader: Trail | _Passthrough = (
            Trail(migration.kind, bool(migration.body.get("return_token_ids")), wants_usage(migration.body))
            if migration and not migration.refused else _Passthrough()
        )
        with contextlib.ExitStack() as continuations:
            try:
                return await self._stream(out, o, reader, migration, continuations, t0)
            except ConnectionError:  # the client went away while we wrote to it
                raise asyncio.CancelledError() from None

    async def _stream(
        self, out: web.StreamResponse, o: Opened, reader: Trail | _Passthrough, migration: Migration | None,
        continuations: contextlib.ExitStack, t0: float,
    ) -> web.StreamResponse:
        try:
            await out.write(reader.feed(o.answer.data))
            first = time.monotonic()
            self.outcomes.first_chunk(o.revision, o.flow, first - t0)
            migrated = 0
            last_write = first
            while True:
                cause, last_write = await self._pass(out, o, reader, last_write)
                if cause is None:
                    break
                # The decode failed mid-stream: its prefill leg and response are done with, whatever comes next.
                await self._close(o, finished=False)
                ended = await self._after_failure(out, o, reader, migration, cause, migrated, continuations)
                if not isinstance(ended, Opened):
                    await out.write(ended)
                    with contextlib.suppress(ConnectionError):
                        await out.write_eof()
                    return out
                migrated += 1
                self.outcomes.migration_gap(ended.revision, ended.flow, time.monotonic() - last_write)
                o = ended
        except BaseException:
            await self._close(o, finished=False)
            raise
        self._answered(o)
        tokens = reader.events - (not isinstance(reader, Trail) and reader.done)  # [DONE] carries no token
        if tokens > 0:
            self.outcomes.per_token(o.revision, o.flow, (time.monotonic() - first) / tokens)
        await self._close(o, finished=True)
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out

    async def _pass(self, out: web.StreamResponse, o: Opened, reader: Trail | _Passthrough, last_write: float) -> tuple[str | None, float]:
        """Relay ``o``'s stream until it ends: None when it ended whole, else the cause of its failure; and when
        the client was last written to (the gap a continuation adds is counted from there)."""
        resp = o.answer.resp
        assert resp is not None
        stall = StallTimer(self.stall_limit)
        try:
            while True:
                try:
                    with stall:
                        chunk = await resp.content.readany()
                except (TimeoutError, aiohttp.ClientError) as e:
                    cause = "decode_stall" if isinstance(e, TimeoutError) else "decode_stream_broken"
                    log.warning("decode stream %s from %s ended abnormally: %s", o.xid, o.decode.key, cause)
                    if cause == "decode_stream_broken":
                        self.ejections.suspect(o.decode.key)
                    return cause, last_write
                if not chunk:  # the engine closed its stream before [DONE]
                    log.warning("decode stream %s from %s closed before [DONE]", o.xid, o.decode.key)
                    if isinstance(reader, Trail) and reader.finished:  # after every token: the answer is whole
                        await out.write(reader.closing())
                        return None, last_write
                    return "decode_stream_broken", last_write
                data = reader.feed(chunk)
                if data:
                    await out.write(data)
                    last_write = time.monotonic()
                if reader.error is not None:
                    log.warning("decode %s ended stream %s with its own error: %s", o.decode.key, o.xid, reader.error)
                    self.ejections.suspect(o.decode.key)
                    return "decode_stream_broken", last_write
                if reader.done:
                    # The client has the whole answer and may hang up now: not waiting for the engine to
                    # close its stream keeps such a client from counting as a disconnect (499).
                    return None, last_write
        finally:
            stall.close()

    async def _after_failure(
        self, out: web.StreamResponse, o: Opened, reader: Trail | _Passthrough, migration: Migration | None, cause: str,
        migrated: int, continuations: contextlib.ExitStack,
    ) -> Opened | bytes:
        """After ``o``'s stream failed with ``cause``: a continuation that has begun, or the stream's last bytes."""
        self.outcomes.failed(o.revision, o.flow, cause)

        def ended(outcome: str, last: bytes) -> bytes:
            self.outcomes.migration(o.revision, o.decode.pod, cause, outcome)
            return last

        if migration is None:
            return ended(OFF, end_event(cause, "stream migration is off (spec.router.migration)"))
        if not isinstance(reader, Trail):  # refused up front: relayed byte for byte
            assert migration.refused is not None
            return ended(REFUSED, end_event(cause, f"it cannot be continued on another engine: {REFUSALS[migration.refused]}"))
        if reader.finished:
            # Every token was out (a finish_reason came) before the decode failed: the answer is whole.
            return ended(COMPLETE, reader.closing())
        refused = reader.why_not()
        if refused is not None:
            log.warning("stream %s not continued after %s: %s", o.xid, cause, REFUSALS[refused])
            return ended(REFUSED, end_event(cause, f"it cannot be continued on another engine: {REFUSALS[refused]}"))
        if migrated >= migration.limit:
            return ended(EXHAUSTED, end_event(cause, f"it was already continued {migrated} time(s), the most spec.router.migration allows"))
        body = continuation_body(migration.kind, migration.body, reader)
        if body is None:  # every token max_tokens allows is out: the answer is whole
            return ended(COMPLETE, reader.closing())
        with contextlib.ExitStack() as attempt:
            try:
                opened = await migration.reopen(o, body, attempt, lambda: out.write(KEEPALIVE_EVENT))
            except LegFailure as f:
                log.warning("stream %s not continued after %s: %s (%s)", o.xid, cause, f, f.cause)
                return ended(FAILED, end_event(cause, f"no other pair took its continuation ({f})"))
            continuation = attempt.pop_all()
        self.outcomes.migration(o.revision, o.decode.pod, cause, MIGRATED)
        log.warning(
            "stream %s continued as %s on %s after %s of %s (%d tokens sent)", o.xid, opened.xid, opened.decode.key, cause,
            o.decode.key, len(reader.generated),
        )  # fmt: skip
        continuations.enter_context(continuation)  # its decode count and response, until the relay ends
        reader.continue_here()
        await out.write(reader.feed(opened.answer.data))
        return opened

    async def _close(self, o: Opened, finished: bool) -> None:
        """Cancel ``o``'s prefill leg first, then release (whole) or close (failed: vLLM's abort) its decode's."""
        await abort_legs(o.prefill_task, decode_follows=not finished)
        o.prefill_task = None
        resp = o.answer.resp
        assert resp is not None
        if finished:
            resp.release()  # the connection goes back to the pool
        elif not resp.closed:
            resp.close()
