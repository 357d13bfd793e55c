"""The simulator's prediction next to every real figure: each committed real run replayed, same sweep,
same seed (so the same arrival times), with simulated engines timed by the profile fitted to that run.

    python -m disagg_bench.sim_vs_real                       # every bench/results/h200-*.json with a profile (~22 min)
    python -m disagg_bench.sim_vs_real --only h200-1gpu-fair # one profile (or one results file's stem)
    python -m disagg_bench.router_bench --sim-vs-real        # the same, as a section of the router benchmark

The replay is disagg-localrun itself with `disagg_bench.vllm_sim.as_vllm` in place of vLLM: the engines get the
same rendered command lines (hence the same transfer mode) and the real router, in real time. Profiles:
bench/disagg_bench/vllm_sim/calibration.json (fitted by bench/disagg_bench/vllm_sim/calibrate.py); a run's profile is the one whose
`runs` list names its file. A profile fitted to repetitions of one sweep (the same seed, hence the same
arrivals) is replayed once and compared with the real runs' per-cell medians (calibrate.median_of_runs).
Results files no profile names (other shapes, peers' routers) are listed as not replayed.

Each cell runs its modes in the order the real run did (the order of its results' cells; `bench.cell_order` now
rotates them, the committed runs did not), vllm-router's modes with the test extra's vllm-router, and the
simulated engines answer as the release the real ones reported (`engine_version`, DISAGG_SIM_VLLM_VERSION).
Multi-turn runs (issue 19's routing) get their own table: the prefill engines' prefix hit ratio by vLLM's
counters, the one-engine ideal, the prefill shares, TTFT p50 and p90.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from disagg_bench.localrun import report
from disagg_bench.localrun.bench import Mode, Sweep, mode, run_bench
from disagg_bench.localrun.cli import read_model
from disagg_bench.localrun.plan import LocalOptions
from disagg_bench.results import RESULTS, load_results, raw_files
from disagg_bench.vllm_sim import harness as h
from disagg_bench.vllm_sim.as_vllm import CALIBRATION
from disagg_bench.vllm_sim.calibrate import median_of_runs

REPO = Path(__file__).resolve().parents[2]
SIM = (sys.executable, "-m", "disagg_bench.vllm_sim.as_vllm")
PEER_ROUTER = (sys.executable, "-m", "vllm_router.launch_router")  # vllm-router 0.1.17, the test extra's pin


def profile_for(path: Path) -> str | None:
    profiles = json.loads(CALIBRATION.read_text())["profiles"]
    names = [n for n, p in profiles.items() if path.name in p.get("runs", ())]
    return names[0] if names else None


def replay_sets(paths: list[Path]) -> tuple[list[tuple[str, list[Path]]], list[Path]]:
    """What to replay, in order: (profile, the results files fitted to it that repeat one sweep); and the files
    no profile names."""
    sets: dict[tuple[str, str], list[Path]] = {}
    orphans = []
    for path in paths:
        name = profile_for(path)
        if name is None:
            orphans.append(path)
        else:
            sweep = json.dumps(load_results(path)["sweep"], sort_keys=True)
            sets.setdefault((name, sweep), []).append(path)
    return [(name, ps) for (name, _), ps in sets.items()], orphans


def model_file(real: dict[str, Any]) -> str:
    argv = shlex.split(real["command"])
    return argv[argv.index("-f") + 1]


def option(real: dict[str, Any], flag: str) -> str | None:
    """The value of `flag` on the real run's command line (None without it)."""
    argv = shlex.split(real["command"])
    return argv[argv.index(flag) + 1] if flag in argv else None


def engine_version(real: dict[str, Any]) -> str | None:
    """The vLLM release the real engines reported (GET /version), for the simulated ones to answer as: vllm-router
    learns push only from 0.33.0's answers (tests/unit/bench/test_sim_vllm_version.py)."""
    return next((g["engine_version"] for g in real["groups"] if g.get("engine_version")), None)


