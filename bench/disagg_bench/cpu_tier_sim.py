"""A CPU KV tier in the simulator (issue 31): multi-turn traffic whose working set exceeds the prefill engines' GPU KV,
with and without `spec.prefill.kvCache.cpu`, under both prefill policies.

    python -m disagg_bench.cpu_tier_sim                 # 3 runs x 2 tiers x 2 policies, ~12 min on 2 cores
    python -m disagg_bench.cpu_tier_sim --runs 1 --cell-seconds 20   # quicker

The shape, timing and engines of :mod:`disagg_bench.routing_sim` (4 prefill and 4 decode simulator processes, the
real router, conversations resending their history; 800 us of prefill per uncached token), with two changes:
- each prefill engine's GPU KV holds GPU_BLOCKS blocks (`--num-gpu-blocks-override`, a vLLM flag the
  simulator reads as its pool): a little more than the longest prompt, fewer than an engine's share of the live conversations,
  so turns find their history evicted;
- prompts are token ids, so prefix-and-load matches them exactly against the engines' KV events, the CPU tier's
  (medium CPU) included.
"tier" runs the same model with `kvCache.cpu: CPU_TIER` on prefill: the operator renders the MultiConnector, the
simulator reads its OffloadingConnector's `cpu_bytes_to_use` (1,024 blocks of 16 tokens at its 256 KiB of KV per
token) and copies blocks back at 400 Gb/s instead of computing them. Each run starts fresh engines per tier
and runs both policies on them in a rotated order, each policy with its own words. The table gives per
(tier, policy) the median over the runs of TTFT p50 and p90, and the prefill engines' own counters: the GPU
prefix-cache hit ratio (`vllm:prefix_cache_*`) and the share of prompt tokens the CPU tier gave back
(`vllm:external_prefix_cache_hits_total` over the queried tokens).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from disagg_bench import routing_sim

GPU_BLOCKS = 192  # per prefill engine: 3,072 tokens, a little more than the longest prompt (2,368)
CPU_TIER = "4Gi"
TIERS = ("gpu-only", "tier")


def model_doc(tier: bool) -> dict[str, Any]:
    doc = copy.deepcopy(routing_sim.model_doc())
    prefill = doc["spec"]["prefill"]
    prefill["extraArgs"] = ["--num-gpu-blocks-override", str(GPU_BLOCKS)]
    if tier:
        prefill["kvCache"] = {"cpu": CPU_TIER}
    return doc


def table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Medians over the runs per (tier, policy)."""
    from disagg_bench.localrun.report import routing

    med = statistics.median
    lines = ["| prefill KV | policy | runs | ok/sent | TTFT p50 ms (min-max) | TTFT p90 ms | GPU hit ratio | CPU tier gave back |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for tier in TIERS:
        for mode in routing_sim.POLICIES:
            cells = [c for run in results[tier] for c in run["cells"] if c["mode"] == mode]
            if not cells:
                continue
            figs = [f for f in map(routing, cells) if f]
            p50s = [c["ttft"]["p50"] * 1e3 for c in cells]
            lines.append(
                f"| {tier} | {mode} | {len(cells)} | {sum(c['ok'] for c in cells)}/{sum(c['sent'] for c in cells)} | "
                f"{med(p50s):,.0f} ({min(p50s):,.0f}-{max(p50s):,.0f}) | {med(c['ttft']['p90'] for c in cells) * 1e3:,.0f} | "
                f"{med(f.hit_ratio for f in figs):.3f} | {med(f.external_hit_ratio for f in figs):.3f} |")  # fmt: skip
    return lines


def run(runs: int, cell_seconds: float, workdir: Path) -> None:
    from disagg_bench.localrun.bench import cell_order
    from disagg_bench.vllm_sim import harness as h

    modes = list(routing_sim.POLICIES)
    load_before = os.getloadavg()
    results: dict[str, list[dict[str, Any]]] = {t: [] for t in TIERS}
    started = time.monotonic()
    for r in range(runs):
        for tier in TIERS:  # the same sessions (seed) on both
            model = workdir / f"dm-{tier}.json"
            model.write_text(json.dumps(model_doc(tier == "tier")))
            out = workdir / f"run{r}-{tier}"
            order = cell_order(modes, r)
            print(f"run {r + 1}/{runs}, {tier}: {', '.join(order)}", flush=True)
            options = [*routing_sim.bench_options(order, cell_seconds, seed=r), "--prompt-format", "token-ids"]
            proc = h.localrun_bench(model, out, 8, *options, vllm=f"{sys.executable} -m disagg_bench.routing_sim --as-vllm", profile=None)
            if proc.returncode != 0:
                raise SystemExit(f"run {r + 1} ({tier}) failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            print("\n".join(line for line in proc.stdout.splitlines() if " x " in line), flush=True)
            results[tier].append(json.loads((out / "results.json").read_text()))
    print(f"\n{runs} runs in {time.monotonic() - started:.0f} s; load average before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} cores")
    print(f"shape: routing_sim's ({routing_sim.SYSTEM_TOKENS}-token system prompt, {routing_sim.TURNS} turns of "
          f"{routing_sim.USER_TOKENS} user + {routing_sim.ANSWER_TOKENS} answer tokens, {routing_sim.SESSION_RATE} sessions/s), "
          f"token-id prompts, {GPU_BLOCKS} GPU blocks per prefill engine, CPU tier {CPU_TIER}; {cell_seconds:g} s of arrivals "
          f"per policy; timing {routing_sim.TIMING}\n")
    print("\n".join(table(results)))
    print(f"\nresults: {workdir}/run*/results.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cell-seconds", type=float, default=40.0, help="seconds of session arrivals per policy, tier and run")
    p.add_argument("--workdir", help="keep the runs' results here (default: a temporary folder, kept)")
    a = p.parse_args()
    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="cpu-tier-sim-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run(a.runs, a.cell_seconds, workdir)


if __name__ == "__main__":
    main()
