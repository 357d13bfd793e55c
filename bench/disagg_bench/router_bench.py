"""Router benchmark: headroom against a direct client and vllm-router, and when disaggregation pays for short prompts.

    python -m disagg_bench.router_bench                  # about 25 min (the peers section about 19)
    python -m disagg_bench.router_bench --quick          # about 6 min, one run per cell
    python -m disagg_bench.router_bench --skip-peers     # about 5 min: headroom, index fill, JSON, short prompts
    python -m disagg_bench.router_bench --toy-proxy PATH # also vLLM's toy proxy (its file, fetched by you)
    python -m disagg_bench.router_bench --only-cpu       # about 6 min: the router's CPU per request by policy pair
    python -m disagg_bench.router_bench --only-cpu --cpu-compare DIR/connector  # and another checkout's, interleaved

Everything runs as separate processes on this machine: simulated vLLM engines (``disagg_bench.vllm_sim``), the
real router (``disagg_connector.router``) and the client. Every figure is a median of ``--runs`` runs
(default 3), the runs of all contenders of a cell interleaved, so machine noise hits them alike.

1. **Headroom.** Streaming completions (64-word prompts, 32 output tokens) by a closed loop of N concurrent
   streams. The baseline is a *direct client*: it sends both legs of every request itself, concurrently, with
   the router's protocol (fresh ids, P's identity in the decode leg), straight to the engines: the router's
   work without the router. Compared: requests per second (router / direct) and the median end-to-end
   latency (added = router - direct). Two engine models: *zero-cost* (no compute, no transfer: what the
   router itself costs, on a CPU it shares with the engines and the client) and *timed* (the simulator's
   timing model at 10 ms per output token: engines that take time, as real ones do); and timed again with
   the router on a core of its own and the engines and the client on the other (``sched_setaffinity``; the
   direct client there too), as in a cluster, where the router's pod has its own CPU. With ``--toy-proxy``,
   vLLM's ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` (pull, sequential legs) runs on
   pull engines beside a pull router: fetch it yourself (it is not part of this repository) and install
   what it imports (measured with fastapi==0.163.2 uvicorn==0.54.0 httpx==0.28.1).
2. **Short prompts: disaggregate or not.** Timed engines (the simulator's defaults: Qwen3-32B-like KV,
   H200-like prefill, 100 GB/s link), one prefill and one decode engine, push. Requests at a fixed rate with
   long-running background streams on the decode engine; per prompt length, the mean TTFT of the probe
   requests and the background streams' mean time per output token, disaggregated vs local (the decode
   engine prefills: ``--disaggregation-threshold-tokens`` above the prompt).
3. **Peers** (issue 19): two prefill and two decode engines per transfer mode (push, then pull), zero-cost and
   timed (``--peer-engines``), 64 streams (``--peer-streams``): the direct client (both legs itself, the pairs
   in turn), this router with every pair of ``--prefill-policy`` x ``--decode-policy`` and vllm-router
   (PyPI, started by ``disagg_bench.localrun.plan.peer_router_argv``) with each of its policies for both roles,
   all on the same engines, each client ``disagg_bench.localrun.loadgen.send``; runs interleaved, each run
   starting one contender later. Two prompt sets: the 64-word prompt above, and 16 shared 1024-word prefixes
   each followed by a request number and 128 more words, so that every request gives the prefix index new
   chunks after a prefix it holds (the notes say how large the index grew, and which vllm-router path, sequential
   or concurrent push, its prefill legs took). Ratios: to the direct client, to vllm-router round_robin and to
   vllm-router's best policy in the same cell.
4. **Prefix index fill**: one prefill pick of the router's own policy code against how full the prefix index
   is (0 to its cap of 500k chunks), prefix-and-load and least-outstanding: the cost must not grow with the index.
5. **JSON per request**: the router parses the client's body and writes both legs' bodies; the standard
   library against orjson (which the router uses), per prompt length.
6. **Router CPU per request** (issue 19: the router's cost must not grow with the new policies): each policy pair's
   router on the same 2P+2D zero-cost engines under the same closed loop (the peers' prompts, 64 streams), the router
   process's own CPU seconds (``/proc/<pid>/task/*/schedstat``) over the requests it completed, runs interleaved; against
   least-outstanding/least-outstanding. On a busy machine throughput swings with what else runs; the CPU a
   request takes much less. ``--cpu-compare`` runs another checkout's routers beside these: before and after, in
   one run.
7. **Policy work per request**: the chunk keys and both picks of each pair, in process, in CPU microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
from disagg_bench.localrun import loadgen
from disagg_bench.localrun.bench import PEER_ROUTER_PREFIX, parse_series
from disagg_bench.localrun.plan import PEER_POLICIES, peer_router_argv
from disagg_bench.localrun.report import peer_router_paths
from disagg_connector.contract import EngineIdentity
from disagg_connector.router.config import DECODE_POLICIES, PREFILL_POLICIES

from disagg_bench.vllm_sim import harness as h
from disagg_bench.vllm_sim.sim import Timing

ZERO = {
    "prefill_us_per_token": 0.0,
    "tpot_ms": 0.0,
    "step_ms": 0.0,
    "registration_rtt_ms": 0.0,
    "kv_bytes_per_token": 0,
    "descriptor_prep_us_per_block": 0.0,
}
TIMED = {"prefill_us_per_token": 20.0, "tpot_ms": 10.0, "step_ms": 10.0, "registration_rtt_ms": 0.5}
BODY = h.completion(prompt_words=64, max_tokens=32, stream=True)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


@dataclasses.dataclass
class Cell:
    rps: float
    p50_ms: float
    n: int = 0  # requests completed


async def closed_loop(fn: Callable[[], Awaitable[None]], concurrency: int, seconds: float) -> Cell:
    """`concurrency` workers, each one request after another, for `seconds` (after a short warm-up)."""
    lat: list[float] = []
    end = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < end:
            t = time.perf_counter()
            await fn()
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Cell(len(lat) / (time.perf_counter() - t0), pct(lat, 50) * 1e3, len(lat))


async def read_stream(r: aiohttp.ClientResponse) -> None:
    assert r.status == 200, (r.status, await r.text())
    data = await r.read()
    assert data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data, data[-200:]


def direct_push(s: aiohttp.ClientSession, P: h.Sim, D: h.Sim) -> Callable[[], Awaitable[None]]:
    """Both legs of the router's push protocol, sent by the client itself."""

    async def call() -> None:
        xid = uuid.uuid4().hex
        tid = f"xfer-{xid}"
        p_body = {**BODY, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}
        params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": P.engine_id, "remote_host": h.HOST,
            "remote_port": P.side_port, "tp_size": 1, "pp_size": 1, "remote_request_id": f"cmpl-{xid}-0", "transfer_id": tid,
        }  # fmt: skip
        headers = {"X-Request-Id": xid}

        async def prefill() -> None:
            async with s.post(P.url + "/v1/completions", json=p_body, headers=headers) as r:
                await r.read()

        async def decode() -> None:
            async with s.post(D.url + "/v1/completions", json={**BODY, "kv_transfer_params": params}, headers=headers) as r:
                await read_stream(r)

        await asyncio.gather(prefill(), decode())

    return call


