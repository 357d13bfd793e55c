"""Dispatch of one client request to a prefill/decode pair (vLLM's P/D protocol; docs/router.md).

**Ids.** Every dispatch (every retry too) mints a fresh ``X-Request-Id``, identical on both legs (vLLM 0.26.0
and 0.33.0 match push legs on the request id), and a fresh ``transfer_id`` in both legs' ``kv_transfer_params``
(vLLM main matches on it; released versions ignore it). In pull, the decode leg carries P's answer verbatim
with the ``transfer_id`` added unless P echoed one.

**Per revision.** The revision (chosen in proportion to its ready pairs, see ``pairing``) decides the protocol
from its pods' transfer-mode annotation:

- Push (``NixlPushConnector``): pick P and D up front (least outstanding), send both legs *concurrently*;
  the decode leg carries P's identity (:meth:`EngineIdentity.push_decode_params`) so D registers its blocks
  with P while P is still prefilling. ``remote_request_id`` is ``cmpl-<id>-0`` / ``chatcmpl-<id>``: P's
  internal id without its random suffix.
- Pull (``NixlConnector``): prefill leg (``do_remote_decode``, max tokens 1, not streamed), then a decode
  chosen by load *after* the prefill, within P's revision, with P's ``kv_transfer_params``.
- ``--mode push-sequential`` (a benchmark baseline, as vLLM's 0.33-era demo proxy dispatches): push
  revisions' legs one after the other, the decode chosen after the prefill, with P's own request id.
- A prompt shorter than ``--disaggregation-threshold-tokens`` goes to a decode engine alone (no
  ``kv_transfer_params``): it prefills locally, which costs less than a transfer for short prompts.

A prefill answer whose ``transfer_mode`` (vLLM 0.33.0 returns it) differs from the revision's is a
``protocol_mismatch``: the decode leg would wait for a KV that never comes, or read it the wrong way.

**Deadlines.** The prefill leg must answer within ``leg_timeout``. The decode leg must produce its first body
chunk within ``leg_timeout`` when streaming (vLLM sends the first chunk after the first token, i.e. after the
KV arrived: this is the KV-wait deadline), and then never stall longer than ``leg_timeout`` between chunks;
a non-streaming decode leg is bounded by ``request_timeout``. ``leg_timeout`` stays below the KV lease.

**Failures** (the contract; causes in :mod:`health`). On any failure, deadline or client disconnect the
prefill leg is cancelled first, then the decode leg (closing a connection is vLLM's abort; a decode aborted
while its prefill still runs is where a late push would write into freed blocks, vLLM #48633 C1). While
nothing has reached the client, the request is retried, at most ``max_retries`` times, with fresh ids on a
pair that avoids every backend blamed for an earlier attempt (no retry ever goes back into the decode that
just failed or timed out); when no such pair exists the request fails at once with the failure it has.
Statuses: 503 when no pair is ready; 502 when an engine fails before the decode's first byte; 504 when a leg
or the KV wait passes its deadline; engine 4xx answers passed through as they are; after the first byte, an
SSE error event (then ``data: [DONE]``, as vLLM ends a failed stream) and the end of the stream. An engine
that answers 503 or drops its connection is ejected and re-probed (see ``pairing.Ejections``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp
import orjson
from aiohttp import web

from disagg_connector import contract
from disagg_connector.contract.vllm_pd import DP_RANK_HEADER, engine_request_id, mint_ids, prefill_body
from disagg_connector.router.config import RouterConfig
from disagg_connector.router.discovery import Backend, EndpointTable, RevisionView
from disagg_connector.router.metrics import RouterMetrics
from disagg_connector.router.pairing import Balancer
from disagg_connector.router.stats import RouterStats

log = logging.getLogger("disagg_router.dispatch")

# llm-d's prefix decider estimates prompt tokens as bytes / 4 (AverageCharactersPerToken).
BYTES_PER_TOKEN = 4
_ERROR_STATUS_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
PREFILL_ABORT_SETTLE_SECONDS = 0.05
_SSE_ERROR = b'data: {"error"'
_SSE_DONE = b"data: [DONE]\n\n"


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict[str, Any]:
    """The error body of vLLM's OpenAI server (and OpenAI's): {"error": {message, type, param, code}}."""
    return {"error": {"message": message, "type": err_type or _ERROR_STATUS_TYPES.get(status, "Error"), "param": param, "code": status}}


def openai_error(status: int, message: str, param: str | None = None, err_type: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param, err_type), status=status)


def sse_error(status: int, message: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n" + _SSE_DONE


def _text_tokens(value: Any) -> int:
    if isinstance(value, str):
        return math.ceil(len(value.encode()) / BYTES_PER_TOKEN)
    if isinstance(value, list):
        if value and all(isinstance(x, int) for x in value):
            return len(value)  # token ids: exact
        return sum(_text_tokens(v) for v in value)
    if isinstance(value, dict):  # a chat content part
        return _text_tokens(value.get("text"))
    return 0


def estimate_prompt_tokens(kind: str, body: dict[str, Any]) -> int:
    """Prompt length in tokens without a tokenizer: exact for token ids, bytes / 4 for text."""
    if kind == "completions":
        return _text_tokens(body.get("prompt"))
    messages = body.get("messages")
    return sum(_text_tokens(m.get("content")) for m in messages if isinstance(m, dict)) if isinstance(messages, list) else 0


class LegFailure(Exception):
    """A leg (or the attempt) failed before anything reached the client."""

    def __init__(
        self,
        cause: str,
        message: str,
        status: int = 502,
        blamed: tuple[Backend, ...] = (),
        retryable: bool = True,
        passthrough: tuple[int, bytes, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.cause, self.status, self.blamed = cause, status, blamed
        self.retryable, self.passthrough = retryable, passthrough


@dataclass
class RequestContext:
    request: web.Request
    kind: str  # "completions" | "chat"
    path: str
    body: dict[str, Any]
    stream: bool
    t0: float
    auth: str | None = None
    excluded: set[str] = field(default_factory=set)  # keys of backends blamed for an earlier attempt
    revision: str = ""  # of the current (last) attempt
    flow: str = ""  # of the current attempt: "push" | "pull" | "local"


@dataclass
class Timeline:
    """When the parts of one attempt happened (time.monotonic)."""

    start: float
    prefill_done: float | None = None
    decode_sent: float | None = None
    first_token: float | None = None

    @property
    def prefill(self) -> float | None:
        return None if self.prefill_done is None else self.prefill_done - self.start

    @property
    def kv_wait(self) -> float | None:
        """Decode's first token after both its leg started and the prefill finished."""
        if self.first_token is None or self.decode_sent is None or self.prefill_done is None:
            return None
        return max(0.0, self.first_token - max(self.decode_sent, self.prefill_done))

    def server_timing(self, t0: float) -> str:
        """Server-Timing header value, milliseconds (the parts known when the answer starts)."""
        parts = []
        if self.prefill is not None:
            parts.append(f"prefill;dur={self.prefill * 1e3:.1f}")
        if self.kv_wait is not None:
            parts.append(f"kv_wait;dur={self.kv_wait * 1e3:.1f}")
        if self.first_token is not None:
            parts.append(f"first_token;dur={(self.first_token - t0) * 1e3:.1f}")
        return ", ".join(parts)


