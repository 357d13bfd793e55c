"""Fit the simulator's timing parameters to real runs of disagg-localrun, and write them as profiles.

    python -m disagg_bench.vllm_sim.calibrate                 # refit the profiles from bench/results/h200-*.json

What is fitted, from the lowest request rate of each run (no queueing), p50s (of several repetitions of a
run: per cell, the median of the runs' p50s):
- prefill_base_ms + prefill_us_per_token: least squares of direct-push's prefill leg over prompt length;
- tpot_ms: the median TPOT of the push cells;
- link_gbps: the bytes-weighted rate of the transfers the issuing engine logged (vLLM's "KV Transfer
  metrics" lines: prefill's WRITEs in push, decode's READs in pull) or, where a run recorded them per cell,
  its `vllm:nixl_*` counters (`kv_transfer`: prefill's WRITEs in router-push cells);
- intake_us_per_token, registration_rtt_ms: push-sequential minus push-concurrent TTFT through the router is,
  in the simulator's model, the decode's intake of the prompt (its API server, on the path once the leg is sent
  after the prefill) plus one side-channel message plus prefill's wait for its next engine step (half of
  step_ms): a line over prompt length, its slope the intake per token (never below 0), its intercept the rest;
- kv_pickup_ms: what remains of direct-push's "after prefill" (first token - prefill answered) once the
  transfer, the completion notice and one decode step are taken out (never below 0).
Pull made fair (h200-issue20-*: READ zero-copy over cuda_ipc), from the same engines' pull cells, the compute
and registration figures being push's:
- read_gbps: the bytes-weighted rate of decode's READs in router-pull cells (`vllm:nixl_*` counters);
- descriptor_prep_us_per_block: decode's post time per READ (prep + submission, inline in D's engine loop
  in pull) over the blocks read (prompt / the engines' --block-size), pooled;
- pull_pickup_ms: what remains of direct-pull's "after prefill" once the decode's intake, the inline prep, the
  READ and one decode step are taken out (a READ is one-sided: no side-channel message on D's path).
kv_bytes_per_token comes from the model (hack/gpu/make_model.py); the block size from the engines' own
command line. Pure functions but `main`.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any, Iterable

from disagg_bench.results import RESULTS, load_results

REPO = Path(__file__).resolve().parents[3]
CALIBRATION = Path(__file__).with_name("calibration.json")
STEP_MS = 10.0  # prefill's idle engine step: not observable here, the simulator's default
_METRICS = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+), Avg xfer time \(ms\)=([\d.]+).*?Avg MB per transfer=([\d.]+)")


def cells(results: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    return [c for c in results["cells"] if c["mode"] == mode and c["ok"]]


def lowest_rate(results: dict[str, Any], mode: str) -> dict[int, dict[str, Any]]:
    """Per prompt length, the cell of `mode` at the lowest rate."""
    rate = min(results["sweep"]["rates"])
    return {c["prompt_tokens"]: c for c in cells(results, mode) if c["rate"] == rate}


def least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def transfer_gbps(log_lines: Iterable[str]) -> float:
    """Bytes-weighted transfer rate, Gbit/s, from vLLM's periodic KV Transfer metrics lines."""
    mb = ms = 0.0
    for line in log_lines:
        m = _METRICS.search(line)
        if m:
            n, xfer_ms, mb_each = int(m[1]), float(m[2]), float(m[3])
            mb += n * mb_each
            ms += n * xfer_ms
    if not ms:
        raise ValueError("no KV Transfer metrics lines in the engine logs")
    return mb / ms * 8  # MB/ms = GB/s


def engine_log_lines(results: dict[str, Any], role: str) -> list[str]:
    return [line for g in results["groups"] for name, lines in (g.get("key_log_lines") or {}).items()
            if name.startswith(role) for line in lines]