def through(s: aiohttp.ClientSession, url: str) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        async with s.post(url + "/v1/completions", json=BODY) as r:
            await read_stream(r)

    return call


def start_toy_proxy(path: Path, log_dir: Path, P: h.Sim, D: h.Sim) -> tuple[h.Proc, str]:
    port = h.free_port()
    argv = [sys.executable, str(path), "--host", h.HOST, "--port", str(port), "--prefiller-hosts", h.HOST,
            "--prefiller-ports", str(P.port), "--decoder-hosts", h.HOST, "--decoder-ports", str(D.port)]  # fmt: skip
    proc = h.Proc("toy-proxy", argv, log_dir)
    url = f"http://{h.HOST}:{port}"
    h.wait_until(lambda: proc.alive() and h.http_get(url + "/healthcheck", timeout=2)[0] < 500, 60, what="toy proxy up")
    return proc, url


async def headroom(log_dir: Path, levels: list[int], seconds: float, runs: int, toy_proxy: Path | None) -> list[str]:
    out = ["", "## Headroom: streaming completions (64-word prompt, 32 output tokens), closed loop, medians of "
           f"{runs} run(s) of {seconds:g} s per cell",
           "", "| engines | streams | direct req/s | router req/s | router/direct | direct p50 ms | router p50 ms | added p50 ms |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    toy_rows: list[str] = []
    variants = [("zero-cost", ZERO, False), ("timed 10 ms/token", TIMED, False)]
    if len(os.sched_getaffinity(0)) >= 2:
        variants.append(("timed, router on its own core", TIMED, True))
    for label, timing, pinned in variants:
        tag = f"{label[:4]}{'-pin' if pinned else ''}"
        P = h.launch_sim(log_dir, "prefill", "push", revision=tag, **timing)
        D = h.launch_sim(log_dir, "decode", "push", revision=tag, **timing)
        static = log_dir / f"headroom-{tag}.json"
        h.write_static(static, [P.static_entry(), D.static_entry()])
        R = h.launch_router(log_dir, static, "push", name=f"router-{tag}")
        procs: list[Any] = [R, P, D]
        toy_url = None
        everywhere = os.sched_getaffinity(0)
        if pinned:  # as in a cluster, where the router's pod has a CPU of its own: it on one core, the rest on another
            cores = sorted(everywhere)
            for proc in (P.proc, D.proc):
                os.sched_setaffinity(proc.pid, {cores[0]})
            os.sched_setaffinity(0, {cores[0]})
            os.sched_setaffinity(R.proc.pid, {cores[1]})
        try:
            if toy_proxy is not None and label == "zero-cost":
                Pp = h.launch_sim(log_dir, "prefill", "pull", revision="toy", **timing)
                Dp = h.launch_sim(log_dir, "decode", "pull", revision="toy", **timing)
                static_pull = log_dir / "headroom-pull.json"
                h.write_static(static_pull, [Pp.static_entry(), Dp.static_entry()])
                Rp = h.launch_router(log_dir, static_pull, "pull", name="router-pull")
                procs += [Rp, Pp, Dp]
                await asyncio.to_thread(h.wait_ready, Pp, Dp, Rp)
                toy, toy_url = start_toy_proxy(toy_proxy, log_dir, Pp, Dp)
                procs.append(type("T", (), {"proc": toy})())
            await asyncio.to_thread(h.wait_ready, P, D, R)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)) as s:
                contenders = {"direct": direct_push(s, P, D), "router": through(s, R.url)}
                if toy_url:
                    contenders |= {"router-pull": through(s, Rp.url), "toy-proxy": through(s, toy_url)}
                for fn in contenders.values():  # warm up connections and code paths
                    await closed_loop(fn, 4, 0.5)
                for c in levels:
                    cells: dict[str, list[Cell]] = {name: [] for name in contenders}
                    for _ in range(runs):
                        for name, fn in contenders.items():
                            cells[name].append(await closed_loop(fn, c, seconds))
                    med = {name: Cell(statistics.median(x.rps for x in v), statistics.median(x.p50_ms for x in v)) for name, v in cells.items()}
                    d, r = med["direct"], med["router"]
                    out.append(f"| {label} | {c} | {d.rps:.0f} | {r.rps:.0f} | {r.rps / d.rps:.2f} | {d.p50_ms:.1f} | {r.p50_ms:.1f} | {r.p50_ms - d.p50_ms:.1f} |")
                    if toy_url:
                        rp, t = med["router-pull"], med["toy-proxy"]
                        toy_rows.append(f"| {c} | {rp.rps:.0f} | {t.rps:.0f} | {rp.rps / t.rps:.2f} | {rp.p50_ms:.1f} | {t.p50_ms:.1f} |")
        finally:
            h.stop_all(*procs)
            os.sched_setaffinity(0, everywhere)
    if toy_rows:
        out += ["", "vLLM's toy proxy (pull, zero-cost engines), against this router in pull mode:", "",
                "| streams | router req/s | toy proxy req/s | router/toy | router p50 ms | toy p50 ms |", "|---|---|---|---|---|---|", *toy_rows]  # fmt: skip
    return out


