"""The load generator: streaming completions at Poisson arrivals, and the arithmetic of its figures.

Definitions (those of vLLM's own serving benchmark):
- TTFT: request sent -> first streamed chunk with a choice;
- TPOT: (end - first token) / (output tokens - 1), output tokens from the response's `usage` when the
  server sends it (`stream_options.include_usage`), else the chunks counted;
- e2e: request sent -> `[DONE]`.
Direct dispatch (the client sends both legs itself, no router) also records when the prefill leg answered
and when the decode leg was sent, so TTFT splits into the prefill leg and what follows it (KV wait plus
the first decode step).

Two workloads:
- no-reuse (`run_cell`): independent random prompts of one length, Poisson arrivals; no two requests share a
  prefix, so a prefix cache never hits (the routing-neutral baseline);
- multi-turn (`multi_turn_sessions`, `run_sessions`): conversations. Sessions arrive as a Poisson process;
  every session's prompts start with the run's one system prompt; turn k sends the system prompt, the whole
  history (each earlier user message and answer) and a new user message; the next turn follows the answer
  after an exponential think time. The answer in the history is filler of exactly max_tokens words, not the
  text the server returned: the prompts are then fixed by the seed alone, so every routing mode of a cell is
  sent token sequences of the same lengths, and their counts are known without a tokenizer. A prefill
  engine never holds the answer's KV anyway (the decode engine generated it), so what it can reuse, the
  previous turn's prompt, is the same either way. A chat cell (`run_sessions(api="chat")`,
  `/v1/chat/completions`) resends the answers the server returned instead: its prompts follow the server's
  text, so its turns are a conversation as a chat client holds it, at lengths the seed no longer fixes.

Router replicas (`Replicas`): several routers behind one client, as a Service spreads clients over a router
Deployment's pods. A Service (kube-proxy) balances connections, not requests, so a client that keeps one
connection per conversation lands all its turns on one replica: `spread="session"` (round robin over sessions)
is that; `spread="request"` (round robin over requests) is a client pooling connections across conversations,
where a conversation's turns alternate between replicas and no replica saw the turn before.

Prompts are text (`w<id>` words) or, with `prompt_format="token-ids"`, the same words as token ids (the offline
test tokenizer's ids, so the same tokens either way): a token-id prompt is what the router matches exactly
against the engines' KV events (docs/router.md, "Policies"); text goes through its approximate index.

Percentiles interpolate linearly between order statistics (numpy's default), over successful requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Sequence

import aiohttp

from disagg_connector.contract import EngineIdentity
from disagg_connector.contract.vllm_pd import engine_request_id, mint_ids, prefill_body

# The offline test tokenizer (hack/gpu/make_model.py) maps word "w<id>" to token id <id>: 1..151642 are
# plain tokens, so a prompt of N such words is N tokens. Other tokenizers: `usage` says the real count.
WORD_IDS = range(1, 151643)
DISPATCHES = ("push", "push-sequential", "pull")
PROMPT_FORMATS = ("text", "token-ids")
SPREADS = ("session", "request")
API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}  # by the contract's name of each API


# --- pure arithmetic ----------------------------------------------------------------------------------
def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """Send times (seconds from the start) of n requests of a Poisson process of `rate` per second."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def thinned_arrivals(rate: Callable[[float], float], seconds: float, peak: float, rng: random.Random) -> Iterator[float]:
    """Send times (seconds from the start) of a Poisson process of rate RATE(t) <= PEAK over SECONDS, by thinning.
    A generator: a trace that draws its requests from RNG between arrivals stays the same for a seed."""
    t = 0.0
    while (t := t + rng.expovariate(peak)) < seconds:
        if rng.random() < rate(t) / peak:
            yield t


def random_prompt(tokens: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.choice(WORD_IDS)}" for _ in range(tokens))


def as_prompt(text: str, prompt_format: str = "text") -> str | list[int]:
    """A prompt of `w<id>` words as sent: the text, or ("token-ids") the ids the test tokenizer gives its words."""
    if prompt_format == "text":
        return text
    if prompt_format == "token-ids":
        return [int(w[1:]) for w in text.split()]
    raise ValueError(f"prompt format {prompt_format!r}: choose from {', '.join(PROMPT_FORMATS)}")


