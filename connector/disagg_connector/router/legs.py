"""The two legs of one attempt over HTTP: the prefill leg to its answer, the decode leg to its first
chunk, each under its deadline, every failure turned into a :class:`LegFailure` that names the engine to
blame (and ejects or suspects it, see ``pairing.Ejections``). What the legs say is :mod:`contract.vllm_pd`;
the in-flight counts are the attempt's (``dispatch``), not the legs'.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp
import orjson

from disagg_connector import contract
from disagg_connector.contract.vllm_pd import (
    PrefillAnswerError,
    decode_body,
    leg_headers,
    prefill_body,
    prefill_transfer_params,
    stream_failed_early,
)
from disagg_connector.router.discovery import Backend
from disagg_connector.router.migration import decode_leg_body
from disagg_connector.router.pairing import Ejections

# vLLM notices a closed connection asynchronously (API server, then engine core at its next step).
PREFILL_ABORT_SETTLE_SECONDS = 0.05


class LegFailure(Exception):
    """A leg (or the attempt) failed before anything reached the client. A retry never goes back to a
    ``blamed`` backend, and goes back to an ``implicated`` one only when no pair avoids it."""

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
        self.implicated: tuple[Backend, ...] = ()


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


@dataclass(frozen=True)
class LegRequest:
    """What both legs of one attempt share."""

    kind: str  # "completions" | "chat"
    path: str
    body: dict[str, Any]
    stream: bool
    auth: str | None
    xid: str
    transfer_id: str
    token_ids: bool = False  # the decode leg asks for token ids (stream migration), whatever the client asked


@dataclass
class DecodeAnswer:
    """A decode leg whose answer has begun: ``data`` is its first chunk (``resp`` open, to be relayed) or
    its whole body (``resp`` None)."""

    status: int
    content_type: str
    data: bytes
    resp: aiohttp.ClientResponse | None


class Legs:
    def __init__(self, client: aiohttp.ClientSession, ejections: Ejections) -> None:
        self.client, self.ejections = client, ejections

    @contextlib.asynccontextmanager
    async def _deadline(self, role: str, backend: Backend, deadline: float | None, timeout_cause: str) -> AsyncIterator[None]:
        """One leg's deadline (None: the attempt keeps it), and its transport errors turned into a
        LegFailure naming the engine."""
        try:
            async with asyncio.timeout(deadline):
                yield
        except TimeoutError:
            raise LegFailure(timeout_cause, f"{role} engine {backend.key} missed the {deadline:g}s deadline", 504, (backend,)) from None
        except aiohttp.ClientConnectionError as e:
            self.ejections.eject(backend.key)
            raise LegFailure(f"{role}_connection", f"{role} engine {backend.key} failed: {type(e).__name__}: {e}", 502, (backend,)) from None
        except aiohttp.ClientError as e:
            raise LegFailure(f"{role}_error" if role == "prefill" else "decode_failed", f"{role} engine {backend.key}: {e}", 502, (backend,)) from None

    def _engine_status(self, role: str, b: Backend, status: int, data: bytes, ctype: str) -> LegFailure:
        """A non-200 answer from an engine, before anything reached the client."""
        if 400 <= status < 500:
            return LegFailure(f"{role}_rejected", f"{role} engine rejected the request", status, (b,), False, (status, data, ctype))
        if status == 503:
            self.ejections.eject(b.key)
            return LegFailure(f"{role}_unavailable", f"{role} engine {b.key} is unavailable (HTTP 503)", 502, (b,))
        self.ejections.suspect(b.key)
        return LegFailure("prefill_error" if role == "prefill" else "decode_failed", f"{role} engine {b.key} answered HTTP {status}", 502, (b,))

    async def prefill(self, req: LegRequest, p: Backend, mode: str, tl: Timeline, deadline: float | None) -> dict[str, Any]:
        """The prefill leg to completion; returns the ``kv_transfer_params`` of P's answer."""
        payload = orjson.dumps(prefill_body(req.kind, req.body, req.transfer_id))
        headers = leg_headers(req.xid, req.auth, p.identity.dp_local_index if p.dp_size > 1 else None)
        async with self._deadline("prefill", p, deadline, "prefill_timeout"):
            resp = await self.client.post(p.base_url + req.path, data=payload, headers=headers)
            try:
                data = await resp.read()
            except BaseException:
                resp.close()
                raise
        tl.prefill_done = time.monotonic()
        if resp.status != 200:
            raise self._engine_status("prefill", p, resp.status, data, resp.headers.get("Content-Type", "application/json"))
        try:
            return prefill_transfer_params(orjson.loads(data), mode)
        except PrefillAnswerError as e:
            if not e.mismatch:
                raise LegFailure("prefill_error", f"prefill engine {p.key} sent {e}", 502, (p,)) from None
            raise LegFailure(
                "protocol_mismatch",
                f"prefill engine {p.key} answered with {e}, but its revision {p.revision} is {mode}: "
                f"set the pods' {contract.ANNOTATION_TRANSFER_MODE} annotation to the connector the engines run",
                502,
                (p,),
            ) from None
        except ValueError as e:  # not JSON at all
            raise LegFailure("prefill_error", f"prefill engine {p.key} sent invalid JSON ({e})", 502, (p,)) from None

    async def decode(
        self, req: LegRequest, d: Backend, params: dict[str, Any] | None, tl: Timeline, deadline: float | None, timeout_cause: str
    ) -> DecodeAnswer:
        """Send the decode leg and wait for its first chunk (streaming) or its whole answer. An open
        response is the caller's to close (``relay``, or the attempt that failed meanwhile)."""
        payload = orjson.dumps(decode_body(decode_leg_body(req.body) if req.token_ids else req.body, params))
        tl.decode_sent = time.monotonic()
        async with self._deadline("decode", d, deadline, timeout_cause):
            resp = await self.client.post(d.base_url + req.path, data=payload, headers=leg_headers(req.xid, req.auth, None))
            ctype = resp.headers.get("Content-Type", "application/json")
            try:
                if req.stream and resp.status == 200:
                    first = await resp.content.readany()
                    why = stream_failed_early(first)
                    if why is not None:
                        self.ejections.suspect(d.key)
                        raise LegFailure("decode_failed", f"decode engine {d.key} failed the request before its first token: {why}", 502, (d,))
                    tl.first_token = time.monotonic()
                    return DecodeAnswer(resp.status, ctype, first, resp)
                data = await resp.read()
            except BaseException:
                resp.close()
                raise
        if resp.status != 200:
            raise self._engine_status("decode", d, resp.status, data, ctype)
        tl.first_token = time.monotonic()
        return DecodeAnswer(resp.status, ctype, data, None)


async def abort_legs(prefill: asyncio.Task[Any] | None, *after: asyncio.Task[Any] | None, decode_follows: bool = False) -> None:
    """Cancel the prefill leg, then the others. A prefill cancelled while it ran gets a head start of
    PREFILL_ABORT_SETTLE_SECONDS before a live decode leg is touched (``after``, or one the caller closes
    next: ``decode_follows``): vLLM notices a closed connection asynchronously (its API server, then the
    engine core at its next step), so a decode abort sent at the same instant could overtake it and free
    blocks the prefill would still write (vLLM #48633 C1)."""
    if prefill is not None and prefill.done():
        if not prefill.cancelled():
            prefill.exception()  # taken: a failure of its own is the caller's to report (or not)
    elif prefill is not None:
        prefill.cancel()
        await asyncio.gather(prefill, return_exceptions=True)
        if decode_follows or any(t is not None and not t.done() for t in after):
            await asyncio.sleep(PREFILL_ABORT_SETTLE_SECONDS)
    for t in after:
        if t is not None:
            if not t.done():
                t.cancel()
            await asyncio.gather(t, return_exceptions=True)