def real_order(real: dict[str, Any]) -> dict[tuple[int, float], list[str]]:
    """Per cell, the order its modes ran in on the real engines (the results list cells as they ran)."""
    out: dict[tuple[int, float], list[str]] = {}
    for c in real["cells"]:
        out.setdefault((c["prompt_tokens"], c["rate"]), []).append(c["mode"])
    return out


def replay(real: dict[str, Any], profile: str, work: Path) -> dict[str, Any]:
    s = real["sweep"]
    sweep = Sweep(
        tuple(s["prompts"]), tuple(s["rates"]), tuple(mode(m) for m in s["modes"]), s["max_tokens"], s["cell_seconds"],
        s["min_requests"], s["drain_timeout"], s["seed"], s.get("workload", "no-reuse"), s.get("turns", 4),
        s.get("user_tokens", 256), s.get("think_time", 1.0), s.get("prompt_format", "text"), s.get("replica_spread", "session"),
    )  # fmt: skip
    colocate = "--colocate" in shlex.split(real["command"])
    memory = option(real, "--kv-cache-memory-bytes")
    env = (("DISAGG_SIM_PROFILE", profile), *((("DISAGG_SIM_VLLM_VERSION", v),) if (v := engine_version(real)) else ()))
    options = LocalOptions(gpus=("0",) if colocate else ("0", "1"), colocate=colocate, port_base=h.free_port_block(64),
                           workdir=str(work), launcher=SIM, env=env, kv_cache_memory_bytes=int(memory) if memory else None,
                           peer_router_command=PEER_ROUTER)
    # The same modes in the same order per cell as on the real engines: runs before bench.cell_order (which now
    # rotates them) ran every cell in the sweep's order, and runs 4-5 of issue 19 in another order than 1-3.
    ran = real_order(real)
    cells = [(p, r) for p in sweep.prompts for r in sweep.rates]

    def as_ran(modes: Sequence[Mode], k: int) -> list[Mode]:  # this group's modes (one transfer mode) as they ran
        names = ran.get(cells[k], [])
        return sorted(modes, key=lambda m: names.index(m.name) if m.name in names else len(names))

    with contextlib.redirect_stdout(sys.stderr):  # the plan and per-cell lines: progress, not the result
        return run_bench(read_model(str(REPO / model_file(real))), options, sweep, work, 60, ["disagg_bench.sim_vs_real"],
                         order=as_ran)