def requests_per_cell(rate: float, seconds: float, minimum: int) -> int:
    """Enough requests for `seconds` of arrivals at `rate`, and at least `minimum`."""
    return max(minimum, math.ceil(rate * seconds))


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy.percentile's default method)."""
    if not values:
        return math.nan
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Stats:
    mean: float
    p50: float
    p90: float
    p99: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Stats":
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        return cls(sum(values) / len(values), percentile(values, 50), percentile(values, 90), percentile(values, 99), len(values))


@dataclass
class RequestRecord:
    mode: str
    prompt_tokens: int
    rate: float
    index: int
    scheduled: float
    start: float = math.nan
    first_token: float = math.nan
    end: float = math.nan
    chunks: int = 0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    prefill_done: float = math.nan  # direct dispatch only
    decode_sent: float = math.nan  # direct dispatch only
    session: int | None = None  # multi-turn: the conversation and its turn (0 first)
    turn: int | None = None
    sent_prompt_tokens: int | None = None  # words sent (= tokens with the test tokenizer); multi-turn only
    request_id: str | None = None  # the router's X-Request-Id
    replica: int | None = None  # which router replica it was sent to (Replicas only)
    server_timing: str | None = None  # the router's Server-Timing (prefill, kv_wait, first_token in ms)
    answer: str | None = None  # the streamed text, kept only where it is "" before sending (a chat turn's history)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and not math.isnan(self.end) and self.chunks > 0

    @property
    def output_tokens(self) -> int:
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.chunks

    @property
    def ttft(self) -> float:
        return self.first_token - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float:
        n = self.output_tokens
        return (self.end - self.first_token) / (n - 1) if n > 1 else math.nan

    @property
    def prefill_leg(self) -> float:
        return self.prefill_done - self.start

    @property
    def after_prefill(self) -> float:
        """From the later of (prefill answered, decode sent) to decode's first token: KV wait + first step."""
        return self.first_token - max(self.prefill_done, self.decode_sent)

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        """Answered within both targets (an SLO's attainment): the first token within TTFT_S, TPOT within TPOT_S
        (an answer of one token has no TPOT to miss)."""
        return self.ok and self.ttft <= ttft_s and (math.isnan(self.tpot) or self.tpot <= tpot_s)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ok=self.ok, ttft=self.ttft, tpot=self.tpot, e2e=self.e2e, output_tokens=self.output_tokens,
                   prefill_leg=self.prefill_leg, after_prefill=self.after_prefill)
        return out


@dataclass(frozen=True)
class CellSummary:
    mode: str
    prompt_tokens: int
    rate: float
    sent: int
    ok: int
    failed: int
    unfinished: int
    duration_s: float
    measured_prompt_tokens: float
    output_tokens: float
    ttft: Stats
    tpot: Stats
    e2e: Stats
    prefill_leg: Stats
    after_prefill: Stats
    errors: dict[str, int] = field(default_factory=dict)
    workload: str = "no-reuse"
    sessions: int = 0  # multi-turn: conversations in the cell

    @property
    def key(self) -> tuple[int, float, str]:
        return (self.prompt_tokens, self.rate, self.mode)


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def summarize(records: Sequence[RequestRecord], workload: str = "no-reuse") -> CellSummary:
    first = records[0]
    good = [r for r in records if r.ok]
    unfinished = [r for r in records if r.error == "unfinished"]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.error or f"HTTP {r.status}"
            errors[key] = errors.get(key, 0) + 1
    starts = _finite(r.start for r in records)
    ends = _finite(r.end for r in good)
    usage_prompts = [r.usage_prompt_tokens for r in good if r.usage_prompt_tokens is not None]
    return CellSummary(
        mode=first.mode,
        prompt_tokens=first.prompt_tokens,
        rate=first.rate,
        sent=len(records),
        ok=len(good),
        failed=len(records) - len(good) - len(unfinished),
        unfinished=len(unfinished),
        duration_s=(max(ends) - min(starts)) if ends and starts else math.nan,
        measured_prompt_tokens=sum(usage_prompts) / len(usage_prompts) if usage_prompts else math.nan,
        output_tokens=sum(r.output_tokens for r in good) / len(good) if good else math.nan,
        ttft=Stats.of([r.ttft for r in good]),
        tpot=Stats.of(_finite(r.tpot for r in good)),
        e2e=Stats.of([r.e2e for r in good]),
        prefill_leg=Stats.of(_finite(r.prefill_leg for r in good)),
        after_prefill=Stats.of(_finite(r.after_prefill for r in good)),
        errors=errors,
        workload=workload,
        sessions=len({r.session for r in records if r.session is not None}),
    )