def median_of_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repetitions of one sweep as one run: per cell, each statistic the median over the runs (ok/sent summed)."""
    first = runs[0]
    if any(r["sweep"] != first["sweep"] for r in runs):
        raise ValueError("repetitions of different sweeps")
    by_key: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        for c in r["cells"]:
            by_key.setdefault((c["mode"], c["prompt_tokens"], c["rate"]), []).append(c)
    cells = []
    for (mode, prompt, rate), cs in by_key.items():
        cell: dict[str, Any] = {"mode": mode, "prompt_tokens": prompt, "rate": rate,
                                "ok": sum(c["ok"] for c in cs), "sent": sum(c["sent"] for c in cs), "runs": len(cs)}
        for key in ("ttft", "tpot", "e2e", "prefill_leg", "after_prefill"):
            cell[key] = {}
            for stat in ("mean", "p50", "p90", "p99"):
                vals = [c[key][stat] for c in cs if c.get(key) and c[key].get(stat) is not None]
                cell[key][stat] = statistics.median(vals) if vals else None
        cells.append(cell)
    return {"sweep": first["sweep"], "cells": cells, "groups": [g for r in runs for g in r["groups"]]}


def block_size(results: dict[str, Any]) -> int:
    sizes = {int(m) for g in results["groups"] for m in re.findall(r"--block-size (\d+)", g.get("plan") or "")}
    if len(sizes) != 1:
        raise ValueError(f"the engines' --block-size is not one figure: {sorted(sizes)}")
    return sizes.pop()


def nixl_counters(runs: list[dict[str, Any]], mode: str, engine: str) -> dict[int, dict[str, float]]:
    """Per prompt length, `engine`'s vllm:nixl_* counters of `mode`'s cells at the lowest rate, summed over runs:
    transfers, bytes, xfer_s, post_s."""
    out: dict[int, dict[str, float]] = {}
    for r in runs:
        rate = min(r["sweep"]["rates"])
        for c in r["cells"]:
            if c["mode"] != mode or c["rate"] != rate or not c.get("kv_transfer"):
                continue
            m = c["kv_transfer"][engine]
            acc = out.setdefault(c["prompt_tokens"], {"transfers": 0.0, "bytes": 0.0, "xfer_s": 0.0, "post_s": 0.0})
            acc["transfers"] += m["vllm:nixl_xfer_time_seconds_count"]
            acc["bytes"] += m["vllm:nixl_bytes_transferred_sum"]
            acc["xfer_s"] += m["vllm:nixl_xfer_time_seconds_sum"]
            acc["post_s"] += m["vllm:nixl_post_time_seconds_sum"]
    if not out or not all(a["transfers"] for a in out.values()):
        raise ValueError(f"no vllm:nixl_* transfers of {engine} in {mode} cells")
    return out


def counters_gbps(per_length: dict[int, dict[str, float]]) -> float:
    """Bytes-weighted transfer rate, Gbit/s."""
    return sum(a["bytes"] for a in per_length.values()) / sum(a["xfer_s"] for a in per_length.values()) * 8 / 1e9


def fit_push(push: dict[str, Any], sequential: dict[str, Any], kv_bytes_per_token: int,
             link_gbps: float | None = None) -> dict[str, float]:
    """`link_gbps` None: from the prefill engine's "KV Transfer metrics" log lines."""
    direct = lowest_rate(push, "direct-push")
    lengths = sorted(direct)
    base_s, per_token_s = least_squares([float(n) for n in lengths], [direct[n]["prefill_leg"]["p50"] for n in lengths])
    tpot = statistics.median(c["tpot"]["p50"] for m in ("router-push", "direct-push") for c in lowest_rate(push, m).values())
    link = transfer_gbps(engine_log_lines(push, "prefill")) if link_gbps is None else link_gbps
    seq, conc = lowest_rate(sequential, "router-push-sequential"), lowest_rate(sequential, "router-push")
    both = sorted(n for n in seq if n in conc)
    extra = [seq[n]["ttft"]["p50"] - conc[n]["ttft"]["p50"] for n in both]
    fixed, intake = least_squares([float(n) for n in both], extra)
    if intake <= 0:  # no growth with the prompt: all of it is the message and the step
        fixed, intake = statistics.fmean(extra), 0.0
    rtt = max(0.0, 2 * (fixed - STEP_MS / 2000))
    pickup = statistics.median(
        direct[n]["after_prefill"]["p50"] - n * kv_bytes_per_token * 8 / (link * 1e9) - rtt / 2 - tpot for n in lengths
    )
    return {
        "prefill_base_ms": round(max(0.0, base_s) * 1e3, 2),
        "prefill_us_per_token": round(per_token_s * 1e6, 3),
        "tpot_ms": round(tpot * 1e3, 2),
        "kv_bytes_per_token": kv_bytes_per_token,
        "link_gbps": round(link, 1),
        "registration_rtt_ms": round(rtt * 1e3, 1),
        "step_ms": STEP_MS,
        "kv_pickup_ms": round(max(0.0, pickup) * 1e3, 1),
        "intake_us_per_token": round(intake * 1e6, 3),
    }


def fit_pull(pull: dict[str, Any], push_timing: dict[str, float]) -> dict[str, float]:
    """Pull on the same engines: the same compute, the decode side's READ rate (UCX over TCP on one GPU)."""
    return {**push_timing, "link_gbps": round(transfer_gbps(engine_log_lines(pull, "decode")), 2)}


