"""KV-aware routing in the simulator, where prefill is the bottleneck: least-outstanding against prefix-and-load.

    python -m disagg_bench.routing_sim                 # 3 runs x 2 policies, interleaved, ~7 min on 2 cores
    python -m disagg_bench.routing_sim --runs 1 --cell-seconds 20 --peer   # quicker; --peer adds vllm-router cache_aware

4 prefill and 4 decode engines, each a simulator process of its own (its own compute: prefills one at a time,
FIFO, on each engine), vLLM's prefix cache and its counters, the real router in front
(`disagg-localrun bench --workload multi-turn`). Conversations: a shared system prompt, each turn resending
the history, Poisson session arrivals, exponential think times, seeded. Every run starts fresh engines and runs
the policies one after the other on them (each policy its own words, so none finds another's conversations
cached); the policy order rotates from run to run, and the table gives per policy the median over the runs of
each run's TTFT p50 and p90, prefix hit ratio (the prefill engines' own `vllm:prefix_cache_*` counters) and
prefill shares. The goal it reports against (issue 19): prefix-and-load's TTFT p50 <= 0.7 x least-outstanding's.

Timing (TIMING below, the simulator's flags): 800 us of prefill per uncached prompt token plus 10 ms per prefill,
so a 2k-token prompt computes for 1.6 s and a turn whose history is cached for ~0.2 s; the arrival rate puts
least-outstanding's prefill engines near saturation (queues form), so TTFT is prefill work and its queue. Those
durations are hundreds of milliseconds against the few milliseconds a request costs the router and the
simulator in CPU, so the 2-core machine's noise stays small beside them. Decode is short (16 tokens of 10 ms).

The engines are started through this module (`--as-vllm`, bench/disagg_bench/vllm_sim/as_vllm.py's reading of the rendered
`vllm serve` line with TIMING instead of a calibration profile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TIMING = {"prefill_us_per_token": 800.0, "prefill_base_ms": 10.0, "tpot_ms": 10.0, "step_ms": 10.0, "registration_rtt_ms": 1.0}
POLICIES = ("router-push:least-outstanding", "router-push:prefix-and-load")
PEER = "vllmrouter-push:cache_aware"
GOAL = 0.7  # prefix-and-load's TTFT p50 over least-outstanding's
SYSTEM_TOKENS, USER_TOKENS, TURNS, ANSWER_TOKENS, THINK_S, SESSION_RATE = 1024, 256, 5, 16, 1.0, 1.2


def model_doc() -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedModel", "metadata": {"name": "routing", "namespace": "ns"},
        "spec": {"model": {"name": "Qwen/Qwen3-0.6B"}, "engine": {"enablePrefixCaching": True, "blockSize": 16},
                 "prefill": {"replicas": 4}, "decode": {"replicas": 4}, "router": {"prefillPolicy": "PrefixAndLoad"}},
    }  # fmt: skip


def bench_options(modes: list[str], cell_seconds: float, seed: int) -> list[str]:
    """The sweep: the multi-turn shape above, our router's modes and vllm-router's on the same engines."""
    return [
        "--peer-router-command", f"{sys.executable} -m vllm_router.launch_router",
        "--workload", "multi-turn", "--modes", ",".join(modes), "--system-tokens", str(SYSTEM_TOKENS), "--turns", str(TURNS),
        "--user-tokens", str(USER_TOKENS), "--think-time", str(THINK_S), "--rates", str(SESSION_RATE),
        "--cell-seconds", str(cell_seconds), "--min-requests", "8", "--max-tokens", str(ANSWER_TOKENS), "--seed", str(seed),
    ]  # fmt: skip


def table(runs: list[dict[str, Any]], modes: list[str]) -> tuple[list[str], dict[str, float]]:
    """The markdown table of medians over the runs, and each mode's median TTFT p50 (s)."""
    from disagg_bench.localrun.report import ideal_hit_ratio, routing

    cells: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for run in runs:
        for c in run["cells"]:
            cells.setdefault(c["mode"], []).append(c)
    ideal = ideal_hit_ratio(runs[0], SYSTEM_TOKENS, SESSION_RATE)
    med = statistics.median
    p50 = {m: med(c["ttft"]["p50"] for c in cells[m]) for m in modes if cells[m]}
    base = p50.get(POLICIES[0])
    lines = ["| policy | runs | ok/sent (all runs) | TTFT p50 ms (min-max) | TTFT p90 ms | / least-outstanding p50 | hit ratio | / ideal | "
             "prefill share per engine | imbalance |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for m in modes:
        cs = cells[m]
        if not cs:
            continue
        figs = [routing(c) for c in cs]
        hit = med(f.hit_ratio for f in figs if f)
        labels = sorted({k for f in figs if f for k in f.shares})
        shares = " / ".join(f"{med(f.shares.get(k, 0.0) for f in figs if f):.2f}" for k in labels)
        p50s = [c["ttft"]["p50"] * 1e3 for c in cs]
        lines.append(
            f"| {m} | {len(cs)} | {sum(c['ok'] for c in cs)}/{sum(c['sent'] for c in cs)} | {p50[m] * 1e3:,.0f} ({min(p50s):,.0f}-{max(p50s):,.0f}) | "
            f"{med(c['ttft']['p90'] for c in cs) * 1e3:,.0f} | {p50[m] / base:.2f} | {hit:.3f} | {hit / ideal:.2f} | {shares} | "
            f"{med(f.imbalance for f in figs if f):.2f} |")  # fmt: skip
    lines.append(f"| *one engine holding everything* | | | | | | {ideal:.3f} | 1.00 | | |")
    return lines, p50


def run(runs: int, cell_seconds: float, peer: bool, workdir: Path) -> None:
    from disagg_bench.localrun.bench import cell_order
    from disagg_bench.vllm_sim import harness as h

    modes = [*POLICIES, *([PEER] if peer else [])]
    model = workdir / "dm.json"
    model.write_text(json.dumps(model_doc()))
    load_before = os.getloadavg()
    results, started = [], time.monotonic()
    for r in range(runs):
        out = workdir / f"run{r}"
        order = cell_order(modes, r)  # run r starts with its own mode, as the real sweeps' cells do
        print(f"run {r + 1}/{runs}: {', '.join(order)}", flush=True)
        proc = h.localrun_bench(model, out, 8, *bench_options(order, cell_seconds, seed=r),
                                vllm=f"{sys.executable} -m disagg_bench.routing_sim --as-vllm", profile=None)
        if proc.returncode != 0:
            raise SystemExit(f"run {r + 1} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        print("\n".join(line for line in proc.stdout.splitlines() if " x " in line), flush=True)
        results.append(json.loads((out / "results.json").read_text()))
    lines, p50 = table(results, modes)
    ratio = p50[POLICIES[1]] / p50[POLICIES[0]]
    print(f"\n{runs} runs in {time.monotonic() - started:.0f} s; load average before {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}, after {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} cores")
    print(f"shape: {SYSTEM_TOKENS}-token system prompt, {TURNS} turns of {USER_TOKENS} user + {ANSWER_TOKENS} answer tokens, "
          f"{SESSION_RATE} sessions/s, think {THINK_S} s, {cell_seconds:g} s of arrivals per policy; timing {TIMING}\n")
    print("\n".join(lines))
    print(f"\ngoal: prefix-and-load TTFT p50 <= {GOAL} x least-outstanding's: {ratio:.2f} -> {'met' if ratio <= GOAL else 'NOT met'}")
    print(f"results: {workdir}/run*/results.json")


def as_vllm(argv: list[str]) -> None:
    """The simulator from a `vllm serve` line, with TIMING (bench/disagg_bench/vllm_sim/as_vllm.py without a profile)."""
    from disagg_bench.vllm_sim import as_vllm as adapter, sim

    sys.argv = ["vllm_sim", *adapter.sim_argv(argv, dict(os.environ), TIMING)]
    sim.main()


def main() -> None:
    if sys.argv[1:2] == ["--as-vllm"]:
        as_vllm(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cell-seconds", type=float, default=40.0, help="seconds of session arrivals per policy and run")
    p.add_argument("--peer", action="store_true", help=f"also {PEER} (vllm-router) on the same engines")
    p.add_argument("--workdir", help="keep the runs' results here (default: a temporary folder, kept)")
    a = p.parse_args()
    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="routing-sim-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run(a.runs, a.cell_seconds, a.peer, workdir)


if __name__ == "__main__":
    main()