# --- SSE ------------------------------------------------------------------------------------------------
def parse_sse_event(line: bytes) -> dict[str, Any] | str | None:
    """One `data:` line of vLLM's stream: a JSON object, "[DONE]", or None for anything else."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return "[DONE]"
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any] | str]:
    """The events of a streamed answer as they come: JSON objects, then "[DONE]" (comments and blank lines skipped)."""
    async for line in resp.content:
        event = parse_sse_event(line)
        if event is not None:
            yield event


# --- targets ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterTarget:
    """Requests go to a router (any dispatch mode: the router's)."""

    url: str


@dataclass(frozen=True)
class DirectTarget:
    """The client dispatches both legs itself to one prefill and one decode engine, like the router would."""

    dispatch: str  # push | push-sequential | pull
    prefill_url: str
    decode_url: str
    prefill: EngineIdentity


Target = RouterTarget | DirectTarget


@dataclass(frozen=True)
class Replicas:
    """Router replicas behind one client: each request goes to one of `targets`, round robin over sessions
    (`spread="session"`: every turn of a conversation on one replica, as a Service balancing connections puts a
    client that keeps its connection) or over requests (`spread="request"`). Requests of no session (the
    no-reuse workload) go round robin by request."""

    targets: tuple[Target, ...]
    spread: str = "session"

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("router replicas: at least one target")
        if self.spread not in SPREADS:
            raise ValueError(f"replica spread {self.spread!r}: choose from {', '.join(SPREADS)}")

    def pick(self, request_index: int, session: int | None = None) -> tuple[int, Target]:
        """(replica index, its target) for a request (its index in the cell) of `session`."""
        k = (session if self.spread == "session" and session is not None else request_index) % len(self.targets)
        return k, self.targets[k]


def _resolve(target: Target | Replicas, rec: "RequestRecord") -> Target:
    """The target of one request; a replica pick is recorded in `rec.replica`."""
    if not isinstance(target, Replicas):
        return target
    rec.replica, chosen = target.pick(rec.index, rec.session)
    return chosen


def _streamed(model: str, max_tokens: int, **content: Any) -> dict[str, Any]:
    """A streamed request of exactly MAX_TOKENS tokens, with its CONTENT (a prompt or messages)."""
    return {
        "model": model,
        **content,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # exactly max_tokens tokens, whatever dummy weights predict
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def completion_body(model: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    return _streamed(model, max_tokens, prompt=prompt)


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """`completion_body`'s request for /v1/chat/completions."""
    return _streamed(model, max_tokens, messages=messages)


def _api(body: dict[str, Any]) -> str:
    """The OpenAI API a body is for, as the contract names it: "chat" (it has messages) or "completions"."""
    return "chat" if "messages" in body else "completions"


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
    async for event in sse_events(resp):
        if event == "[DONE]":
            rec.end = time.perf_counter()
            return
        assert isinstance(event, dict)
        if "error" in event:
            rec.error = f"stream error: {event['error'].get('message', event['error'])}"[:300]
            return
        if choices := event.get("choices"):
            if rec.chunks == 0:
                rec.first_token = time.perf_counter()
            rec.chunks += 1
            if rec.answer is not None:
                rec.answer += "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
        usage = event.get("usage")
        if usage:
            rec.usage_prompt_tokens = usage.get("prompt_tokens")
            rec.usage_completion_tokens = usage.get("completion_tokens")
    rec.error = rec.error or "stream ended without [DONE]"


async def _stream_post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], rec: RequestRecord) -> None:
    async with session.post(url, json=body, headers=headers) as resp:
        rec.status = resp.status
        rec.request_id = resp.headers.get("X-Request-Id")
        rec.server_timing = resp.headers.get("Server-Timing")
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        await _read_stream(resp, rec)


async def _prefill(
    session: aiohttp.ClientSession, t: DirectTarget, api: str, body: dict[str, Any], xid: str, transfer_id: str,
    rec: RequestRecord,
) -> dict[str, Any]:
    leg = prefill_body(api, body, transfer_id)
    async with session.post(t.prefill_url + API_PATHS[api], json=leg, headers={"X-Request-Id": xid}) as resp:
        data = await resp.read()
        rec.prefill_done = time.perf_counter()
        if resp.status != 200:
            raise RuntimeError(f"prefill leg HTTP {resp.status}: {data[:200]!r}")
        answer = json.loads(data)
    return answer.get("kv_transfer_params") or {}


async def send(session: aiohttp.ClientSession, target: Target, body: dict[str, Any], rec: RequestRecord) -> None:
    """One request, recorded in `rec`; never raises for a failed request."""
    rec.start = time.perf_counter()
    api = _api(body)
    try:
        if isinstance(target, RouterTarget):
            await _stream_post(session, target.url + API_PATHS[api], body, {}, rec)
            return
        xid, transfer_id = mint_ids()  # the router's ids and legs (router/dispatch.py), without the router
        decode_url = target.decode_url + API_PATHS[api]
        headers = {"X-Request-Id": xid}
        if target.dispatch == "push":
            params = target.prefill.push_decode_params(engine_request_id(api, xid), transfer_id)
            rec.decode_sent = rec.start
            prefill = asyncio.create_task(_prefill(session, target, api, body, xid, transfer_id, rec))
            try:
                await _stream_post(session, decode_url, {**body, "kv_transfer_params": params}, headers, rec)
            finally:
                if not prefill.done():
                    prefill.cancel()
                await asyncio.gather(prefill, return_exceptions=True)
            if prefill.done() and not prefill.cancelled() and prefill.exception() and rec.error is None:
                rec.error = str(prefill.exception())[:300]
            return
        returned = await _prefill(session, target, api, body, xid, transfer_id, rec)
        if target.dispatch == "pull":
            params = {"transfer_id": transfer_id, **returned}
        else:  # push-sequential: P's identity known up front, its internal request id from its answer
            rid = returned.get("remote_request_id") or engine_request_id(api, xid)
            params = target.prefill.push_decode_params(rid, transfer_id)
        rec.decode_sent = time.perf_counter()
        await _stream_post(session, decode_url, {**body, "kv_transfer_params": params}, headers, rec)
    except asyncio.CancelledError:
        rec.error = rec.error or "unfinished"
        raise
    except (aiohttp.ClientError, OSError, RuntimeError, ValueError, asyncio.TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]


async def run_cell(
    session: aiohttp.ClientSession,
    target: Target | Replicas,
    *,
    mode: str,
    model: str,
    prompt_tokens: int,
    rate: float,
    n: int,
    max_tokens: int,
    arrival_rng: random.Random,
    prompt_rng: random.Random,
    drain_timeout: float,
    prompt_format: str = "text",
) -> list[RequestRecord]:
    """n requests at Poisson arrivals; those still running `drain_timeout` s after the last arrival are
    cancelled and recorded as unfinished. Modes compared in one cell get the same `arrival_rng` seed."""
    arrivals = poisson_arrivals(rate, n, arrival_rng)
    records = [RequestRecord(mode, prompt_tokens, rate, i, a) for i, a in enumerate(arrivals)]
    bodies = [completion_body(model, as_prompt(random_prompt(prompt_tokens, prompt_rng), prompt_format), max_tokens) for _ in records]
    return await run_requests(session, target, records, bodies, drain_timeout)


async def run_requests(
    session: aiohttp.ClientSession,
    target: Target | Replicas,
    records: Sequence[RequestRecord],
    bodies: Sequence[dict[str, Any]],
    drain_timeout: float,
) -> list[RequestRecord]:
    """Each body sent at its record's `scheduled` time (seconds from now) whatever the others are doing (open
    loop); those still running `drain_timeout` s after the last is sent are cancelled and recorded unfinished."""
    t0 = time.perf_counter()

    async def one(rec: RequestRecord, body: dict[str, Any]) -> None:
        await asyncio.sleep(max(0.0, t0 + rec.scheduled - time.perf_counter()))
        await send(session, _resolve(target, rec), body, rec)

    tasks = [asyncio.create_task(one(r, b)) for r, b in zip(records, bodies)]
    await _ended_by(tasks, max(r.scheduled for r in records) + drain_timeout, records)
    return list(records)


async def _ended_by(tasks: list[asyncio.Task[None]], timeout: float, records: Iterable[RequestRecord]) -> None:
    """Wait up to TIMEOUT s for TASKS, cancel what still runs, and record each request not sent or not
    answered in full as unfinished."""
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for rec in records:
        if math.isnan(rec.start) or (rec.error is None and math.isnan(rec.end)):
            rec.error = "unfinished"


# --- multi-turn conversations ------------------------------------------------------------------------------
@dataclass(frozen=True)
class MultiTurnWorkload:
    """The shape of a multi-turn cell: sessions per second (Poisson), turns per session, the shared system
    prompt's and each user message's tokens, the answer's tokens (the request's max_tokens), the mean think
    time between an answer and the next turn (exponential)."""

    session_rate: float
    sessions: int
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int
    think_time: float

    def __post_init__(self) -> None:
        if self.turns < 1 or self.sessions < 1:
            raise ValueError("a multi-turn cell needs at least one session of at least one turn")
        if min(self.system_tokens, self.user_tokens, self.answer_tokens) < 0 or self.think_time < 0:
            raise ValueError("token counts and think time cannot be negative")

    def prompt_tokens(self, turn: int) -> int:
        """Tokens of turn `turn`'s prompt: system + every earlier (user + answer) + this user message."""
        return self.system_tokens + turn * (self.user_tokens + self.answer_tokens) + self.user_tokens

    def ideal_hit_ratio(self, block_size: int = 1) -> float:
        """The prefix hit ratio of one engine that holds everything and never evicts: turn 0 reuses the system
        prompt (but the first session's), turn k the whole prompt of turn k-1; only full blocks hit, as in
        vLLM, and never the prompt's last token. Over all prompts of the cell."""
        def cached(reusable: int, prompt: int) -> int:
            return min(reusable, prompt - 1) // block_size * block_size

        hits = queries = 0
        for s in range(self.sessions):
            for k in range(self.turns):
                prompt = self.prompt_tokens(k)
                reusable = self.prompt_tokens(k - 1) if k else (self.system_tokens if s else 0)
                hits += cached(reusable, prompt)
                queries += prompt
        return hits / queries if queries else math.nan


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    prompt: str  # the whole prompt: the system prompt, the history with filler answers, this turn's message
    prompt_tokens: int
    think_before: float  # seconds between the previous turn's answer and this turn (0 for the first)
    message: str = ""  # this turn's user message alone (a chat resends the history itself)


@dataclass(frozen=True)
class Session:
    index: int
    arrival: float  # seconds from the cell's start
    turns: tuple[Turn, ...]
    system: str = ""  # the system prompt alone


def _words(tokens: int, rng: random.Random) -> list[str]:
    return [f"w{rng.choice(WORD_IDS)}" for _ in range(tokens)]


def multi_turn_sessions(w: MultiTurnWorkload, timing_seed: int, content_seed: int) -> list[Session]:
    """The sessions of one cell. Arrivals and think times come from `timing_seed` (give every mode of a cell
    the same), the words from `content_seed` (give each mode its own: engines shared by the modes of a run
    would otherwise hold the previous mode's conversations in their prefix caches). Each session draws from
    its own generator, so a session's content does not depend on how many there are."""
    arrivals = poisson_arrivals(w.session_rate, w.sessions, random.Random(f"{timing_seed}/arrivals"))
    system = _words(w.system_tokens, random.Random(f"{content_seed}/system"))
    sessions = []
    for i, arrival in enumerate(arrivals):
        timing, content = random.Random(f"{timing_seed}/session/{i}"), random.Random(f"{content_seed}/session/{i}")
        history, turns = list(system), []
        for k in range(w.turns):
            think = timing.expovariate(1 / w.think_time) if k and w.think_time > 0 else 0.0
            message = _words(w.user_tokens, content)
            history += message
            turns.append(Turn(i, k, " ".join(history), len(history), think, " ".join(message)))
            history += _words(w.answer_tokens, content)  # stands for the answer (see the module's docstring)
        sessions.append(Session(i, arrival, tuple(turns), " ".join(system)))
    return sessions


def session_records(sessions: Sequence[Session], mode: str, cell_tokens: int, rate: float) -> list[list[RequestRecord]]:
    """One record per turn, per session; `scheduled` is the turn's nominal time (arrival plus the think times
    before it; later turns also wait for the answers before them)."""
    out, index = [], 0
    for s in sessions:
        recs, nominal = [], s.arrival
        for t in s.turns:
            nominal += t.think_before
            recs.append(RequestRecord(mode, cell_tokens, rate, index, nominal, session=s.index, turn=t.turn,
                                      sent_prompt_tokens=t.prompt_tokens))
            index += 1
        out.append(recs)
    return out


def session_deadline(sessions: Sequence[Session], drain_timeout: float) -> float:
    """Seconds from the cell's start after which turns still running (or not yet sent) are cancelled: the
    last session's nominal end (arrival plus its think times) plus `drain_timeout`."""
    return max(s.arrival + sum(t.think_before for t in s.turns) for s in sessions) + drain_timeout


async def run_sessions(
    session: aiohttp.ClientSession,
    target: Target | Replicas,
    sessions: Sequence[Session],
    *,
    mode: str,
    model: str,
    cell_tokens: int,
    rate: float,
    max_tokens: int,
    drain_timeout: float,
    prompt_format: str = "text",
    api: str = "completions",
) -> list[RequestRecord]:
    """Every session's turns in order, each after the previous turn's answer and its think time; sessions
    start at their arrivals. With `api="completions"` each turn sends its whole prompt, and a failed turn does
    not end its session (the next prompt does not depend on the answer). With `api="chat"` each turn sends the
    system prompt and the conversation so far (every earlier message and the answer the server streamed) to
    /v1/chat/completions, and a failed turn ends its session (there is no answer to resend). Turns not answered
    by the deadline (`session_deadline`) or never sent are recorded unfinished. With `Replicas`, each turn goes
    to the replica its spread picks."""
    if api not in API_PATHS:
        raise ValueError(f"multi-turn api {api!r}: choose from {', '.join(API_PATHS)}")
    if api == "chat" and prompt_format != "text":
        raise ValueError("a chat's messages are text: prompt_format must be 'text' with api='chat'")
    records = session_records(sessions, mode, cell_tokens, rate)
    t0 = time.perf_counter()

    async def converse(s: Session, recs: list[RequestRecord]) -> None:
        await asyncio.sleep(max(0.0, t0 + s.arrival - time.perf_counter()))
        for t, rec in zip(s.turns, recs):
            await asyncio.sleep(t.think_before)
            await send(session, _resolve(target, rec), completion_body(model, as_prompt(t.prompt, prompt_format), max_tokens), rec)

    async def chat(s: Session, recs: list[RequestRecord]) -> None:
        await asyncio.sleep(max(0.0, t0 + s.arrival - time.perf_counter()))
        messages = [{"role": "system", "content": s.system}]
        for t, rec in zip(s.turns, recs):
            await asyncio.sleep(t.think_before)
            messages.append({"role": "user", "content": t.message})
            rec.answer, rec.sent_prompt_tokens = "", sum(len(m["content"].split()) for m in messages)
            await send(session, _resolve(target, rec), chat_body(model, messages, max_tokens), rec)
            if not rec.ok:
                return
            messages.append({"role": "assistant", "content": rec.answer})

    play = chat if api == "chat" else converse
    tasks = [asyncio.create_task(play(s, r)) for s, r in zip(sessions, records)]
    flat = [rec for recs in records for rec in recs]
    await _ended_by(tasks, session_deadline(sessions, drain_timeout), flat)
    return flat