def _ratio(sim: float | None, real: float | None) -> str:
    return f"{sim / real:.2f}" if sim is not None and real else "-"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def table(real: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    sim_cells = {(c["prompt_tokens"], c["rate"], c["mode"]): c for c in sim["cells"]}
    lines = ["| prompt | rate/s | mode | TTFT p50 real | sim | sim/real | TTFT mean real | sim | sim/real | "
             "TPOT p50 real | sim | sim/real | ok real | sim |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in real["cells"]:
        s = sim_cells.get((c["prompt_tokens"], c["rate"], c["mode"]))
        if s is None:
            continue
        lines.append(
            f"| {c['prompt_tokens']} | {c['rate']:g} | {c['mode']} | {_ms(c['ttft']['p50'])} | {_ms(s['ttft']['p50'])} | "
            f"{_ratio(s['ttft']['p50'], c['ttft']['p50'])} | {_ms(c['ttft']['mean'])} | {_ms(s['ttft']['mean'])} | "
            f"{_ratio(s['ttft']['mean'], c['ttft']['mean'])} | {_ms(c['tpot']['p50'])} | {_ms(s['tpot']['p50'])} | "
            f"{_ratio(s['tpot']['p50'], c['tpot']['p50'])} | {c['ok']}/{c['sent']} | {s['ok']}/{s['sent']} |"
        )
    return lines


def _median(xs: list[float | None]) -> float | None:
    present = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(present) if present else None


def _shares(figs: list[report.Routing]) -> str:
    labels = sorted({k for f in figs for k in f.shares})
    return " / ".join(f"{_median([f.shares.get(k, 0.0) for f in figs]):.2f}" for k in labels) or "-"


def routing_table(runs: list[dict[str, Any]], sim: dict[str, Any]) -> list[str]:
    """Multi-turn cells: the prefill engines' prefix hit ratio (vLLM's counters; real: the median of the runs'),
    the prefill engines' shares of the requests, TTFT p50 and p90 (real: the median of the runs' p50s, p90s)."""
    sim_cells = {(c["prompt_tokens"], c["rate"], c["mode"]): c for c in sim["cells"]}
    real_cells: dict[tuple[int, float, str], list[dict[str, Any]]] = {}
    for run in runs:
        for c in run["cells"]:
            real_cells.setdefault((c["prompt_tokens"], c["rate"], c["mode"]), []).append(c)
    lines = ["| system prompt | sessions/s | mode | runs | hit ratio real | sim | sim - real | ideal | "
             "prefill share per engine real | sim | TTFT p50 real | sim | sim/real | TTFT p90 real | sim | sim/real | ok real | sim |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, cs in real_cells.items():
        s = sim_cells.get(key)
        figs = [f for f in map(report.routing, cs) if f]
        sim_fig = report.routing(s) if s else None
        if s is None or not figs or sim_fig is None:
            continue
        hit = _median([f.hit_ratio for f in figs])
        ideal = report.ideal_hit_ratio(runs[0], key[0], key[1])
        p50, p90 = _median([c["ttft"]["p50"] for c in cs]), _median([c["ttft"]["p90"] for c in cs])
        lines.append(
            f"| {key[0]} | {key[1]:g} | {key[2]} | {len(cs)} | {hit:.3f} | {sim_fig.hit_ratio:.3f} | "
            f"{sim_fig.hit_ratio - hit:+.3f} | {ideal:.3f} | {_shares(figs)} | {_shares([sim_fig])} | {_ms(p50)} | "
            f"{_ms(s['ttft']['p50'])} | {_ratio(s['ttft']['p50'], p50)} | {_ms(p90)} | {_ms(s['ttft']['p90'])} | "
            f"{_ratio(s['ttft']['p90'], p90)} | {sum(c['ok'] for c in cs)}/{sum(c['sent'] for c in cs)} | {s['ok']}/{s['sent']} |"
        )
    return lines


def compare(only: list[str] | None = None, save: Path | None = None) -> list[str]:
    sets, orphans = replay_sets(raw_files(RESULTS, "h200-*"))
    if only:
        sets = [(n, ps) for n, ps in sets if n in only or any(p.stem in only for p in ps)]
        orphans = []
    profiles = json.loads(CALIBRATION.read_text())["profiles"]
    out = ["", "## Simulator vs real (each real run replayed with its calibrated profile; ratio = sim / real)"]
    for name, paths in sets:
        runs = [load_results(p) for p in paths]
        real = runs[0] if len(runs) == 1 else {**median_of_runs(runs), "command": runs[0]["command"]}
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="sim-vs-real-") as tmp:
            sim = replay(real, name, Path(tmp))
        if save is not None:
            save.mkdir(parents=True, exist_ok=True)
            (save / f"{paths[0].stem}-sim.json").write_text(json.dumps(sim, indent=1))
        what = paths[0].name if len(paths) == 1 else (
            f"{', '.join(p.name for p in paths)}: real = per cell the median of the {len(paths)} runs (ok real: all runs)")
        out += ["", f"### {what}: profile `{name}` ({time.monotonic() - t0:.0f} s)", "",
                "`" + json.dumps(profiles[name]["timing"]) + "`", ""]
        out += routing_table(runs, sim) if real["sweep"].get("workload") == "multi-turn" else table(real, sim)
    if orphans:
        out += ["", "Not replayed (no profile is fitted to them): " + ", ".join(p.name for p in orphans)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", help="a profile or a results file's stem, e.g. h200-1gpu-fair (repeatable)")
    ap.add_argument("--save", type=Path, help="also write each replay's results (the simulator's) into this folder")
    a = ap.parse_args()
    print(f"# command: python -m disagg_bench.sim_vs_real {shlex.join(sys.argv[1:])}".rstrip())
    print("\n".join(compare(a.only, a.save)))


if __name__ == "__main__":
    main()
