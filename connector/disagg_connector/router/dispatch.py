"""Dispatch of one client request: its attempts on prefill/decode pairs and their retries (vLLM's P/D
protocol; docs/router.md). What the legs carry is :mod:`contract.vllm_pd`; sending them is :mod:`legs`;
the answer's way to the client is :mod:`relay`; what happened is counted once by :mod:`outcomes`.

**Ids.** Every dispatch (every retry too) mints a fresh ``X-Request-Id``, identical on both legs (vLLM 0.26.0
and 0.33.0 match push legs on the request id), and a fresh ``transfer_id`` in both legs' ``kv_transfer_params``
(vLLM main matches on it; released versions ignore it). In pull, the decode leg carries P's answer verbatim
with the ``transfer_id`` added unless P echoed one.

**Per revision.** The revision (chosen in proportion to its ready pairs, see ``pairing``) decides the protocol
from its pods' transfer-mode annotation:

**Which engines.** Within the revision, P and D are picked by the role's policy (:mod:`policy`:
``--prefill-policy``, ``--decode-policy``; the prompt's chunk keys for the prefix index are made once per request).

- Push (``NixlPushConnector``): pick P and D up front, send both legs *concurrently*;
  the decode leg carries P's identity (:meth:`EngineIdentity.push_decode_params`) so D registers its blocks
  with P while P is still prefilling. ``remote_request_id`` is ``cmpl-<id>-0`` / ``chatcmpl-<id>``: P's
  internal id without its random suffix.
- Pull (``NixlConnector``): prefill leg (``do_remote_decode``, max tokens 1, not streamed), then a decode
  picked *after* the prefill, within P's revision, with P's ``kv_transfer_params``.
- A prompt shorter than ``--disaggregation-threshold-tokens`` goes to a decode engine alone (no
  ``kv_transfer_params``): it prefills locally, which costs less than a transfer for short prompts.

A benchmark may dispatch push revisions otherwise (``disagg_bench.localrun.baseline_router`` replaces
:meth:`Dispatcher.push_attempt`); the router's own command line cannot.

A prefill answer whose ``transfer_mode`` (vLLM 0.33.0 returns it) differs from the revision's is a
``protocol_mismatch``: the decode leg would wait for a KV that never comes, or read it the wrong way.

**In flight.** P counts as in flight until D has its first token (P's KV is D's until then); D until the
relay ends. Each count is one ``with`` (``Balancer.track``): P's around its leg, D's in the attempt's
``held`` stack, which lives until the relay ended or the attempt failed (it also closes D's response).

**Deadlines.** The prefill leg must answer within ``leg_timeout``. The decode leg must produce its first body
chunk within ``leg_timeout`` when streaming (vLLM sends the first chunk after the first token, i.e. after the
KV arrived: this is the KV-wait deadline), and then never stall longer than ``leg_timeout`` between chunks;
a non-streaming decode leg is bounded by ``request_timeout``. ``leg_timeout`` stays below the KV lease.

**Failures** (the contract; causes in :mod:`health`). On any failure, deadline or client disconnect the
prefill leg is cancelled first, then the decode leg (closing a connection is vLLM's abort; a decode aborted
while its prefill still runs is where a late push would write into freed blocks, vLLM #48633 C1). While
nothing has reached the client, the request is retried, at most ``max_retries`` times, with fresh ids on a
pair that avoids every backend blamed for an earlier attempt (no retry ever goes back into an engine that
failed or timed out on its own, unless its probe re-admitted it after it refused or dropped the connection); when
no such pair exists the request fails at once with the failure it has, but a retry that finds only ejected engines
first waits up to ``leg_timeout`` for a re-admission (``_choose``). A
push decode that failed before its first token, while its prefill's own leg did not fail, may have failed for
its prefill (D's KV comes from P): both are implicated (``push_failure``), and the retry avoids both where a
pair does, else the prefill, else the decode, never the pair again (``_avoidance``).
Statuses: 503 when no pair is ready; 502 when an engine fails before the decode's first byte; 504 when a leg
or the KV wait passes its deadline; engine 4xx answers passed through as they are; after the first byte, the
stream is continued on another pair (``_continue``, :mod:`migration`), or ends with an SSE error event and no
``data: [DONE]`` (:mod:`relay`). An engine that answers 503 or drops its connection is ejected and re-probed
(see ``pairing.Ejections``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import aiohttp
from aiohttp import web

from disagg_connector.contract.vllm_pd import engine_request_id, error_body, estimate_prompt_tokens, mint_ids, pull_decode_params
from disagg_connector.router.config import RouterConfig
from disagg_connector.router.discovery import Backend, EndpointTable, RevisionView
from disagg_connector.router.legs import DecodeAnswer, LegFailure, LegRequest, Legs, Timeline, abort_legs
from disagg_connector.router.metrics import RouterMetrics
from disagg_connector.router.migration import refusal
from disagg_connector.router.outcomes import OutcomeRecorder
from disagg_connector.router.pairing import Balancer, Candidates, Comeback, Ejections
from disagg_connector.router.policy import Pick, Policies
from disagg_connector.router.prefix import PromptKey, prompt_key
from disagg_connector.router.relay import Keepalive, Migration, Opened, Relay
from disagg_connector.router.stats import RouterStats

log = logging.getLogger("disagg_router.dispatch")

# P's kv_transfer_params (its answer) -> the decode leg's.
DecodeParams = Callable[[dict[str, Any]], dict[str, Any]]
# A stream waiting for a pair to continue on tells its client it is still there this often.
KEEPALIVE_SECONDS = 5.0


class PairingChanges:
    """What waits for the pairing to change (a pod ready or gone, a group whole again, an ejection or re-admission)
    is woken by it; the failed engines of a waiting continuation are watched at each change (:class:`Comeback`)
    so that a restarted one is seen go and come back even between two of its waits."""

    def __init__(self, table: EndpointTable, ejections: Ejections) -> None:
        self.table, self.ejections = table, ejections
        self._waiters: set[asyncio.Future[None]] = set()
        self._watched: dict[int, tuple[Comeback, set[str]]] = {}
        table.listeners.append(self._changed)
        ejections.listeners.append(self._changed)

    def _present(self) -> set[str]:
        return {b.key for b in self.table.snapshot().backends()}

    def _changed(self) -> None:
        if self._watched:
            present = self._present()
            for comeback, excluded in self._watched.values():
                excluded -= comeback.observe(present, self.ejections)
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    @contextlib.contextmanager
    def watching(self, comeback: Comeback, excluded: set[str]) -> Iterator[None]:
        """While in it, each failed engine of ``comeback`` that comes back leaves ``excluded``; one already gone
        (ejected as it failed) counts as gone from the start."""
        comeback.observe(self._present(), self.ejections)
        self._watched[id(comeback)] = (comeback, excluded)
        try:
            yield
        finally:
            del self._watched[id(comeback)]

    async def wait(self, timeout: float) -> bool:
        """True when the pairing changed within ``timeout`` seconds."""
        f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(f)
        try:
            await asyncio.wait_for(f, max(timeout, 0.0))
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters.discard(f)


def openai_error(status: int, message: str, param: str | None = None, err_type: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param, err_type), status=status)


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
    avoided: set[str] = field(default_factory=set)  # keys of backends implicated: used only when nothing else pairs
    avoided_decodes: set[str] = field(default_factory=set)  # the decode engines' keys among ``avoided``
    revision: str = ""  # of the current (last) attempt
    flow: str = ""  # of the current attempt: "push" | "pull" | "local"
    tokens: int = 0  # the prompt's estimated length
    token_ids: bool = False  # the decode leg asks for token ids (a continuation needs them: stream migration)
    _key: PromptKey | None = None

    def prompt_key(self) -> PromptKey:
        """The prompt's chunk keys (prefix index), made at the first prefill pick, kept for retries."""
        if self._key is None:
            self._key = prompt_key(self.kind, self.body, self.tokens)
        return self._key


