"""The simulator's prediction next to every real figure: each committed real run replayed, same sweep,
same seed (so the same arrival times), with simulated engines timed by the profile fitted to that run.

    python -m tests.bench.sim_vs_real                       # every bench/results/h200-*.json with a profile (~17 min)
    python -m tests.bench.sim_vs_real --only h200-1gpu-fair # one profile (or one results file's stem)
    python -m tests.bench.router_bench --sim-vs-real        # the same, as a section of the router benchmark

The replay is disagg-localrun itself with `tests.vllm_sim.as_vllm` in place of vLLM: the engines get the
same rendered command lines (hence the same transfer mode) and the real router, in real time. Profiles:
tests/vllm_sim/calibration.json (fitted by tests/vllm_sim/calibrate.py); a run's profile is the one whose
`runs` list names its file. A profile fitted to repetitions of one sweep (the same seed, hence the same
arrivals) is replayed once and compared with the real runs' per-cell medians (calibrate.median_of_runs).
Results files no profile names (other shapes, peers' routers) are listed as not replayed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from disagg_bench.localrun.bench import Sweep, mode, run_bench
from disagg_bench.localrun.cli import read_model
from disagg_bench.localrun.plan import LocalOptions
from tests.vllm_sim import harness as h
from tests.vllm_sim.as_vllm import CALIBRATION
from tests.vllm_sim.calibrate import median_of_runs

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
SIM = (sys.executable, "-m", "tests.vllm_sim.as_vllm")


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
            sweep = json.dumps(json.loads(path.read_text())["sweep"], sort_keys=True)
            sets.setdefault((name, sweep), []).append(path)
    return [(name, ps) for (name, _), ps in sets.items()], orphans


def model_file(real: dict[str, Any]) -> str:
    argv = shlex.split(real["command"])
    return argv[argv.index("-f") + 1]


def replay(real: dict[str, Any], profile: str, work: Path) -> dict[str, Any]:
    s = real["sweep"]
    sweep = Sweep(
        tuple(s["prompts"]), tuple(s["rates"]), tuple(mode(m) for m in s["modes"]), s["max_tokens"], s["cell_seconds"],
        s["min_requests"], s["drain_timeout"], s["seed"],
    )  # fmt: skip
    options = LocalOptions(gpus=("0", "1"), port_base=h.free_port_block(64), workdir=str(work), launcher=SIM,
                           env=(("DISAGG_SIM_PROFILE", profile),))
    with contextlib.redirect_stdout(sys.stderr):  # the plan and per-cell lines: progress, not the result
        return run_bench(read_model(str(REPO / model_file(real))), options, sweep, work, 60, ["tests.bench.sim_vs_real"])


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


def compare(only: list[str] | None = None) -> list[str]:
    sets, orphans = replay_sets(sorted(RESULTS.glob("h200-*.json")))
    if only:
        sets = [(n, ps) for n, ps in sets if n in only or any(p.stem in only for p in ps)]
        orphans = []
    profiles = json.loads(CALIBRATION.read_text())["profiles"]
    out = ["", "## Simulator vs real (each real run replayed with its calibrated profile; ratio = sim / real)"]
    for name, paths in sets:
        runs = [json.loads(p.read_text()) for p in paths]
        real = runs[0] if len(runs) == 1 else {**median_of_runs(runs), "command": runs[0]["command"]}
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="sim-vs-real-") as tmp:
            sim = replay(real, name, Path(tmp))
        what = paths[0].name if len(paths) == 1 else (
            f"{', '.join(p.name for p in paths)}: real = per cell the median of the {len(paths)} runs (ok real: all runs)")
        out += ["", f"### {what}: profile `{name}` ({time.monotonic() - t0:.0f} s)", "",
                "`" + json.dumps(profiles[name]["timing"]) + "`", ""]
        out += table(real, sim)
    if orphans:
        out += ["", "Not replayed (no profile is fitted to them): " + ", ".join(p.name for p in orphans)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", help="a profile or a results file's stem, e.g. h200-1gpu-fair (repeatable)")
    a = ap.parse_args()
    print(f"# command: python -m tests.bench.sim_vs_real {shlex.join(sys.argv[1:])}".rstrip())
    print("\n".join(compare(a.only)))


if __name__ == "__main__":
    main()
