"""Stream migration's cost to the client: the gap a migration adds to a stream, against its normal inter-token time.

    python -m disagg_bench.migration_bench                        # 1k/4k/16k-token prompts, 3 runs each (about 3 min)
    python -m disagg_bench.migration_bench --contexts 1024 --runs 1

Simulated engines with the H200 profile (``calibration.json`` ``h200-1gpu-push``: vLLM 0.26.0 on one H200, Qwen3-0.6B
shape: prefill rate, KV transfer at the measured link rate, 26.5 ms per output token, the decode's pick-up of a
received KV), push, one prefill and two decodes, the real router with its defaults (migration on). Per run: STREAMS
streams of OUTPUT_TOKENS tokens with a prompt of the context's length; once every stream has KILL_AFTER tokens, the
decode engine carrying the most streams is killed (SIGKILL). The client stamps every event. Per stream: its inter-token
time (the median interval between its events before the kill) and, for the streams that were on the dead engine
(those the router continued: their count is checked against ``disagg_router_migrations_total``), the gap: the longest
interval, from the last token before the failure to the continuation's first. The continuation prefills the prompt
plus the tokens sent (the gap grows with the context) and waits for its KV as a new request does.

A simulator's figures: what the timing model predicts from the H200 calibration, not a GPU measurement (the real-vLLM
run on the H200 is the one to trust; docs/router.md). Every figure is the median over runs.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from disagg_bench.vllm_sim import harness as h
from disagg_bench.vllm_sim.as_vllm import profile

STREAMS = 8
OUTPUT_TOKENS = 160
KILL_AFTER = 40
PROFILE = "h200-1gpu-push"


async def _stream(url: str, words: int, stamps: list[float]) -> None:
    body = h.completion(prompt_words=words, max_tokens=OUTPUT_TOKENS, stream=True, temperature=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    assert b'"error"' not in event, event
                    if event.startswith(b"data: {"):
                        stamps.append(time.monotonic())
    assert len(stamps) == OUTPUT_TOKENS, f"{len(stamps)} of {OUTPUT_TOKENS} tokens"


def _migrated(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("disagg_router_migrations_total{") and 'outcome="migrated"' in line)  # fmt: skip


def one_run(log_dir: Path, words: int) -> dict[str, Any]:
    log_dir.mkdir(parents=True)
    timing = profile(PROFILE)
    P = h.launch_sim(log_dir, "prefill", "push", **timing)
    decodes = [h.launch_sim(log_dir, "decode", "push", **timing) for _ in range(2)]
    static = log_dir / f"mig-{words}.json"
    h.write_static(static, [P.static_entry(), *(d.static_entry() for d in decodes)])
    R = h.launch_router(log_dir, static, "push", name=f"router-{words}")
    try:
        h.wait_ready(P, *decodes, R)
        stamps: list[list[float]] = [[] for _ in range(STREAMS)]

        async def run() -> None:
            tasks = [asyncio.create_task(_stream(R.url, words, s)) for s in stamps]
            while not all(len(s) >= KILL_AFTER for s in stamps):
                if any(t.done() for t in tasks):
                    await asyncio.gather(*tasks)
                await asyncio.sleep(0.005)
            busiest = max(decodes, key=lambda d: len(d.events("first_token")))
            busiest.proc.signal(signal.SIGKILL)
            await asyncio.gather(*tasks)

        asyncio.run(run())
        migrated = _migrated(h.http_get(R.url + "/metrics")[1].decode())
    finally:
        h.stop_all(R, P, *decodes)
    itl = [statistics.median(b - a for a, b in zip(s[:KILL_AFTER], s[1:KILL_AFTER])) for s in stamps]
    normal = statistics.median(itl)
    gaps = sorted((max(b - a for a, b in zip(s, s[1:])) for s in stamps), reverse=True)[: int(migrated)]
    return {"itl": normal, "gaps": gaps, "migrated": migrated}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    print(f"# stream migration: the client-visible gap against the inter-token time (simulator, profile {PROFILE})")
    print(f"# command: python -m disagg_bench.migration_bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# {STREAMS} streams of {OUTPUT_TOKENS} tokens, push 1P2D, the busiest decode killed once every stream has "
          f"{KILL_AFTER} tokens; medians of {a.runs} run(s), runs of the contexts interleaved\n")  # fmt: skip
    results: dict[int, list[dict[str, Any]]] = {c: [] for c in contexts}
    with tempfile.TemporaryDirectory(prefix="migration-bench-") as d:
        for run in range(a.runs):
            for c in contexts:
                results[c].append(one_run(Path(d) / f"r{run}-{c}", c))
    print("| context (tokens) | streams migrated | inter-token ms | gap p50 ms | gap max ms | gap p50 / inter-token |")
    print("|---|---|---|---|---|---|")
    for c in contexts:
        rs = results[c]
        itl = statistics.median(r["itl"] for r in rs)
        p50 = statistics.median(statistics.median(r["gaps"]) for r in rs if r["gaps"])
        top = statistics.median(max(r["gaps"]) for r in rs if r["gaps"])
        moved = statistics.median(r["migrated"] for r in rs)
        print(f"| {c} | {moved:g} | {itl * 1e3:.1f} | {p50 * 1e3:.0f} | {top * 1e3:.0f} | {p50 / itl:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