def _discard(resp: aiohttp.ClientResponse) -> None:
    """Close a decode answer that no relay passed on (its attempt failed as it opened). One the relay
    released is left alone: closing it could close a connection on its way back to the pool."""
    if not resp.closed:
        resp.close()


def push_failure(f: LegFailure, p_task: asyncio.Task[Any], p: Backend, d: Backend) -> LegFailure:
    """Who a failed push attempt's retry avoids. D's KV comes from P, so a decode that failed before its
    first token may have failed for P (its registration with P's side channel, P's write): when P's own leg
    failed too, that failure is the account (a prefill that refuses connections fails D's handshake as
    well); otherwise either may be at fault, and both are implicated rather than blamed. Blaming D alone
    failed requests that another prefill would have served: with one decode engine, a prefill pod listed
    before its side channel listened left no pair that avoided D (CI, the autoscaler's burst e2e). A decode
    that refused or dropped the router's own connection is D's failure alone: P plays no part in it."""
    if f.cause == "protocol_mismatch":
        f.blamed = (p, d)  # the pair speaks another protocol than its revision announces
    elif f.blamed == (d,) and f.cause != "decode_connection":
        own = p_task.exception() if p_task.done() and not p_task.cancelled() else None
        if isinstance(own, LegFailure):
            return own
        f.blamed, f.implicated = (), (p, d)
    return f


