"""Dispatch of one client request to a prefill/decode pair (vLLM 0.33.0 protocol, see the reference §3-§5).

**Ids.** Every dispatch (every retry too) mints a fresh ``X-Request-Id``, identical on both legs (vLLM 0.26.0
and 0.33.0 match push legs on the request id), and a fresh ``transfer_id`` in both legs' ``kv_transfer_params``
(vLLM main matches on it; released versions ignore it). In pull, the decode leg carries P's answer verbatim
with the ``transfer_id`` added unless P echoed one.

**Push** (``NixlPushConnector``): pick P and D up front (least outstanding), send both legs *concurrently*; the decode leg carries P's identity
(:meth:`EngineIdentity.push_decode_params`) so D registers its blocks with P while P is still prefilling.
``remote_request_id`` is ``cmpl-<id>-0`` / ``chatcmpl-<id>``: P's internal id without the random suffix, so it
equals P's id exactly when the engines run with ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1`` (then D's
heartbeats extend P's lease); otherwise it is informative only (vLLM matches the legs on the request id).

**Pull** (``NixlConnector``): prefill leg (``do_remote_decode``, max tokens 1, not streamed), then a decode
chosen by load *after* the prefill, within P's revision, with P's ``kv_transfer_params`` verbatim.

``push-sequential`` (benchmarks only): push engines driven like the 0.33-era demo proxy (P, then D).

**Deadlines.** The prefill leg must answer within ``leg_timeout``. The decode leg must produce its first
body chunk within ``leg_timeout`` when streaming (vLLM sends the headers at once and the first chunk after
the first token, i.e. after the KV arrived), and then never stall longer than ``leg_timeout`` between chunks;
a non-streaming decode leg is bounded by ``request_timeout``. ``leg_timeout`` must stay below the KV lease.

**Failures.** On any failure or deadline both legs are cancelled (the connections are closed, which vLLM
treats as an abort). While nothing has reached the client, the request is retried up to ``max_retries``
times on another pair with a fresh id (a leg id is never reused: P may still hold a registration for it).
Engine 4xx answers are passed through as they are (not retried). After the first byte reached the client a
failure ends the stream with an SSE error event. A client disconnect cancels both legs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp
from aiohttp import web

from disagg_connector.router.config import RouterConfig
from disagg_connector.router.discovery import Backend, EndpointTable
from disagg_connector.router.metrics import RouterMetrics
from disagg_connector.router.pairing import Balancer

log = logging.getLogger("disagg_router.dispatch")

PREFILL_LEG_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_DROP_ON_PREFILL = ("min_tokens", "min_completion_tokens", "stream_options")
DP_RANK_HEADER = "X-data-parallel-rank"
_ERROR_STATUS_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def openai_error(status: int, message: str, param: str | None = None, err_type: str | None = None) -> web.Response:
    """The error body of vLLM's OpenAI server (and OpenAI's): {"error": {message, type, param, code}}."""
    body = {"error": {"message": message, "type": err_type or _ERROR_STATUS_TYPES.get(status, "Error"), "param": param, "code": status}}
    return web.json_response(body, status=status)


def engine_request_id(kind: str, xid: str) -> str:
    """vLLM's request id for X-Request-Id ``xid`` (before its random ``-<8hex>`` suffix)."""
    return f"cmpl-{xid}-0" if kind == "completions" else f"chatcmpl-{xid}"


def mint_ids() -> tuple[str, str]:
    """A fresh (X-Request-Id, transfer_id) for one dispatch: never reused, not even by a retry (P may
    still hold a registration or blocks under the old ones). The ``xfer-`` prefix is vLLM's demo's."""
    xid = uuid.uuid4().hex
    return xid, f"xfer-{xid}"