# --- Peers: every policy of this router and of vllm-router, on the same engines ----------------------------
OUR_POLICIES = [(p, d) for p in PREFILL_POLICIES for d in DECODE_POLICIES]
# Every policy of vllm-router 0.1.17 (plan.PEER_POLICIES and kv_aware). kv_aware runs without its KV event
# sources: following the simulator's publisher (--kv-event-source) would need the model's tokenizer to hash text
# prompts, which this offline bench does not have; without sources it has no cache information (what it then
# weighs instead is not examined here).
PEER_POLICIES_MEASURED = (*PEER_POLICIES, "kv_aware")
PEER_PAIRS = 2  # prefill and decode engines per transfer mode: two of each, so that every policy has a choice
SHARED_PREFIXES = 16
PREFIX_WORDS = 1024
SUFFIX_WORDS = 128


class Prompts:
    """The request bodies of a cell, one after another (the same sequence for every contender's client).

    ``short``: the headroom section's 64-word prompt, every time the same. ``shared-prefix``: one of
    SHARED_PREFIXES system prompts of PREFIX_WORDS random words (a word is a token to the simulator, about
    1.6 to the router's 4-bytes-a-token estimate), then a request number and SUFFIX_WORDS more: every request
    brings chunks the prefix index has not seen (it grows all along) after a prefix it has."""

    def __init__(self, kind: str, max_tokens: int = 32, seed: int = 19) -> None:
        self.kind, self.max_tokens, self.n = kind, max_tokens, 0
        rng = random.Random(seed)
        self.prefixes = [loadgen.random_prompt(PREFIX_WORDS, rng) for _ in range(SHARED_PREFIXES)]
        self.suffixes = [loadgen.random_prompt(SUFFIX_WORDS, rng) for _ in range(61)]  # prime: pairs vary

    def next(self) -> dict[str, Any]:
        self.n += 1
        if self.kind == "short":
            prompt = BODY["prompt"]
        else:
            prompt = f"{self.prefixes[self.n % SHARED_PREFIXES]} q{self.n} {self.suffixes[self.n % len(self.suffixes)]}"
        return loadgen.completion_body(h.MODEL, prompt, self.max_tokens)

    @property
    def label(self) -> str:
        if self.kind == "short":
            return "64 words"
        return f"{SHARED_PREFIXES} prefixes x {PREFIX_WORDS} + {SUFFIX_WORDS} words"


@dataclasses.dataclass
class PeerRouter:
    """vllm-router 0.1.17 (plan.peer_router_argv's command line) on these engines."""

    proc: h.Proc
    port: int
    metrics_port: int
    policy: str

    @property
    def url(self) -> str:
        return f"http://{h.HOST}:{self.port}"

    def ready(self) -> bool:
        return h.http_get(self.url + "/health", timeout=2)[0] == 200

    def prefill_paths(self) -> tuple[float, float]:
        """Its prefill legs so far as (sequential, concurrent push), from its own counters."""
        text = h.http_get(f"http://{h.HOST}:{self.metrics_port}/metrics")[1].decode()
        counters = {key: float(v) for key, _, v in (line.rpartition(" ") for line in text.splitlines())
                    if key.startswith(PEER_ROUTER_PREFIX) and "_bucket" not in key and v.replace(".", "", 1).isdigit()}  # fmt: skip
        return peer_router_paths(counters)


def launch_peer_router(log_dir: Path, prefills: list[h.Sim], decodes: list[h.Sim], policy: str, name: str) -> PeerRouter:
    """vllm-router with `policy` for both roles (plan.peer_router_argv sets the prefill's; the decode's is added)."""
    port, metrics_port = h.free_ports(2)
    engines = [types.SimpleNamespace(role=s.role, url=s.url, pods=1) for s in (*prefills, *decodes)]
    argv = [sys.executable, "-m", "vllm_router.launch_router",
            *peer_router_argv(engines, h.HOST, port, metrics_port, policy), "--decode-policy", policy]  # type: ignore[arg-type]
    return PeerRouter(h.Proc(name, argv, log_dir), port, metrics_port, policy)


def wait_peer_router(log_dir: Path, R: PeerRouter, prefills: list[h.Sim], decodes: list[h.Sim], attempts: int = 3) -> PeerRouter:
    """R ready; started again on other ports when a port it was given was taken before it bound it (free_ports
    cannot reserve them: vllm-router then panics, "Address already in use")."""
    for attempt in range(1, attempts + 1):
        try:
            h.wait_ready(R, timeout=120)
            return R
        except (RuntimeError, TimeoutError):
            if attempt == attempts or "Address already in use" not in R.proc.log_text():
                raise
            R.proc.stop()
            R = launch_peer_router(log_dir, prefills, decodes, R.policy, f"{R.proc.name}-{attempt}")
    raise AssertionError("unreachable")