@dataclass
class Opened:
    """A decode leg whose answer has begun: ``data`` is its first chunk (streaming) or its whole body."""

    xid: str
    revision: str
    flow: str  # "push" | "pull" | "local"
    decode: Backend
    status: int
    content_type: str
    data: bytes
    timeline: Timeline
    resp: aiohttp.ClientResponse | None = None
    prefill_task: asyncio.Task[Any] | None = None


class Dispatcher:
    def __init__(
        self, cfg: RouterConfig, table: EndpointTable, balancer: Balancer, metrics: RouterMetrics, stats: RouterStats
    ) -> None:
        self.cfg, self.table, self.balancer, self.metrics, self.stats = cfg, table, balancer, metrics, stats
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    def client(self) -> aiohttp.ClientSession:
        assert self.session is not None, "Dispatcher.start() first"
        return self.session

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # --- legs ---------------------------------------------------------------------------------------
    def _headers(self, ctx: RequestContext, xid: str, b: Backend, pin_rank: bool) -> dict[str, str]:
        h = {"Content-Type": "application/json", "X-Request-Id": xid, "Accept-Encoding": "identity"}
        if ctx.auth:
            h["Authorization"] = ctx.auth
        if pin_rank and b.dp_size > 1:
            h[DP_RANK_HEADER] = str(b.identity.dp_local_index)
        return h

    @contextlib.asynccontextmanager
    async def _leg(self, role: str, backend: Backend, deadline: float | None, timeout_cause: str) -> AsyncIterator[None]:
        """One leg's deadline (None: the attempt keeps it), and its transport errors turned into a
        LegFailure naming the engine."""
        try:
            async with asyncio.timeout(deadline):
                yield
        except TimeoutError:
            raise LegFailure(timeout_cause, f"{role} engine {backend.key} missed the {deadline:g}s deadline", 504, (backend,)) from None
        except aiohttp.ClientConnectionError as e:
            self.balancer.ejections.eject(backend.key)
            raise LegFailure(f"{role}_connection", f"{role} engine {backend.key} failed: {type(e).__name__}: {e}", 502, (backend,)) from None
        except aiohttp.ClientError as e:
            raise LegFailure(f"{role}_error" if role == "prefill" else "decode_failed", f"{role} engine {backend.key}: {e}", 502, (backend,)) from None

    def _engine_status(self, role: str, b: Backend, status: int, data: bytes, ctype: str) -> None:
        """A non-200 answer from an engine, before anything reached the client: a LegFailure."""
        if 400 <= status < 500:
            raise LegFailure(f"{role}_rejected", f"{role} engine rejected the request", status, (b,), False, (status, data, ctype))
        if status == 503:
            self.balancer.ejections.eject(b.key)
            raise LegFailure(f"{role}_unavailable", f"{role} engine {b.key} is unavailable (HTTP 503)", 502, (b,))
        self.balancer.ejections.suspect(b.key)
        raise LegFailure("prefill_error" if role == "prefill" else "decode_failed", f"{role} engine {b.key} answered HTTP {status}", 502, (b,))

    async def _prefill_leg(
        self, ctx: RequestContext, p: Backend, mode: str, xid: str, transfer_id: str, tl: Timeline, deadline: float | None
    ) -> dict[str, Any]:
        """The prefill leg to completion; returns P's JSON answer."""
        payload = orjson.dumps(prefill_body(ctx.kind, ctx.body, transfer_id))
        async with self._leg("prefill", p, deadline, "prefill_timeout"):
            resp = await self.client().post(p.base_url + ctx.path, data=payload, headers=self._headers(ctx, xid, p, True))
            try:
                data = await resp.read()
            except BaseException:
                resp.close()
                raise
        tl.prefill_done = time.monotonic()
        if resp.status != 200:
            self._engine_status("prefill", p, resp.status, data, resp.headers.get("Content-Type", "application/json"))
        try:
            answer = orjson.loads(data)
            if not isinstance(answer, dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise LegFailure("prefill_error", f"prefill engine {p.key} sent invalid JSON ({e})", 502, (p,)) from None
        returned = answer.get("kv_transfer_params")
        announced = returned.get("transfer_mode") if isinstance(returned, dict) else None
        if not isinstance(returned, dict) or (isinstance(announced, str) and announced.lower() != mode.lower()):
            what = f"transfer_mode {announced!r}" if isinstance(returned, dict) else "no kv_transfer_params (not a NIXL kv_producer?)"
            raise LegFailure(
                "protocol_mismatch",
                f"prefill engine {p.key} answered with {what}, but its revision {p.revision} is {mode}: "
                f"set the pods' {contract.ANNOTATION_TRANSFER_MODE} annotation to the connector the engines run",
                502,
                (p,),
            )
        return answer

    def _decode_deadline(self, ctx: RequestContext) -> tuple[float, str]:
        """Until the decode leg's first byte: the KV wait when streaming, the whole answer otherwise."""
        return (self.cfg.leg_timeout, "kv_wait_timeout") if ctx.stream else (self.cfg.request_timeout, "decode_timeout")

    async def _open_decode(
        self, ctx: RequestContext, d: Backend, xid: str, params: dict[str, Any] | None, tl: Timeline, own_deadline: bool = True
    ) -> tuple[int, str, bytes, aiohttp.ClientResponse | None]:
        """Send the decode leg and wait for its first chunk (streaming) or its whole answer.

        Holds one in-flight count on ``d`` while the response stays open (released by the relay)."""
        body = dict(ctx.body)
        if params is None:
            body.pop("kv_transfer_params", None)  # never let a client steer the engines' KV transfer
        else:
            body["kv_transfer_params"] = params
        payload = orjson.dumps(body)
        deadline, cause = self._decode_deadline(ctx)
        self.balancer.acquire(d)
        try:
            tl.decode_sent = time.monotonic()
            async with self._leg("decode", d, deadline if own_deadline else None, cause):
                resp = await self.client().post(d.base_url + ctx.path, data=payload, headers=self._headers(ctx, xid, d, False))
                ctype = resp.headers.get("Content-Type", "application/json")
                try:
                    if ctx.stream and resp.status == 200:
                        first = await resp.content.readany()
                        if not first or first.lstrip().startswith(_SSE_ERROR):
                            why = _sse_error_message(first) if first else "an empty stream"
                            self.balancer.ejections.suspect(d.key)
                            raise LegFailure("decode_failed", f"decode engine {d.key} failed the request before its first token: {why}", 502, (d,))
                        tl.first_token = time.monotonic()
                        return resp.status, ctype, first, resp
                    data = await resp.read()
                except BaseException:
                    resp.close()
                    raise
            if resp.status != 200:
                self._engine_status("decode", d, resp.status, data, ctype)
            tl.first_token = time.monotonic()
            self.balancer.release(d)
            return resp.status, ctype, data, None
        except BaseException:
            self.balancer.release(d)
            raise

    # --- attempts -----------------------------------------------------------------------------------
    def _no_pair(self) -> LegFailure:
        snap = self.table.snapshot()
        what = ", ".join(
            f"{r.revision}: {len(r.prefill)}P/{len(r.decode)}D" + (f" ({r.mode_conflict})" if r.mode_conflict else "")
            for r in snap.revisions
        )
        ejected = len(self.balancer.ejections)
        note = f"; {ejected} backend(s) ejected after failures, re-probing" if ejected else ""
        return LegFailure("no_backend", f"no revision has a ready prefill and decode engine pair ({what or 'none discovered'}{note})", 503, (), False)

    async def _attempt(self, ctx: RequestContext, local: bool, retry: bool) -> Opened:
        snap = self.table.snapshot()
        chosen = self.balancer.pick(snap, ctx.excluded)
        if chosen is None:
            raise self._no_pair()
        rev = chosen.revision
        if retry:
            self.metrics.child(self.metrics.retries, rev.revision).inc()
        ctx.revision, ctx.flow = rev.revision, "local" if local else "push" if rev.mode == "Push" else "pull"
        xid, transfer_id = mint_ids()
        tl = Timeline(time.monotonic())
        if local:
            d = self.balancer.least(chosen.decode, "decode")
            self.stats.local(rev.revision)
            status, ctype, data, resp = await self._open_decode(ctx, d, xid, None, tl)
            return Opened(xid, rev.revision, ctx.flow, d, status, ctype, data, tl, resp)
        self.stats.dispatched(rev.revision)
        p = self.balancer.least(chosen.prefill, "prefill")
        if ctx.flow == "push" and not self.cfg.push_sequential:
            return await self._attempt_push(ctx, rev, p, self.balancer.least(chosen.decode, "decode"), xid, transfer_id, tl)
        return await self._attempt_sequential(ctx, rev, p, xid, transfer_id, tl)

    async def _attempt_push(
        self, ctx: RequestContext, rev: RevisionView, p: Backend, d: Backend, xid: str, transfer_id: str, tl: Timeline
    ) -> Opened:
        params = p.identity.push_decode_params(engine_request_id(ctx.kind, xid), transfer_id)
        # The attempt keeps both legs' deadlines, so that when one passes the prefill is cancelled first.
        p_end = tl.start + self.cfg.leg_timeout
        d_timeout, d_cause = self._decode_deadline(ctx)
        d_end = tl.start + d_timeout
        # P counts as in flight until D has its first token: P's KV is D's until then (its retirement waits).
        with self.balancer.track(p):
            p_task = asyncio.create_task(self._prefill_leg(ctx, p, "Push", xid, transfer_id, tl, None))
            d_task = asyncio.create_task(self._open_decode(ctx, d, xid, params, tl, own_deadline=False))
            try:
                pending: set[asyncio.Task[Any]] = {p_task, d_task}
                while True:
                    end = d_end if p_task.done() else min(p_end, d_end)
                    done, pending = await asyncio.wait(pending, timeout=max(0.0, end - time.monotonic()), return_when=asyncio.FIRST_COMPLETED)
                    if d_task in done:
                        break  # decode answered (then the KV arrived, whatever P's leg says) or failed
                    if p_task in done:
                        p_task.result()  # a failed prefill means the decode leg can never complete
                    elif not done and time.monotonic() >= end:
                        late, what, cause = (p, "prefill", "prefill_timeout") if not p_task.done() and end == p_end else (d, "decode", d_cause)
                        deadline = self.cfg.leg_timeout if cause == "prefill_timeout" else d_timeout
                        raise LegFailure(cause, f"{what} engine {late.key} missed the {deadline:g}s deadline", 504, (p, d))
                status, ctype, data, resp = d_task.result()
            except BaseException as e:
                await abort_legs(p_task, d_task)
                if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
                    self._discard(d, d_task.result()[3])  # opened just as the attempt failed or was cancelled
                if isinstance(e, LegFailure) and e.cause == "protocol_mismatch":
                    e.blamed = (p, d)  # the pair speaks another protocol than its revision announces
                raise
            return Opened(xid, rev.revision, "push", d, status, ctype, data, tl, resp, None if p_task.done() else p_task)

    async def _attempt_sequential(self, ctx: RequestContext, rev: RevisionView, p: Backend, xid: str, transfer_id: str, tl: Timeline) -> Opened:
        """Pull, and push-sequential: the prefill leg, then a decode chosen by load in P's revision."""
        assert rev.mode is not None
        # P counts as in flight until D has its first token: in pull, D reads P's blocks only after P's leg ended.
        with self.balancer.track(p):
            answer = await self._prefill_leg(ctx, p, rev.mode, xid, transfer_id, tl, self.cfg.leg_timeout)
            d = self.balancer.choose_decode(self.table.snapshot(), p.revision, ctx.excluded)
            if d is None:
                raise LegFailure("no_backend", f"revision {p.revision} lost its decode engines", 503, ())
            returned = answer["kv_transfer_params"]
            if ctx.flow == "pull":
                params = {"transfer_id": transfer_id, **returned}
            else:  # P's identity from discovery, P's own request id from its answer (heartbeats then match)
                rid = returned.get("remote_request_id")
                params = p.identity.push_decode_params(rid if isinstance(rid, str) else engine_request_id(ctx.kind, xid), transfer_id)
            status, ctype, data, resp = await self._open_decode(ctx, d, xid, params, tl)
        return Opened(xid, rev.revision, ctx.flow, d, status, ctype, data, tl, resp)

    def _discard(self, d: Backend, resp: aiohttp.ClientResponse | None) -> None:
        if resp is not None:
            resp.close()
            self.balancer.release(d)

    # --- the request --------------------------------------------------------------------------------
    def _failed(self, revision: str, flow: str, cause: str) -> None:
        self.metrics.child(self.metrics.failures, revision, flow, cause).inc()
        if revision and flow != "local":
            self.stats.failed(revision, cause)

    async def handle(self, ctx: RequestContext) -> web.StreamResponse:
        threshold = self.cfg.disaggregation_threshold_tokens
        local = bool(threshold) and estimate_prompt_tokens(ctx.kind, ctx.body) < threshold
        status = 500
        self.metrics.in_flight.inc()
        try:
            attempts = 1 + self.cfg.max_retries
            failure: LegFailure | None = None
            for attempt in range(attempts):
                try:
                    opened = await self._attempt(ctx, local, retry=attempt > 0)
                except LegFailure as f:
                    if f.cause == "no_backend" and failure is not None:
                        break  # a retry found no pair that avoids the failed one: answer with that failure
                    failure = f
                    if f.cause != "no_backend":
                        self._failed(ctx.revision, ctx.flow, f.cause)
                    log.warning("attempt %d/%d failed: %s (%s)", attempt + 1, attempts, f, f.cause)
                    ctx.excluded.update(b.key for b in f.blamed)
                    if f.passthrough or not f.retryable:
                        break
                    continue
                status = opened.status
                return await self._relay(ctx, opened)
            assert failure is not None
            if failure.passthrough:
                st, data, ctype = failure.passthrough
                status = st
                return web.Response(status=st, body=data, headers={"Content-Type": ctype})
            status = failure.status
            return openai_error(failure.status, str(failure))
        except asyncio.CancelledError:
            status = 499
            self._failed(ctx.revision, ctx.flow, "client_disconnect")
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.child(self.metrics.requests, ctx.revision, ctx.flow, ctx.kind, str(status)).inc()
            self.metrics.child(self.metrics.e2e, ctx.revision, ctx.flow).observe(time.monotonic() - ctx.t0)

    def _succeeded(self, o: Opened) -> None:
        """The client got its whole answer: the timings of its legs, and a success for its revision. A
        push prefill leg that failed meanwhile (its decode answered anyway, e.g. by prefilling itself)
        counts against the revision's KV transfer instead."""
        tl, m = o.timeline, self.metrics
        if tl.prefill is not None:
            m.child(m.prefill, o.revision, o.flow).observe(tl.prefill)
        if tl.kv_wait is not None:
            m.child(m.kv_wait, o.revision, o.flow).observe(tl.kv_wait)
        if o.flow == "local":
            return
        p = o.prefill_task
        failure = p.exception() if p is not None and p.done() and not p.cancelled() else None
        if isinstance(failure, LegFailure):
            self._failed(o.revision, o.flow, failure.cause)
            log.warning("request %s answered, but its prefill leg failed: %s (%s)", o.xid, failure, failure.cause)
        else:
            self.stats.succeeded(o.revision)

    async def _relay(self, ctx: RequestContext, o: Opened) -> web.StreamResponse:
        headers = {"Content-Type": o.content_type, "X-Request-Id": o.xid}
        timing = o.timeline.server_timing(ctx.t0)
        if timing:
            headers["Server-Timing"] = timing
        if o.resp is None:
            self._succeeded(o)
            await abort_legs(o.prefill_task)
            return web.Response(status=o.status, body=o.data, headers=headers)
        resp = o.resp
        finished = False
        try:
            headers["Cache-Control"] = "no-cache"
            out = web.StreamResponse(status=o.status, headers=headers)
            await out.prepare(ctx.request)
            await out.write(o.data)
            first = time.monotonic()
            self.metrics.child(self.metrics.ttft, o.revision, o.flow).observe(first - ctx.t0)
            events, last = 0, b""  # SSE events after the first chunk (one token each), for the TPOT
            engine_error = False
            stall = StallTimer(self.cfg.leg_timeout)
            try:
                while True:
                    try:
                        with stall:
                            chunk = await resp.content.readany()
                    except (TimeoutError, aiohttp.ClientError) as e:
                        cause = "decode_stall" if isinstance(e, TimeoutError) else "decode_stream_broken"
                        self._failed(o.revision, o.flow, cause)
                        log.warning("decode stream from %s ended abnormally: %s", o.decode.key, cause)
                        if cause == "decode_stream_broken":
                            self.balancer.ejections.suspect(o.decode.key)
                        await out.write(sse_error(502, f"decode engine stream failed ({cause})"))
                        break
                    if not chunk:
                        finished = True
                        break
                    engine_error = engine_error or _SSE_ERROR in chunk
                    events += chunk.count(b"\n\n")  # JSON escapes newlines: a blank line only ends an event
                    last = chunk
                    await out.write(chunk)
            finally:
                stall.close()
            if finished and engine_error:  # the engine ended the stream with its own error event
                finished = False
                self._failed(o.revision, o.flow, "decode_stream_broken")
            elif finished:
                self._succeeded(o)
                tokens = events - last.endswith(_SSE_DONE)  # [DONE] carries no token
                if tokens > 0:
                    self.metrics.child(self.metrics.tpot, o.revision, o.flow).observe((time.monotonic() - first) / tokens)
            await out.write_eof()
            return out
        except ConnectionError:  # the client went away while we wrote to it
            raise asyncio.CancelledError() from None
        finally:
            await abort_legs(o.prefill_task, decode_follows=not finished)  # prefill first, then the decode
            if finished:
                resp.release()
            else:
                resp.close()
            self.balancer.release(o.decode)


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


def _sse_error_message(chunk: bytes) -> str:
    try:
        return str(json.loads(chunk.lstrip()[6:].split(b"\n\n", 1)[0])["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return "error event"


async def abort_legs(prefill: asyncio.Task[Any] | None, *after: asyncio.Task[Any] | None, decode_follows: bool = False) -> None:
    """Cancel the prefill leg, then the others. A prefill cancelled while it ran gets a head start of
    PREFILL_ABORT_SETTLE_SECONDS before a live decode leg is touched (``after``, or one the caller closes
    next: ``decode_follows``): vLLM notices a closed connection asynchronously (its API server, then the
    engine core at its next step), so a decode abort sent at the same instant could overtake it and free
    blocks the prefill would still write (vLLM #48633 C1)."""
    if prefill is not None and not prefill.done():
        prefill.cancel()
        await asyncio.gather(prefill, return_exceptions=True)
        if decode_follows or any(t is not None and not t.done() for t in after):
            await asyncio.sleep(PREFILL_ABORT_SETTLE_SECONDS)
    for t in after:
        if t is not None:
            if not t.done():
                t.cancel()
            await asyncio.gather(t, return_exceptions=True)
