"""Router benchmark: added latency and throughput, and TTFT of push (concurrent legs) / pull.

    python -m tests.bench.router_bench            # < 3 min
    python -m tests.bench.router_bench --quick    # < 30 s

Everything runs as separate processes on loopback: simulated vLLM engines (``tests.vllm_sim``) and the
real router (``disagg_connector.router``).

1. **Router overhead.** Engines with a zero timing model (no compute, no transfer), non-streaming
   completions of 4 tokens, at several client concurrencies. Compared: one plain request straight to one
   engine ("direct 1 engine"); both P/D legs sent concurrently by the benchmark itself, i.e. an ideal
   in-process router ("direct P+D"); and the router in push mode. "Added" = router minus direct P+D.
2. **TTFT under the simulator's timing model** (see ``tests/vllm_sim/sim.py``; defaults approximate
   Qwen3-32B on H200 with 100 GB/s EFA), 1 prefill + 1 decode engine per mode, requests at fixed intervals
   at each rate (at least 4 per cell), streamed, 64 output tokens. The model runs ``--time-scale`` times faster than real time;
   figures are reported in model time (measured / scale), so loopback and Python overheads are inflated
   by 1/scale. Mean TTFT per cell and its ratio to pull (< 1 = faster than pull).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from tests.vllm_sim import harness as h

ZERO = {
    "prefill_us_per_token": 0.0,
    "tpot_ms": 0.0,
    "step_ms": 0.0,
    "registration_rtt_ms": 0.0,
    "kv_bytes_per_token": 0,
    "descriptor_prep_us_per_block": 0.0,
}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def closed_loop(fn: Any, concurrency: int, total: int) -> tuple[list[float], float]:
    """`total` requests by `concurrency` workers; returns latencies and requests per second."""
    lat: list[float] = []
    left = [total]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            t = time.perf_counter()
            await fn()
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, total / (time.perf_counter() - t0)


async def overhead(log_dir: Path, levels: list[int], total: int) -> None:
    P = h.launch_sim(log_dir, "prefill", "push", **ZERO)
    D = h.launch_sim(log_dir, "decode", "push", **ZERO)
    static = log_dir / "overhead.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", name="router-overhead")
    try:
        await asyncio.to_thread(h.wait_ready, P, D, R)
        body = h.completion(prompt_words=64, max_tokens=4)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:

            async def call(url: str, payload: dict[str, Any], xid: str | None = None) -> None:
                headers = {"X-Request-Id": xid} if xid else None
                async with s.post(url + "/v1/completions", json=payload, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status

            async def direct() -> None:
                await call(D.url, body)

            async def direct_pd() -> None:
                xid = uuid.uuid4().hex
                p_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
                params = {
                    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": P.engine_id,
                    "remote_host": h.HOST, "remote_port": P.side_port, "tp_size": 1, "pp_size": 1,
                    "remote_request_id": f"cmpl-{xid}-0",
                }
                await asyncio.gather(call(P.url, p_body, xid), call(D.url, {**body, "kv_transfer_params": params}, xid))

            async def router() -> None:
                await call(R.url, body)

            for fn in (direct, direct_pd, router):  # warm up connections
                await closed_loop(fn, 4, 20)
            print("\n## Router overhead (zero-cost engines, non-streaming, 4 output tokens)")
            print(f"{'conc':>5} | {'direct 1 engine':>22} | {'direct P+D legs':>22} | {'via router (push)':>22} | {'added p50 ms':>12}")
            print(f"{'':>5} | {'p50/p99 ms   req/s':>22} | {'p50/p99 ms   req/s':>22} | {'p50/p99 ms   req/s':>22} |")
            for c in levels:
                res = {}
                for name, fn in (("direct", direct), ("pd", direct_pd), ("router", router)):
                    res[name] = await closed_loop(fn, c, total)

                def cell(lat_rps: tuple[list[float], float]) -> str:
                    lat, rps = lat_rps
                    return f"{pct(lat, 50) * 1e3:6.2f}/{pct(lat, 99) * 1e3:6.2f} {rps:7.0f}"

                # Only the median difference means something: p99s of separate runs do not subtract.
                add50 = (pct(res["router"][0], 50) - pct(res["pd"][0], 50)) * 1e3
                print(f"{c:>5} | {cell(res['direct']):>22} | {cell(res['pd']):>22} | {cell(res['router']):>22} | {add50:12.2f}")
    finally:
        h.stop_all(R, P, D)


async def ttft_cell(url: str, prompt_tokens: int, rate: float, n: int, scale: float, max_tokens: int) -> list[float]:
    body = h.completion(prompt_words=prompt_tokens, max_tokens=max_tokens, stream=True)
    out: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(delay: float) -> None:
            await asyncio.sleep(delay)
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.content.readany()
                out.append((time.perf_counter() - t) / scale)
                await r.read()

        interval = scale / rate  # model-time interval, run `scale` times faster
        await asyncio.gather(*(one(i * interval) for i in range(n)))
    return out


def cell_requests(rate: float, seconds: float) -> int:
    """Requests per cell: `seconds` of model time at the rate, at least 4."""
    return max(4, round(rate * seconds))


async def ttft(log_dir: Path, lengths: list[int], rates: list[float], seconds: float, scale: float, max_tokens: int) -> None:
    modes = [("push", "push"), ("pull", "pull")]
    results: dict[tuple[str, int, float], float] = {}
    for router_mode, engine_mode in modes:
        timing = {"time_scale": scale, "prefill_us_per_token": 6.0, "tpot_ms": 7.0, "step_ms": 10.0, "registration_rtt_ms": 1.0}
        P = h.launch_sim(log_dir, "prefill", engine_mode, revision=router_mode, lease_seconds=60, **timing)
        D = h.launch_sim(log_dir, "decode", engine_mode, revision=router_mode, **timing)
        static = log_dir / f"ttft-{router_mode}.json"
        h.write_static(static, [P.static_entry(), D.static_entry()])
        R = h.launch_router(log_dir, static, router_mode, name=f"router-{router_mode}")
        try:
            await asyncio.to_thread(h.wait_ready, P, D, R)
            await ttft_cell(R.url, 256, 10.0, 3, scale, 4)  # warm-up
            for length in lengths:
                for rate in rates:
                    lat = await ttft_cell(R.url, length, rate, cell_requests(rate, seconds), scale, max_tokens)
                    results[router_mode, length, rate] = statistics.fmean(lat)
        finally:
            h.stop_all(R, P, D)
    counts = ", ".join(f"{cell_requests(r, seconds)} at {r:g}/s" for r in rates)
    print(f"\n## TTFT (model time; mean per cell of {counts}; 1P1D; {max_tokens} output tokens; time scale {scale:g})")
    print(f"{'prompt':>7} {'req/s':>6} | {'pull ms':>8} | {'push ms':>8} {'/pull':>6}")
    for length in lengths:
        for rate in rates:
            pull = results["pull", length, rate]
            push = results["push", length, rate]
            print(f"{length:>7} {rate:>6g} | {pull * 1e3:8.1f} | {push * 1e3:8.1f} {push / pull:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller run (< 30 s)")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    a = ap.parse_args()
    if a.quick:
        levels, total = [1, 16], 60
        lengths, rates, seconds, scale = [1024, 16384], [1.0, 8.0], 1.0, 0.25
    else:
        levels, total = [1, 8, 32], 300
        lengths, rates, seconds, scale = [1024, 4096, 16384], [1.0, 2.0, 4.0, 8.0], 2.0, 1.0
    print("# disagg-router benchmark")
    print(f"# command: python -m tests.bench.router_bench {shlex.join(sys.argv[1:])}".rstrip())
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        log_dir = Path(tmp)
        if not a.skip_overhead:
            asyncio.run(overhead(log_dir, levels, total))
        if not a.skip_ttft:
            asyncio.run(ttft(log_dir, lengths, rates, seconds, scale, 64))
    print(f"\n# total run time {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