def direct_pairs(s: aiohttp.ClientSession, dispatch: str, prefills: list[h.Sim], decodes: list[h.Sim], prompts: Prompts) -> Callable[[], Awaitable[None]]:
    """The client sends both legs itself (loadgen.send's DirectTarget: the router's protocol), pairs in turn."""
    pairs = itertools.cycle([
        loadgen.DirectTarget(dispatch, P.url, D.url, EngineIdentity(P.engine_id, h.HOST, P.side_port, 1, 1, http_port=P.port))
        for P, D in zip(prefills, decodes)
    ])  # fmt: skip
    return sent_to(s, lambda: next(pairs), prompts)


def sent_to(s: aiohttp.ClientSession, target: Callable[[], loadgen.Target], prompts: Prompts) -> Callable[[], Awaitable[None]]:
    """One request by loadgen.send (the same client work for every contender); a failed one stops the bench."""

    async def call() -> None:
        rec = loadgen.RequestRecord("peers", 0, 0.0, 0, 0.0)
        await loadgen.send(s, target(), prompts.next(), rec)
        if not rec.ok:
            raise RuntimeError(f"request failed: {rec.error or rec.status}")

    return call


@dataclasses.dataclass
class Contender:
    name: str
    kind: str  # direct | ours | vllm-router
    fn: Callable[[], Awaitable[None]]
    router: Any = None


async def peers(log_dir: Path, engine_models: list[tuple[str, dict[str, float]]], prompt_kinds: list[str], levels: list[int],
                seconds: float, runs: int) -> list[str]:
    """Per engine model, prompt set and stream count: the direct client, this router with each policy pair and
    vllm-router with each policy, push and pull; medians of `runs` interleaved runs."""
    rows: list[str] = []
    notes: list[str] = []
    for label, timing in engine_models:
        for transfer in ("push", "pull"):
            tag = f"peers-{label[:4]}-{transfer}"
            prefills = [h.launch_sim(log_dir, "prefill", transfer, revision=tag, **timing) for _ in range(PEER_PAIRS)]
            decodes = [h.launch_sim(log_dir, "decode", transfer, revision=tag, **timing) for _ in range(PEER_PAIRS)]
            static = log_dir / f"{tag}.json"
            h.write_static(static, [e.static_entry() for e in (*prefills, *decodes)])
            ours = {f"ours {p}/{d}": h.launch_router(log_dir, static, transfer, extra=["--prefill-policy", p, "--decode-policy", d],
                                                     name=f"router-{tag}-{p}-{d}") for p, d in OUR_POLICIES}  # fmt: skip
            theirs = {f"vllm-router {p}": launch_peer_router(log_dir, prefills, decodes, p, f"vllmrouter-{tag}-{p}") for p in PEER_POLICIES_MEASURED}
            everything = [*ours.values(), *theirs.values(), *prefills, *decodes]
            try:
                await asyncio.to_thread(h.wait_ready, *prefills, *decodes)
                await asyncio.to_thread(h.wait_ready, *ours.values(), timeout=120)
                for name, R in theirs.items():
                    theirs[name] = await asyncio.to_thread(wait_peer_router, log_dir, R, prefills, decodes)
                everything = [*ours.values(), *theirs.values(), *prefills, *decodes]
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)) as s:
                    for kind in prompt_kinds:
                        prompts = Prompts(kind)
                        contenders = [Contender("direct", "direct", direct_pairs(s, transfer, prefills, decodes, prompts))]
                        contenders += [Contender(n, "ours", sent_to(s, lambda u=R.url: loadgen.RouterTarget(u), prompts), R) for n, R in ours.items()]
                        contenders += [Contender(n, "vllm-router", sent_to(s, lambda u=R.url: loadgen.RouterTarget(u), prompts), R) for n, R in theirs.items()]
                        for c in contenders:  # warm up connections and code paths (vllm-router learns push here)
                            await closed_loop(c.fn, 4, 0.5)
                        for streams in levels:
                            cells: dict[str, list[Cell]] = {c.name: [] for c in contenders}
                            for run in range(runs):  # each run starts one contender later: a drift hits all alike
                                for c in contenders[run % len(contenders):] + contenders[:run % len(contenders)]:
                                    cells[c.name].append(await closed_loop(c.fn, streams, seconds))
                            rows += peer_rows(label, prompts.label, transfer, streams, contenders, cells)
                        notes += [peer_index_note(label, prompts.label, transfer, ours), peer_paths_note(label, prompts.label, transfer, theirs)]
            finally:
                h.stop_all(*everything, *theirs.values())
    return ["", f"## Peers: every policy of this router and of vllm-router {metadata.version('vllm-router')}, on the same "
            f"{PEER_PAIRS} prefill + {PEER_PAIRS} decode engines, streaming completions (32 output tokens), closed loop, "
            f"medians of {runs} run(s) of {seconds:g} s per cell, contenders interleaved",
            "", "Ours: --prefill-policy/--decode-policy; vllm-router: --prefill-policy and --decode-policy both the policy "
            "named (kv_aware without KV event sources: they would need the model's tokenizer). The direct "
            "client sends both legs itself, pairs in turn. Every client is loadgen.send (the same client work). "
            "/rr: against vllm-router round_robin of the same cell; /best: against its best policy there.",
            "", "| engines | prompts | transfer | streams | contender | req/s | p50 ms | /direct | /rr | /best |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows, "", *notes]


def peer_rows(engines: str, prompts: str, transfer: str, streams: int, contenders: list[Contender], cells: dict[str, list[Cell]]) -> list[str]:
    med = {n: Cell(statistics.median(x.rps for x in v), statistics.median(x.p50_ms for x in v)) for n, v in cells.items()}
    direct = med["direct"].rps
    rr = med["vllm-router round_robin"].rps
    best = max(med[c.name].rps for c in contenders if c.kind == "vllm-router")
    out = []
    for c in contenders:
        m = med[c.name]
        out.append(f"| {engines} | {prompts} | {transfer} | {streams} | {c.name} | {m.rps:.0f} | {m.p50_ms:.1f} | "
                   f"{m.rps / direct:.2f} | {m.rps / rr:.2f} | {m.rps / best:.2f} |")
    return out


def peer_index_note(engines: str, prompts: str, transfer: str, ours: dict[str, h.Router]) -> str:
    """What the prefix index held at the end and the share of prompt tokens it expected cached, per router."""
    parts = []
    for name, R in ours.items():
        series = parse_series(R.metrics(), ("disagg_router_prefix_",))
        sent = series.get("disagg_router_prefix_prompt_tokens_total", 0.0)
        hit = series.get("disagg_router_prefix_expected_hit_tokens_total", 0.0)
        parts.append(f"{name.removeprefix('ours ')}: {series.get('disagg_router_prefix_index_chunks', 0):.0f} chunks, "
                     f"expected hit {hit / sent if sent else 0:.2f}")
    return f"- {engines}, {prompts}, {transfer}: prefix index at the end (chunks held; expected cached share of prompt tokens): {'; '.join(parts)}"


def peer_paths_note(engines: str, prompts: str, transfer: str, theirs: dict[str, PeerRouter]) -> str:
    """vllm-router's prefill legs by dispatch path: it learns push from a prefill's answer (plan.py)."""
    parts = [f"{R.policy} {seq:.0f}/{conc:.0f}" for R in theirs.values() for seq, conc in [R.prefill_paths()]]
    return f"- {engines}, {prompts}, {transfer}: vllm-router prefill legs sequential/concurrent push: {', '.join(parts)}"


# --- Router CPU per request, by policy pair ---------------------------------------------------------------
CPU_BASELINE = ("least-outstanding", "least-outstanding", "")  # the router's only policies before issue 19, this tree


def cpu_seconds(pid: int) -> float:
    """A process's own CPU seconds so far: the time its threads ran (/proc/<pid>/task/*/schedstat, in nanoseconds; its
    stat's utime + stime count 10 ms ticks, a tenth of the 0.15 s a router at 0.05 cores uses in 3 s)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total / 1e9


@dataclasses.dataclass
class CpuRun:
    ms_per_request: float  # the router's CPU milliseconds per completed request
    rps: float
    cores: float  # the router's CPU seconds per second of the run
    to_base: float = 1.0  # ms_per_request over the baseline's in the same run


def launch_router_from(src: Path | None, *args: Any, **kw: Any) -> h.Router:
    """h.launch_router, with the disagg_connector package of ``src`` (another checkout's connector/) when given."""
    saved = os.environ.get("PYTHONPATH")
    if src is not None:  # the harness puts the repository first, which holds no disagg_connector package itself
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(src), saved) if x)
    try:
        return h.launch_router(*args, **kw)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