def prefill_body(kind: str, body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    b = {k: v for k, v in body.items() if k not in _DROP_ON_PREFILL}
    b["kv_transfer_params"] = {**PREFILL_LEG_PARAMS, "transfer_id": transfer_id}
    b["max_tokens"] = 1
    if kind == "chat" or "max_completion_tokens" in body:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    return b


class LegFailure(Exception):
    """A leg (or the attempt) failed before anything reached the client."""

    def __init__(
        self,
        cause: str,
        message: str,
        status: int = 502,
        backends: tuple[Backend, ...] = (),
        retryable: bool = True,
        passthrough: tuple[int, bytes, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.cause, self.status, self.backends = cause, status, backends
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
    excluded: set[str] = field(default_factory=set)


@dataclass
class Opened:
    """A decode leg whose answer has begun: ``data`` is its first chunk (streaming) or its whole body."""

    xid: str
    decode: Backend
    status: int
    content_type: str
    data: bytes
    resp: aiohttp.ClientResponse | None = None
    prefill_task: asyncio.Task[Any] | None = None


def _is_sse_error(chunk: bytes) -> bool:
    return chunk.lstrip().startswith(b'data: {"error"')


def _sse_error_message(chunk: bytes) -> str:
    try:
        return str(json.loads(chunk.lstrip()[6:].split(b"\n\n", 1)[0])["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return "error event"


class Dispatcher:
    def __init__(self, cfg: RouterConfig, table: EndpointTable, balancer: Balancer, metrics: RouterMetrics) -> None:
        self.cfg, self.table, self.balancer, self.metrics = cfg, table, balancer, metrics
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # --- legs ---------------------------------------------------------------------------------------
    def _headers(self, ctx: RequestContext, xid: str, b: Backend, pin_rank: bool) -> dict[str, str]:
        h = {"Content-Type": "application/json", "X-Request-Id": xid, "Accept-Encoding": "identity"}
        if ctx.auth:
            h["Authorization"] = ctx.auth
        if pin_rank and b.dp_size > 1:
            h[DP_RANK_HEADER] = str(b.identity.dp_rank)
        return h

    def _connection_failure(self, leg: str, b: Backend, e: BaseException) -> LegFailure:
        self.balancer.eject(b)
        return LegFailure(f"{leg}_connection", f"{leg} engine {b.key} failed: {type(e).__name__}: {e}", 502, (b,))

    @contextlib.asynccontextmanager
    async def _leg(self, role: str, backend: Backend, deadline: float) -> AsyncIterator[None]:
        """One leg's deadline, and its transport errors turned into a LegFailure naming the engine."""
        try:
            async with asyncio.timeout(deadline):
                yield
        except TimeoutError:
            raise LegFailure(f"{role}_timeout", f"{role} engine {backend.key} missed the {deadline:g}s deadline", 504, (backend,)) from None
        except aiohttp.ClientConnectionError as e:
            raise self._connection_failure(role, backend, e) from None
        except aiohttp.ClientError as e:
            raise LegFailure(f"{role}_error", f"{role} engine {backend.key}: {e}", 502, (backend,)) from None

    async def _prefill_leg(self, ctx: RequestContext, p: Backend, xid: str, transfer_id: str) -> dict[str, Any]:
        """The prefill leg to completion; returns P's JSON answer."""
        assert self.session is not None
        payload = json.dumps(prefill_body(ctx.kind, ctx.body, transfer_id)).encode()
        with self.balancer.track(p):
            async with self._leg("prefill", p, self.cfg.leg_timeout):
                resp = await self.session.post(p.base_url + ctx.path, data=payload, headers=self._headers(ctx, xid, p, True))
                try:
                    data = await resp.read()
                except BaseException:
                    resp.close()
                    raise
        ctype = resp.headers.get("Content-Type", "application/json")
        if 400 <= resp.status < 500:
            raise LegFailure("prefill_rejected", "prefill engine rejected the request", resp.status, (p,), False, (resp.status, data, ctype))
        if resp.status != 200:
            raise LegFailure("prefill_error", f"prefill engine {p.key} answered HTTP {resp.status}", 502, (p,))
        try:
            answer = json.loads(data)
            if not isinstance(answer, dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise LegFailure("prefill_error", f"prefill engine {p.key} sent invalid JSON ({e})", 502, (p,)) from None
        return answer

    async def _open_decode(self, ctx: RequestContext, d: Backend, xid: str, params: dict[str, Any] | None) -> Opened:
        """Send the decode leg and wait for its first chunk (streaming) or whole answer."""
        assert self.session is not None
        body = dict(ctx.body)
        if params is None:
            body.pop("kv_transfer_params", None)
        else:
            body["kv_transfer_params"] = params
        payload = json.dumps(body).encode()
        deadline = self.cfg.leg_timeout if ctx.stream else self.cfg.request_timeout
        self.balancer.acquire(d)
        try:
            async with self._leg("decode", d, deadline):
                resp = await self.session.post(d.base_url + ctx.path, data=payload, headers=self._headers(ctx, xid, d, False))
                ctype = resp.headers.get("Content-Type", "application/json")
                try:
                    if ctx.stream and resp.status == 200:
                        first = await resp.content.readany()
                        if not first:
                            raise LegFailure("decode_error", f"decode engine {d.key} closed an empty stream", 502, (d,))
                        if _is_sse_error(first):
                            msg = _sse_error_message(first)
                            raise LegFailure("decode_error", f"decode engine {d.key} failed the request: {msg}", 502, (d,))
                        return Opened(xid, d, resp.status, ctype, first, resp)
                    data = await resp.read()
                except BaseException:
                    resp.close()
                    raise
            if 400 <= resp.status < 500:
                raise LegFailure("decode_rejected", "decode engine rejected the request", resp.status, (d,), False, (resp.status, data, ctype))
            if resp.status >= 500:
                raise LegFailure("decode_error", f"decode engine {d.key} answered HTTP {resp.status}", 502, (d,))
            self.balancer.release(d)
            return Opened(xid, d, resp.status, ctype, data)
        except BaseException:
            self.balancer.release(d)
            raise

    def _discard(self, o: Opened) -> None:
        if o.resp is not None:
            o.resp.close()
            self.balancer.release(o.decode)

    # --- attempts -----------------------------------------------------------------------------------
    def _no_backend(self) -> LegFailure:
        snap = self.table.snapshot()
        what = ", ".join(f"{r.revision}: {len(r.prefill)}P/{len(r.decode)}D" for r in snap.revisions) or "none discovered"
        return LegFailure("no_backend", f"no revision has both a ready prefill and a ready decode engine ({what})", 503, (), False)

    async def _attempt_push(self, ctx: RequestContext) -> Opened:
        pair = self.balancer.choose_pair(self.table.snapshot(), ctx.excluded)
        if pair is None:
            raise self._no_backend()
        p, d = pair
        xid, transfer_id = mint_ids()
        params = p.identity.push_decode_params(engine_request_id(ctx.kind, xid), transfer_id)
        p_task = asyncio.create_task(self._prefill_leg(ctx, p, xid, transfer_id))
        d_task = asyncio.create_task(self._open_decode(ctx, d, xid, params))
        try:
            pending: set[asyncio.Task[Any]] = {p_task, d_task}
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if d_task in done:
                    break  # decode answered (then the KV arrived, whatever P's leg says) or failed
                p_task.result()  # a failed prefill means the decode leg can never complete
            opened = d_task.result()
        except BaseException:
            await _cancel(p_task, d_task)
            if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
                self._discard(d_task.result())  # opened just as the attempt failed or was cancelled
            raise
        if not p_task.done():
            opened.prefill_task = p_task
        return opened

    async def _attempt_sequential(self, ctx: RequestContext) -> Opened:
        p = self.balancer.choose_prefill(self.table.snapshot(), ctx.excluded)
        if p is None:
            raise self._no_backend()
        xid, transfer_id = mint_ids()
        answer = await self._prefill_leg(ctx, p, xid, transfer_id)
        returned = answer.get("kv_transfer_params")
        if self.cfg.mode == "pull":
            params = {"transfer_id": transfer_id, **returned} if isinstance(returned, dict) else None
            if params is None:
                self.metrics.failures.labels(self.cfg.mode, "prefill_no_kv_params").inc()
                log.warning("prefill %s returned no kv_transfer_params; decode will recompute", p.key)
        else:  # push-sequential: P's identity from discovery, P's internal request id from its answer
            rid = returned.get("remote_request_id") if isinstance(returned, dict) else None
            params = p.identity.push_decode_params(rid or engine_request_id(ctx.kind, xid), transfer_id)
        d = self.balancer.choose_decode(self.table.snapshot(), p.revision, ctx.excluded)
        if d is None:
            raise LegFailure("no_backend", f"revision {p.revision} lost its decode engines", 503, ())
        return await self._open_decode(ctx, d, xid, params)

    # --- the request --------------------------------------------------------------------------------
    async def handle(self, ctx: RequestContext) -> web.StreamResponse:
        mode = self.cfg.mode
        endpoint = ctx.kind
        self.metrics.in_flight.inc()
        status = 500
        try:
            attempts = 1 + self.cfg.max_retries
            failure: LegFailure | None = None
            for attempt in range(attempts):
                if attempt:
                    self.metrics.retries.labels(mode).inc()
                try:
                    if mode == "push":
                        opened = await self._attempt_push(ctx)
                    else:
                        opened = await self._attempt_sequential(ctx)
                except LegFailure as f:
                    failure = f
                    self.metrics.failures.labels(mode, f.cause).inc()
                    log.warning("attempt %d/%d failed: %s (%s)", attempt + 1, attempts, f, f.cause)
                    ctx.excluded.update(b.key for b in f.backends)
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
            self.metrics.failures.labels(mode, "client_disconnect").inc()
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(mode, endpoint, str(status)).inc()
            self.metrics.e2e.labels(mode).observe(time.monotonic() - ctx.t0)

    async def _relay(self, ctx: RequestContext, o: Opened) -> web.StreamResponse:
        mode = self.cfg.mode
        headers = {"Content-Type": o.content_type, "X-Request-Id": o.xid}
        if o.resp is None:
            await _cancel(o.prefill_task)
            return web.Response(status=o.status, body=o.data, headers=headers)
        resp = o.resp
        finished = False
        try:
            headers["Cache-Control"] = "no-cache"
            out = web.StreamResponse(status=o.status, headers=headers)
            await out.prepare(ctx.request)
            await out.write(o.data)
            self.metrics.ttft.labels(mode).observe(time.monotonic() - ctx.t0)
            while True:
                try:
                    async with asyncio.timeout(self.cfg.leg_timeout):
                        chunk = await resp.content.readany()
                except (TimeoutError, aiohttp.ClientError) as e:
                    cause = "decode_stall" if isinstance(e, TimeoutError) else "decode_stream_broken"
                    self.metrics.failures.labels(mode, cause).inc()
                    log.warning("decode stream from %s ended abnormally: %s", o.decode.key, cause)
                    err = {"error": {"message": f"decode engine stream failed ({cause})", "type": "BadGatewayError", "param": None, "code": 502}}
                    await out.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                    break
                if not chunk:
                    finished = True
                    break
                await out.write(chunk)
            await out.write_eof()
            return out
        except ConnectionError:  # the client went away while we wrote to it
            raise asyncio.CancelledError() from None
        finally:
            if finished:
                resp.release()
            else:
                resp.close()
            self.balancer.release(o.decode)
            await _cancel(o.prefill_task)


async def _cancel(*tasks: asyncio.Task[Any] | None) -> None:
    live = [t for t in tasks if t is not None]
    for t in live:
        if not t.done():
            t.cancel()
    if live:
        await asyncio.gather(*live, return_exceptions=True)