def fit_pull_fair(pull: dict[str, Any], reads: dict[int, dict[str, float]], timing: dict[str, float],
                  blocks_of: int) -> dict[str, float]:
    """Pull's own figures on `timing`'s engines: `pull` has direct-pull cells, `reads` decode's READ counters."""
    read_gbps = counters_gbps(reads)
    blocks = lambda n: -(-n // blocks_of)  # noqa: E731
    prep_s_per_block = sum(a["post_s"] for a in reads.values()) / sum(a["transfers"] * blocks(n) for n, a in reads.items())
    direct = lowest_rate(pull, "direct-pull")
    pickup = statistics.median(
        direct[n]["after_prefill"]["p50"] - n * timing.get("intake_us_per_token", 0.0) * 1e-6 - blocks(n) * prep_s_per_block
        - n * timing["kv_bytes_per_token"] * 8 / (read_gbps * 1e9) - timing["tpot_ms"] / 1e3
        for n in sorted(direct)
    )
    return {
        **timing,
        "read_gbps": round(read_gbps, 1),
        "descriptor_prep_us_per_block": round(prep_s_per_block * 1e6, 1),
        "pull_pickup_ms": round(max(0.0, pickup) * 1e3, 1),
    }


FAIR_RUNS = ["h200-issue20-1gpu-r1.json", "h200-issue20-1gpu-r2.json", "h200-issue20-1gpu-r3.json"]
PEER_RUNS = ["h200-issue20-peers-r1.json", "h200-issue20-peers-r2.json", "h200-issue20-peers-r3.json"]
# Issue 19's routing runs: 2 prefill + 1 decode engines of the same shape on one H200 (vLLM 0.26.0, push). They have
# no direct-push or sequential cells and no low-rate cell without reuse, so nothing here fits compute, transfer or
# pick-up anew: they are replayed with the fair profile's timing (what they measure is the routing).
ROUTING_RUNS = [f"h200-issue19-{kind}-r{i}.json" for kind in ("routing", "noreuse") for i in range(1, 6)]


def fitted_profiles(load: Any) -> dict[str, dict[str, Any]]:
    """The measured profiles, from the committed results that `load(name)` reads."""
    kv_bytes = 28 * 2 * 8 * 128 * 2  # Qwen3-0.6B shape: layers x (K, V) x KV heads x head dim x bf16
    push = fit_push(load("h200-1gpu-push.json"), load("h200-1gpu-push-sequential.json"), kv_bytes)
    pull = fit_pull(load("h200-1gpu-pull-tcp.json"), push)
    fair = median_of_runs([load(n) for n in FAIR_RUNS])
    peers = [load(n) for n in PEER_RUNS]
    fair_push = fit_push(fair, fair, kv_bytes, counters_gbps(nixl_counters(peers, "router-push", "prefill-0")))
    fair_timing = fit_pull_fair(fair, nixl_counters(peers, "router-pull", "decode-0"), fair_push, block_size(fair))
    return {
        "h200-1gpu-push": {
            "runs": ["h200-1gpu-push.json", "h200-1gpu-push-sequential.json"],
            "source": "bench/results/h200-1gpu-push.json + h200-1gpu-push-sequential.json (vLLM 0.26.0, "
                      "Qwen3-0.6B shape, prefill and decode on one H200, UCX cuda_ipc), fitted by bench/disagg_bench/vllm_sim/calibrate.py",
            "timing": push,
        },
        "h200-1gpu-pull-tcp": {
            "runs": ["h200-1gpu-pull-tcp.json"],
            "source": "bench/results/h200-1gpu-pull-tcp.json: the same engines in pull, whose READ UCX serves "
                      "over TCP between two processes on one GPU (an artefact, not pull's speed), fitted by bench/disagg_bench/vllm_sim/calibrate.py",
            "timing": pull,
        },
        "h200-1gpu-fair": {
            "runs": FAIR_RUNS,
            "source": "bench/results/h200-issue20-1gpu-r{1,2,3}.json (vLLM 0.26.0, Qwen3-0.6B shape, one H200, push and "
                      "pull fair: WRITE and READ zero-copy over cuda_ipc; per cell the median of the three runs) for "
                      "compute, TTFT and pick-up; vLLM's vllm:nixl_* counters of h200-issue20-peers-r{1,2,3}.json (the same "
                      "engines and settings, router-push and router-pull cells at 2/s) for the WRITE and READ rates and "
                      "READ's post time; fitted by bench/disagg_bench/vllm_sim/calibrate.py",
            "timing": fair_timing,
        },
        "h200-issue19-routing": {
            "runs": ROUTING_RUNS,
            "source": "bench/results/h200-issue19-{routing,noreuse}-r{1..5}.json (vLLM 0.26.0, Qwen3-0.6B shape, 2 prefill + "
                      "1 decode engines on one H200, push, prefix caching on): the timing of h200-1gpu-fair, the same shape, "
                      "release, GPU and transfer settings; the runs have no cell that fits compute, transfer or pick-up anew",
            "timing": fair_timing,
        },
    }


def main() -> None:
    load = lambda name: load_results(RESULTS / name)  # noqa: E731
    doc = json.loads(CALIBRATION.read_text())
    doc["profiles"].update(fitted_profiles(load))
    CALIBRATION.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v["timing"] for k, v in doc["profiles"].items()}, indent=1))


if __name__ == "__main__":
    main()