async def cpu_per_request(log_dir: Path, transfers: list[str], prompt_kinds: list[str], streams: int, seconds: float, runs: int,
                          compare: Path | None = None, pairs: list[tuple[str, str]] = OUR_POLICIES) -> list[str]:
    """The router's own CPU time per completed request, per policy pair, on the same zero-cost engines under the
    same closed-loop client: what the policies cost, whatever else the machine runs (a busy machine slows the
    requests far more than it changes the CPU each takes). Runs interleaved, each run starting one router later;
    medians, and the median of each run's ratio to the baseline router's. With ``compare`` (another checkout's
    connector/ directory), that code's routers run too, interleaved with these: before and after in one run."""
    rows: list[str] = []
    sources = {"": None, **({"before": compare} if compare is not None else {})}
    for transfer in transfers:
        tag = f"cpu-{transfer}"
        prefills = [h.launch_sim(log_dir, "prefill", transfer, revision=tag, **ZERO) for _ in range(PEER_PAIRS)]
        decodes = [h.launch_sim(log_dir, "decode", transfer, revision=tag, **ZERO) for _ in range(PEER_PAIRS)]
        static = log_dir / f"{tag}.json"
        h.write_static(static, [e.static_entry() for e in (*prefills, *decodes)])
        ours = {(p, d, code): launch_router_from(src, log_dir, static, transfer, extra=["--prefill-policy", p, "--decode-policy", d],
                                                 name=f"router-{tag}-{p}-{d}{'-' + code if code else ''}")
                for code, src in sources.items() for p, d in dict.fromkeys([*pairs, CPU_BASELINE[:2]])}  # fmt: skip
        try:
            await asyncio.to_thread(h.wait_ready, *prefills, *decodes)
            await asyncio.to_thread(h.wait_ready, *ours.values(), timeout=120)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)) as s:
                for kind in prompt_kinds:
                    prompts = Prompts(kind)
                    fns = {key: sent_to(s, lambda u=R.url: loadgen.RouterTarget(u), prompts) for key, R in ours.items()}
                    for fn in fns.values():  # warm up connections and code paths
                        await closed_loop(fn, 4, 0.5)
                    order = list(ours)
                    measured: dict[tuple[str, str, str], list[CpuRun]] = {key: [] for key in order}
                    for run in range(runs):
                        for key in order[run % len(order):] + order[:run % len(order)]:
                            pid = ours[key].proc.pid
                            before, t0 = cpu_seconds(pid), time.perf_counter()
                            cell = await closed_loop(fns[key], streams, seconds)
                            used, wall = cpu_seconds(pid) - before, time.perf_counter() - t0
                            measured[key].append(CpuRun(used / max(cell.n, 1) * 1e3, cell.rps, used / wall))
                        base = measured[CPU_BASELINE][-1].ms_per_request
                        for runs_of in measured.values():
                            runs_of[-1].to_base = runs_of[-1].ms_per_request / base
                    rows += cpu_rows(transfer, prompts.label, measured)
        finally:
            h.stop_all(*ours.values(), *prefills, *decodes)
    return ["", f"## Router CPU per request: each policy pair on the same {PEER_PAIRS} prefill + {PEER_PAIRS} decode zero-cost "
            f"engines, {streams} streams, closed loop, medians of {runs} run(s) of {seconds:g} s, routers interleaved",
            "", "The router process's own CPU time (its threads' run time, /proc/<pid>/task/*/schedstat) over the requests it completed: a "
            "busy machine slows the requests far more than it changes the CPU each takes. /base: the median over runs of "
            "the ratio to least-outstanding/least-outstanding (the router before issue 19) in the same run; extra: the "
            "difference of the medians in microseconds; cores: the router's CPU seconds per second"
            + ("; (before): the same routers from " + str(compare) + ", interleaved with these" if compare else "") + ".",
            "", "| transfer | prompts | policies | req/s | cores | CPU ms/req | /base | extra us/req |", "|---|---|---|---|---|---|---|---|",
            *rows]  # fmt: skip


