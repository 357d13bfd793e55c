"""Router benchmark: headroom against a direct client, and when disaggregation pays for short prompts.

    python -m tests.bench.router_bench                  # about 6 min
    python -m tests.bench.router_bench --quick          # about 1 min, one run per cell
    python -m tests.bench.router_bench --toy-proxy PATH # also vLLM's toy proxy (its file, fetched by you)

Everything runs as separate processes on this machine: simulated vLLM engines (``tests.vllm_sim``), the
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
3. **JSON per request**: the router parses the client's body and writes both legs' bodies; the standard
   library against orjson (which the router uses), per prompt length.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp

from tests.vllm_sim import harness as h
from tests.vllm_sim.sim import Timing

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
    return Cell(len(lat) / (time.perf_counter() - t0), pct(lat, 50) * 1e3)


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


async def short_prompts(log_dir: Path, lengths: list[int], rate: float, probes: int, background: int) -> list[str]:
    """Mean TTFT of probe requests and the background streams' TPOT, disaggregated vs local prefill."""
    defaults = {k: v for k, v in dataclasses.asdict(Timing()).items() if k != "scale"}  # not the tests' FAST profile
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
    ap.add_argument("--sim-vs-real", action="store_true",
                    help="also replay the committed H200 runs with the calibrated simulator (tests/bench/sim_vs_real.py, ~12 min)")
    a = ap.parse_args()
    runs = a.runs or (1 if a.quick else 3)
    seconds = 2.0 if a.quick else 4.0
    lengths = [128, 512, 1024] if a.quick else [64, 128, 256, 512, 1024, 2048]
    lines = ["# disagg-router benchmark", f"# command: python -m tests.bench.router_bench {shlex.join(sys.argv[1:])}".rstrip(),
             f"# machine: {_machine()}"]  # fmt: skip
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        log_dir = Path(tmp)
        if not a.skip_headroom:
            lines += asyncio.run(headroom(log_dir, [1, 16, 64], seconds, runs, a.toy_proxy))
        lines += json_cost()
        if not a.skip_short:
            lines += asyncio.run(short_prompts(log_dir, lengths, rate=20.0, probes=10 if a.quick else 30, background=8))
    if a.sim_vs_real:
        from tests.bench import sim_vs_real

        lines += sim_vs_real.compare()
    lines.append(f"\n# total run time {time.monotonic() - t0:.0f} s")
    print("\n".join(lines))


def _machine() -> str:
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    load = Path("/proc/loadavg").read_text().split()[:3]
    return f"{cores} cores, load average {' '.join(load)} at start, Python {sys.version.split()[0]}"


if __name__ == "__main__":
    main()