class Dispatcher:
    def __init__(
        self, cfg: RouterConfig, table: EndpointTable, balancer: Balancer, metrics: RouterMetrics, stats: RouterStats,
        policies: Policies,
    ) -> None:
        self.cfg, self.table, self.balancer, self.policies = cfg, table, balancer, policies
        self.outcomes = OutcomeRecorder(metrics, stats)
        self.relay = Relay(self.outcomes, balancer.ejections, cfg.leg_timeout)
        self.changes = PairingChanges(table, balancer.ejections)
        self.session: aiohttp.ClientSession | None = None
        self._legs: Legs | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        self._legs = Legs(self.session, self.balancer.ejections)

    def client(self) -> aiohttp.ClientSession:
        assert self.session is not None, "Dispatcher.start() first"
        return self.session

    @property
    def legs(self) -> Legs:
        assert self._legs is not None, "Dispatcher.start() first"
        return self._legs

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # --- the request --------------------------------------------------------------------------------
    async def handle(self, ctx: RequestContext) -> web.StreamResponse:
        threshold = self.cfg.disaggregation_threshold_tokens
        ctx.tokens = estimate_prompt_tokens(ctx.kind, ctx.body)
        local = bool(threshold) and ctx.tokens < threshold
        migration = self._migration(ctx)
        status = 500
        self.outcomes.request_started()
        try:
            attempts = 1 + self.cfg.max_retries
            failure: LegFailure | None = None
            for attempt in range(attempts):
                # The attempt's decode count and open response: held until its relay ended, or it failed.
                with contextlib.ExitStack() as held:
                    try:
                        opened = await self._attempt(ctx, local, attempt > 0, held)
                    except LegFailure as f:
                        if f.cause == "no_backend" and failure is not None:
                            break  # a retry found no pair that avoids the failed one: answer with that failure
                        failure = f
                        if f.cause != "no_backend":
                            self.outcomes.failed(ctx.revision, ctx.flow, f.cause)
                        log.warning("attempt %d/%d failed: %s (%s)", attempt + 1, attempts, f, f.cause)
                        self._avoid(ctx, f)
                        if f.passthrough or not f.retryable:
                            break
                        continue
                    status = opened.answer.status
                    return await self.relay.answer(ctx.request, ctx.t0, opened, migration)
            assert failure is not None
            if failure.passthrough:
                st, data, ctype = failure.passthrough
                status = st
                return web.Response(status=st, body=data, headers={"Content-Type": ctype})
            status = failure.status
            return openai_error(failure.status, str(failure))
        except asyncio.CancelledError:
            status = 499
            self.outcomes.failed(ctx.revision, ctx.flow, "client_disconnect")
            raise
        finally:
            self.outcomes.request_ended(ctx.revision, ctx.flow, ctx.kind, status, time.monotonic() - ctx.t0)

    def _avoid(self, ctx: RequestContext, f: LegFailure) -> None:
        """What the request's later attempts avoid after ``f``: every backend of each engine it blamed or implicated
        (an engine that spans pods fails whole)."""
        ctx.excluded.update(k for b in f.blamed for k in self.table.engine_keys(b.key))
        for b in f.implicated:
            keys = self.table.engine_keys(b.key)
            ctx.avoided.update(keys)
            if b.role == "decode":
                ctx.avoided_decodes.update(keys)

    @staticmethod
    def _avoidance(ctx: RequestContext) -> list[set[str]]:
        """The backends an attempt avoids, most first, until a pair is left: the blamed ones always, with every
        implicated engine; with the implicated prefills (D's KV comes from P: the likelier cause); with the
        implicated decodes. While both roles are implicated, never with neither: no implicated pair is tried again."""
        prefills, decodes = ctx.avoided - ctx.avoided_decodes, ctx.avoided_decodes
        if not ctx.avoided:
            tiers = [set()]
        elif prefills and decodes:
            tiers = [ctx.avoided, prefills, decodes]
        else:
            tiers = [ctx.avoided, set()]
        return [ctx.excluded | t for t in tiers]

    # --- stream migration ---------------------------------------------------------------------------
    def _migration(self, ctx: RequestContext) -> Migration | None:
        """How this request's stream may be continued when its decode fails mid-stream (None: it ends)."""
        if not ctx.stream or self.cfg.max_migrations <= 0:
            return None
        refused = refusal(ctx.kind, ctx.body)
        ctx.token_ids = refused is None
        return Migration(ctx.kind, ctx.body, self.cfg.max_migrations, refused,
                         lambda failed, body, held, keepalive: self._continue(ctx, failed, body, held, keepalive))  # fmt: skip

    async def _continue(
        self, ctx: RequestContext, failed: Opened, body: dict[str, Any], held: contextlib.ExitStack, keepalive: Keepalive,
    ) -> Opened:
        """Open the continuation of ``ctx``'s stream (``body``: migration.continuation_body) on a pair of a serving
        revision that avoids every engine that failed this request, through a prefill or, below the
        disaggregation threshold, locally; with the retries a request has. ``held`` keeps its decode count and
        response. When no pair takes it, it waits for one (a restarting engine, a recreated group) up to
        ``migration_wait``, ``keepalive`` telling the client it is still there. Raises the last LegFailure when no
        pair took it in time."""
        comeback = Comeback(self.table.engine_keys(failed.decode.key))
        ctx.excluded.update(comeback.failed)
        # a completions request on token ids (the body asks for token ids itself), sharing what the request avoids
        cont = RequestContext(
            ctx.request, "completions", "/v1/completions", body, True, ctx.t0, ctx.auth, ctx.excluded, ctx.avoided,
            ctx.avoided_decodes,
        )  # fmt: skip
        cont.tokens = estimate_prompt_tokens("completions", body)  # token ids: exact
        threshold = self.cfg.disaggregation_threshold_tokens
        local = bool(threshold) and cont.tokens < threshold
        deadline = time.monotonic() + self.cfg.migration_wait
        with self.changes.watching(comeback, ctx.excluded):
            while True:
                failure: LegFailure | None = None
                for _ in range(1 + self.cfg.max_retries):
                    with contextlib.ExitStack() as attempt:
                        try:
                            opened = await self._attempt(cont, local, False, attempt)  # counted as a migration, not a retry
                        except LegFailure as f:
                            if f.cause != "no_backend":
                                self.outcomes.failed(cont.revision, cont.flow, f.cause)
                            no_pair = f.cause == "no_backend"
                            failure = failure if no_pair and failure is not None else f
                            self._avoid(ctx, f)
                            if no_pair or f.passthrough or not f.retryable:
                                break
                            continue
                        held.enter_context(attempt.pop_all())
                        ctx.revision, ctx.flow = cont.revision, cont.flow
                        return opened
                assert failure is not None
                if not no_pair or not await self._wait_for_a_pair(deadline, keepalive):
                    raise failure

    async def _wait_for_a_pair(self, deadline: float, keepalive: Keepalive) -> bool:
        """No pair takes a continuation now: wait until the pairing changes (True: try again) or ``deadline``
        passes (False), with an SSE comment to the client every KEEPALIVE_SECONDS (proxies cut idle streams)."""
        self.outcomes.migration_waiting(1)
        try:
            await keepalive()
            last = time.monotonic()
            while (left := deadline - time.monotonic()) > 0:
                if await self.changes.wait(min(left, last + KEEPALIVE_SECONDS - time.monotonic())):
                    return True
                if time.monotonic() - last >= KEEPALIVE_SECONDS:
                    await keepalive()
                    last = time.monotonic()
            return False
        finally:
            self.outcomes.migration_waiting(-1)

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

    def _decode_deadline(self, ctx: RequestContext) -> tuple[float, str]:
        """Until the decode leg's first byte: the KV wait when streaming, the whole answer otherwise."""
        return (self.cfg.leg_timeout, "kv_wait_timeout") if ctx.stream else (self.cfg.request_timeout, "decode_timeout")

    def _pick_decode(self, cands: Sequence[Backend]) -> Backend:
        return self.outcomes.picked(self.policies.decode(cands))

    async def _open_decode(
        self, req: LegRequest, d: Backend, params: dict[str, Any] | None, tl: Timeline, deadline: float | None, cause: str,
        held: contextlib.ExitStack,
    ) -> DecodeAnswer:
        answer = await self.legs.decode(req, d, params, tl, deadline, cause)
        if answer.resp is not None:
            held.callback(_discard, answer.resp)
        return answer

    def _pick(self, ctx: RequestContext) -> Candidates | None:
        snap = self.table.snapshot()
        for avoid in self._avoidance(ctx):  # fewer implicated engines avoided while nothing pairs: they may serve
            if (chosen := self.balancer.pick(snap, avoid)) is not None:
                return chosen
        return None

    async def _choose(self, ctx: RequestContext, retry: bool) -> Candidates:
        chosen = self._pick(ctx)
        if chosen is None and retry and len(self.balancer.ejections):
            # A retry that finds only engines ejected moments ago (they refused or dropped a connection: a pod Ready
            # before its server listens, a restarting engine) waits, up to a leg's deadline, for a probe to re-admit
            # one or any other change of the pairing: panic routing at once spent every retry on them within
            # milliseconds (a 502 in CI's kv-events rollout). An engine this request blamed that is re-admitted is
            # back (Comeback: a connection it refused or dropped took nothing of the request).
            comeback = Comeback({k for k in ctx.excluded if k in self.balancer.ejections})
            deadline = time.monotonic() + self.cfg.leg_timeout
            log.info("retry: every pair left has an ejected engine (%d ejected); waiting up to %gs for one to be re-admitted",
                     len(self.balancer.ejections), self.cfg.leg_timeout)  # fmt: skip
            with self.changes.watching(comeback, ctx.excluded):
                while chosen is None and len(self.balancer.ejections) and await self.changes.wait(deadline - time.monotonic()):
                    chosen = self._pick(ctx)
        if chosen is None and len(self.balancer.ejections):  # nor without the ejected ones (panic routing)
            chosen = self.balancer.pick(self.table.snapshot(), ctx.excluded, despite_ejections=True)
        if chosen is None:
            raise self._no_pair()
        return chosen

    async def _attempt(self, ctx: RequestContext, local: bool, retry: bool, held: contextlib.ExitStack) -> Opened:
        chosen = await self._choose(ctx, retry)
        rev = chosen.revision
        if chosen.despite_ejections:
            self.outcomes.despite_ejections(rev.revision, len(self.balancer.ejections))
        ctx.revision, ctx.flow = rev.revision, "local" if local else "push" if rev.mode == "Push" else "pull"
        self.outcomes.attempt(rev.revision, ctx.flow, retry)
        xid, transfer_id = mint_ids()
        req = LegRequest(ctx.kind, ctx.path, ctx.body, ctx.stream, ctx.auth, xid, transfer_id, ctx.token_ids)
        tl = Timeline(time.monotonic())
        if local:
            d = self._pick_decode(chosen.decode)
            held.enter_context(self.balancer.track(d))
            answer = await self._open_decode(req, d, None, tl, *self._decode_deadline(ctx), held)
            return Opened(xid, rev.revision, ctx.flow, d, answer, tl)
        p = self.outcomes.picked(self.policies.prefill(chosen.prefill, ctx.prompt_key()), ctx.tokens)
        if ctx.flow == "push":
            return await self.push_attempt(ctx, req, chosen, p, tl, held)
        return await self.sequential_attempt(ctx, req, rev, p, tl, held, lambda returned: pull_decode_params(transfer_id, returned))

    async def push_attempt(
        self, ctx: RequestContext, req: LegRequest, chosen: Candidates, p: Backend, tl: Timeline, held: contextlib.ExitStack
    ) -> Opened:
        """A push revision's attempt: both legs at once, D chosen up front with P's identity."""
        d = self._pick_decode(chosen.decode)
        params = p.identity.push_decode_params(engine_request_id(req.kind, req.xid), req.transfer_id)
        # The attempt keeps both legs' deadlines, so that when one passes the prefill is cancelled first.
        p_end = tl.start + self.cfg.leg_timeout
        d_timeout, d_cause = self._decode_deadline(ctx)
        d_end = tl.start + d_timeout
        held.enter_context(self.balancer.track(d))
        # P counts as in flight until D has its first token: P's KV is D's until then (its retirement waits).
        with self.balancer.track(p):
            p_task = asyncio.create_task(self.legs.prefill(req, p, "Push", tl, None))
            d_task = asyncio.create_task(self._open_decode(req, d, params, tl, None, d_cause, held))
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
                answer = d_task.result()
            except LegFailure as f:
                await abort_legs(p_task, d_task)
                raise push_failure(f, p_task, p, d) from None
            except BaseException:
                await abort_legs(p_task, d_task)
                raise
        return Opened(req.xid, chosen.revision.revision, "push", d, answer, tl, None if p_task.done() else p_task)

    async def sequential_attempt(
        self, ctx: RequestContext, req: LegRequest, rev: RevisionView, p: Backend, tl: Timeline, held: contextlib.ExitStack,
        decode_params: DecodeParams,
    ) -> Opened:
        """The prefill leg, then a decode chosen by load in P's revision, with ``decode_params`` of P's answer."""
        assert rev.mode is not None
        # P counts as in flight until D has its first token: in pull, D reads P's blocks only after P's leg ended.
        with self.balancer.track(p):
            returned = await self.legs.prefill(req, p, rev.mode, tl, self.cfg.leg_timeout)
            usable, despite_ejections = self.balancer.usable_decodes(self.table.snapshot(), p.revision, ctx.excluded)
            if not usable:
                raise LegFailure("no_backend", f"revision {p.revision} lost its decode engines", 503, ())
            if despite_ejections:
                self.outcomes.despite_ejections(p.revision, len(self.balancer.ejections))
            d = self._pick_decode(usable)
            held.enter_context(self.balancer.track(d))
            answer = await self._open_decode(req, d, decode_params(returned), tl, *self._decode_deadline(ctx), held)
        return Opened(req.xid, rev.revision, ctx.flow, d, answer, tl)