def cpu_rows(transfer: str, prompts: str, measured: dict[tuple[str, str, str], list[CpuRun]]) -> list[str]:
    med = {key: CpuRun(*(statistics.median(getattr(r, f.name) for r in runs) for f in dataclasses.fields(CpuRun)))
           for key, runs in measured.items()}  # fmt: skip
    base = med[CPU_BASELINE].ms_per_request
    return [f"| {transfer} | {prompts} | {p}/{d}{f' ({code})' if code else ''} | {m.rps:.0f} | {m.cores:.2f} | "
            f"{m.ms_per_request:.3f} | {m.to_base:.2f} | {(m.ms_per_request - base) * 1e3:.0f} |" for (p, d, code), m in med.items()]


def index_growth(runs: int, picks: int = 200) -> list[str]:
    """What one prefix-and-load prefill pick costs as the prefix index fills: the router's own code
    (policy.Policies.prefill, with the prompt's chunk keys made as dispatch makes them), PEER_PAIRS backends,
    the peers section's shared-prefix prompts, the index filled with distinct chunks to each level first (at its
    cap every insertion evicts); against a least-outstanding pick (which also keys and inserts) on the same
    index. Medians of `runs` runs of `picks` picks, levels and policies interleaved."""
    from disagg_connector.router.discovery import Backend
    from disagg_connector.router.load import LoadBoard
    from disagg_connector.router.pairing import Balancer
    from disagg_connector.router.policy import Policies
    from disagg_connector.router.prefix import BYTES_PER_TOKEN, PrefixIndex, prompt_key

    cands = [Backend("prefill", "r1", f"p{i}", "uid", h.HOST, EngineIdentity(f"p{i}.uid", h.HOST, 5600 + i, 1, 1)) for i in range(PEER_PAIRS)]
    levels = (0, 10_000, 100_000, 500_000)

    def filled(level: int) -> PrefixIndex:
        index = PrefixIndex()
        for b in cands:  # room for the level on these few backends (by default each holds 1M tokens' worth)
            index.set_capacity(b.key, level * 64 // len(cands) + 10**6)
        n = 0
        while index.size < level:
            index.insert(cands[n % len(cands)].key, tuple(range(n * 1000, n * 1000 + min(1000, level - index.size))))
            n += 1
        return index

    indexes = {level: filled(level) for level in levels}
    prompts = Prompts("shared-prefix")
    timings: dict[tuple[int, str], list[float]] = {(level, p): [] for level in levels for p in PREFILL_POLICIES}
    for _ in range(runs):
        bodies = [prompts.next() for _ in range(picks)]
        for level, index in indexes.items():
            for policy in PREFILL_POLICIES:
                policies = Policies(policy, "least-loaded", Balancer(), LoadBoard(1.0), index)
                start = time.perf_counter()
                for body in bodies:
                    policies.prefill(cands, prompt_key("completions", body, len(body["prompt"]) // BYTES_PER_TOKEN))
                timings[level, policy].append((time.perf_counter() - start) / picks * 1e6)
    out = ["", f"## Prefix index fill: one prefill pick among {PEER_PAIRS} backends, shared-prefix prompts (microseconds, "
           f"median of {runs} runs of {picks} picks)", "",
           "| index chunks before | prefix-and-load us | least-outstanding us | difference us |", "|---|---|---|---|"]  # fmt: skip
    for level in levels:
        pl, lo = (statistics.median(timings[level, p]) for p in ("prefix-and-load", "least-outstanding"))
        out.append(f"| {level:,} | {pl:.1f} | {lo:.1f} | {pl - lo:.1f} |")
    return out


def policy_work(runs: int, picks: int = 400) -> list[str]:
    """The policies' own work per request, in process: the prompt's chunk keys (as dispatch makes them), the
    prefill pick and the decode pick of the router's code, PEER_PAIRS backends of each role, every one with a
    fresh load read (so that the load-aware policies weigh load), each pair on a prefix index of its own;
    this thread's CPU time (the clock's own cost included, alike for all). Medians of `runs` runs of `picks` requests, pairs interleaved."""
    from disagg_connector.contract.vllm_pd import estimate_prompt_tokens
    from disagg_connector.router.discovery import Backend
    from disagg_connector.router.load import LoadBoard, parse_engine_metrics
    from disagg_connector.router.pairing import Balancer
    from disagg_connector.router.policy import Policies
    from disagg_connector.router.prefix import PrefixIndex, prompt_key

    def backends(role: str, port: int) -> list[Backend]:
        return [Backend(role, "r1", f"{role}{i}", "uid", h.HOST, EngineIdentity(f"{role}{i}.uid", h.HOST, port + i, 1, 1)) for i in range(PEER_PAIRS)]

    prefills, decodes = backends("prefill", 5600), backends("decode", 5700)
    clock = time.thread_time  # CPU time of this thread: what other processes run meanwhile does not count
    page = parse_engine_metrics('vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
                                'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n')  # fmt: skip
    out = ["", f"## Policy work per request: chunk keys, prefill pick and decode pick, in process, {PEER_PAIRS}P/{PEER_PAIRS}D with "
           f"fresh load reads (CPU microseconds, median of {runs} runs of {picks} requests)", "",
           "| prompts | policies | keys us | prefill us | decode us | total us |", "|---|---|---|---|---|---|"]  # fmt: skip
    for kind in ("short", "shared-prefix"):
        timings: dict[tuple[str, str], list[tuple[float, float, float]]] = {pair: [] for pair in OUR_POLICIES}
        for _ in range(runs):
            prompts = Prompts(kind)
            bodies = [prompts.next() for _ in range(picks)]
            for pair in OUR_POLICIES:
                board = LoadBoard(3600.0)  # reads stay fresh for the run
                for b in (*prefills, *decodes):
                    board.record(b, page, 0)
                policies = Policies(*pair, Balancer(), board, PrefixIndex())
                keys = prefill = decode = 0.0
                for body in bodies:
                    t0 = clock()
                    key = prompt_key("completions", body, estimate_prompt_tokens("completions", body))
                    t1 = clock()
                    policies.prefill(prefills, key)
                    t2 = clock()
                    policies.decode(decodes)
                    t3 = clock()
                    keys, prefill, decode = keys + t1 - t0, prefill + t2 - t1, decode + t3 - t2
                timings[pair].append((keys / picks * 1e6, prefill / picks * 1e6, decode / picks * 1e6))
        for (p, d), ts in timings.items():
            k, pf, dc = (statistics.median(t[i] for t in ts) for i in range(3))
            out.append(f"| {Prompts(kind).label} | {p}/{d} | {k:.1f} | {pf:.1f} | {dc:.1f} | {k + pf + dc:.1f} |")
    return out


async def short_prompts(log_dir: Path, lengths: list[int], rate: float, probes: int, background: int) -> list[str]:
    """Mean TTFT of probe requests and the background streams' TPOT, disaggregated vs local prefill."""
    # not the tests' FAST profile; a field left None (pull_pickup_ms: kv_pickup_ms's) is no flag: the simulator's default
    defaults = {k: v for k, v in dataclasses.asdict(Timing()).items() if k != "scale" and v is not None}
    P = h.launch_sim(log_dir, "prefill", "push", revision="short", lease_seconds=60, **defaults)
    D = h.launch_sim(log_dir, "decode", "push", revision="short", lease_seconds=60, **defaults)
    static = log_dir / "short.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    routers = {
        "disaggregated": h.launch_router(log_dir, static, "push", name="router-disagg"),
        "local": h.launch_router(log_dir, static, "push", extra=["--disaggregation-threshold-tokens", str(10**6)], name="router-local"),
    }
    results: dict[tuple[str, int], tuple[float, float]] = {}
    try:
        await asyncio.to_thread(h.wait_ready, P, D, *routers.values())
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)) as s:
            for length in lengths:
                for name, R in routers.items():
                    results[name, length] = await _short_cell(s, R.url, length, rate, probes, background)
    finally:
        h.stop_all(*routers.values(), P, D)
    out = ["", f"## Short prompts: {probes} probes at {rate:g}/s beside {background} long streams on the decode engine "
           "(simulator defaults: Qwen3-32B-like KV, H200-like prefill, 100 GB/s), push", "",
           "| prompt tokens | TTFT disaggregated ms | TTFT local ms | local/disagg | background TPOT disagg ms | background TPOT local ms |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for length in lengths:
        (td, pd), (tl, pl) = results["disaggregated", length], results["local", length]
        out.append(f"| {length} | {td:.1f} | {tl:.1f} | {tl / td:.2f} | {pd:.2f} | {pl:.2f} |")
    return out


async def _short_cell(s: aiohttp.ClientSession, url: str, length: int, rate: float, probes: int, background: int) -> tuple[float, float]:
    ttfts: list[float] = []
    tpots: list[float] = []
    stop = asyncio.Event()

    async def stream_forever() -> None:
        body = h.completion(prompt_words=1024, max_tokens=4096, stream=True)
        while not stop.is_set():
            async with s.post(url + "/v1/completions", json=body) as r:
                last = None
                async for _ in r.content.iter_any():
                    now = time.perf_counter()
                    if last is not None and not stop.is_set():
                        tpots.append(now - last)
                    last = now
                    if stop.is_set():
                        break

    async def probe(delay: float) -> None:
        await asyncio.sleep(delay)
        t = time.perf_counter()
        # text prompts: `length` words are `length` tokens to the simulator (and > length to the router's
        # estimate, 5 bytes per word: the local router's threshold is far above either)
        async with s.post(url + "/v1/completions", json=h.completion(prompt_words=length, max_tokens=4, stream=True)) as r:
            await r.content.readany()
            ttfts.append(time.perf_counter() - t)
            await r.read()

    bg = [asyncio.create_task(stream_forever()) for _ in range(background)]
    await asyncio.sleep(0.3)  # the background streams are running
    tpots.clear()
    await asyncio.gather(*(probe(i / rate) for i in range(probes)))
    stop.set()
    for t in bg:
        t.cancel()
    await asyncio.gather(*bg, return_exceptions=True)
    return statistics.fmean(ttfts) * 1e3, statistics.fmean(tpots) * 1e3


def json_cost() -> list[str]:
    """The router's JSON work per request (parse the client's body, write both legs' bodies): json, the
    standard library, against orjson, which the router uses. Medians of 5 timings."""
    import json
    import timeit

    import orjson

    out = ["", "## JSON per request: parse the body, write both legs (microseconds, median of 5)", "",
           "| prompt words | body bytes | json us | orjson us | orjson/json |", "|---|---|---|---|---|"]  # fmt: skip
    for words in (64, 1024, 16384):
        body = h.completion(prompt_words=words, max_tokens=128, stream=True)
        raw = json.dumps(body).encode()
        n = max(20, 200_000 // (words + 50))
        std = statistics.median(timeit.repeat(lambda: (json.loads(raw), json.dumps(body).encode(), json.dumps(body).encode()), number=n, repeat=5)) / n
        fast = statistics.median(timeit.repeat(lambda: (orjson.loads(raw), orjson.dumps(body), orjson.dumps(body)), number=n, repeat=5)) / n
        out.append(f"| {words} | {len(raw)} | {std * 1e6:.1f} | {fast * 1e6:.1f} | {fast / std:.2f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one run per cell, shorter cells")
    ap.add_argument("--runs", type=int, help="runs per cell (default 3; 1 with --quick)")
    ap.add_argument("--toy-proxy", type=Path, help="vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py")
    ap.add_argument("--skip-headroom", action="store_true")
    ap.add_argument("--skip-short", action="store_true")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--only-cpu", action="store_true", help="only the router CPU per request section")
    ap.add_argument("--cpu-transfers", default="push,pull", help="transfer modes of the CPU section (default push,pull)")
    ap.add_argument("--cpu-pairs", default=",".join(f"{p}/{d}" for p, d in OUR_POLICIES),
                    help="policy pairs of the CPU section, prefill/decode, comma-separated (least-outstanding/least-outstanding always)")
    ap.add_argument("--cpu-compare", type=Path, metavar="DIR",
                    help="the CPU section also runs the routers of another checkout's connector/ directory, interleaved "
                         "(before/after: git archive HEAD connector | tar -x -C DIR, then pass DIR/connector)")
    ap.add_argument("--peer-streams", default="64", help="stream counts of the peers section, comma-separated (default 64)")
    ap.add_argument("--peer-engines", default="zero-cost,timed", help="engine models of the peers section: zero-cost, timed")
    ap.add_argument("--sim-vs-real", action="store_true",
                    help="also replay the committed H200 runs with the calibrated simulator (bench/disagg_bench/sim_vs_real.py, ~12 min)")
    a = ap.parse_args()
    runs = a.runs or (1 if a.quick else 3)
    if a.only_cpu:
        a.skip_headroom = a.skip_peers = a.skip_short = True
    seconds = 2.0 if a.quick else 4.0
    lengths = [128, 512, 1024] if a.quick else [64, 128, 256, 512, 1024, 2048]
    lines = ["# disagg-router benchmark", f"# command: python -m disagg_bench.router_bench {shlex.join(sys.argv[1:])}".rstrip(),
             f"# machine: {_machine()}"]  # fmt: skip
    t0 = time.monotonic()

    class Out(list):  # every section printed as it is done: a run cut short keeps what it measured
        def __iadd__(self, more: Any) -> "Out":
            more = list(more)
            print("\n".join(more), flush=True)
            return super().__iadd__(more)

    print("\n".join(lines), flush=True)
    lines = Out(lines)
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        log_dir = Path(tmp)
        if not a.skip_cpu:
            lines += asyncio.run(cpu_per_request(log_dir, a.cpu_transfers.split(","), ["short", "shared-prefix"], 64,
                                                 2.0 if a.quick else 4.0, runs, a.cpu_compare,
                                                 [tuple(x.split("/")) for x in a.cpu_pairs.split(",")]))  # type: ignore[misc]
        if not a.skip_headroom:
            lines += asyncio.run(headroom(log_dir, [1, 16, 64], seconds, runs, a.toy_proxy))
        if not a.skip_peers:
            models = {"zero-cost": ZERO, "timed": TIMED}
            engine_models = [(m if m == "zero-cost" else "timed 10 ms/token", models[m]) for m in a.peer_engines.split(",")]
            lines += asyncio.run(peers(log_dir, engine_models, ["short", "shared-prefix"], [int(x) for x in a.peer_streams.split(",")],
                                       1.5 if a.quick else 3.0, runs))
        lines += policy_work(runs=3 if a.quick else 7)
        if not a.only_cpu:
            lines += index_growth(runs=3 if a.quick else 7)
            lines += json_cost()
        if not a.skip_short:
            lines += asyncio.run(short_prompts(log_dir, lengths, rate=20.0, probes=10 if a.quick else 30, background=8))
    if a.sim_vs_real:
        from disagg_bench import sim_vs_real

        lines += sim_vs_real.compare()
    lines += [f"\n# total run time {time.monotonic() - t0:.0f} s"]


def _machine() -> str:
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    load = Path("/proc/loadavg").read_text().split()[:3]
    return f"{cores} cores, load average {' '.join(load)} at start, Python {sys.version.split()[0]}"


if __name__ == "__main__":
    main()
