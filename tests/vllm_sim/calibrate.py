"""Fit the simulator's timing parameters to real runs of disagg-localrun, and write them as profiles.

    python -m tests.vllm_sim.calibrate                 # refit the profiles from bench/results/h200-*.json

What is fitted, from the lowest request rate of each run (no queueing), p50s:
- prefill_base_ms + prefill_us_per_token: least squares of direct-push's prefill leg over prompt length;
- tpot_ms: the median TPOT of the push cells;
- link_gbps: the bytes-weighted rate of the transfers the issuing engine logged (vLLM's "KV Transfer
  metrics" lines: prefill's WRITEs in push, decode's READs in pull);
- registration_rtt_ms: push-sequential minus push-concurrent TTFT through the router is one side-channel
  message plus prefill's wait for its next engine step (half of step_ms) in the simulator's model;
- kv_pickup_ms: what remains of direct-push's "after prefill" (first token - prefill answered) once the
  transfer, the completion notice and one decode step are taken out (never below 0).
kv_bytes_per_token comes from the model (hack/gpu/make_model.py); the block size from the engines' own
command line. Pure functions but `main`.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
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


def fit_push(push: dict[str, Any], sequential: dict[str, Any], kv_bytes_per_token: int) -> dict[str, float]:
    direct = lowest_rate(push, "direct-push")
    lengths = sorted(direct)
    base_s, per_token_s = least_squares([float(n) for n in lengths], [direct[n]["prefill_leg"]["p50"] for n in lengths])
    tpot = statistics.median(c["tpot"]["p50"] for m in ("router-push", "direct-push") for c in lowest_rate(push, m).values())
    link = transfer_gbps(engine_log_lines(push, "prefill"))
    seq, conc = lowest_rate(sequential, "router-push-sequential"), lowest_rate(sequential, "router-push")
    extra = statistics.fmean(seq[n]["ttft"]["p50"] - conc[n]["ttft"]["p50"] for n in seq if n in conc)
    rtt = max(0.0, 2 * (extra - STEP_MS / 2000))
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
    }


def fit_pull(pull: dict[str, Any], push_timing: dict[str, float]) -> dict[str, float]:
    """Pull on the same engines: the same compute, the decode side's READ rate (UCX over TCP on one GPU)."""
    return {**push_timing, "link_gbps": round(transfer_gbps(engine_log_lines(pull, "decode")), 2)}


def main() -> None:
    load = lambda name: json.loads((RESULTS / name).read_text())  # noqa: E731
    kv_bytes = 28 * 2 * 8 * 128 * 2  # Qwen3-0.6B shape: layers x (K, V) x KV heads x head dim x bf16
    push = fit_push(load("h200-1gpu-push.json"), load("h200-1gpu-push-sequential.json"), kv_bytes)
    pull = fit_pull(load("h200-1gpu-pull-tcp.json"), push)
    doc = json.loads(CALIBRATION.read_text())
    doc["profiles"]["h200-1gpu-push"] = {
        "runs": ["h200-1gpu-push.json", "h200-1gpu-push-sequential.json"],
        "source": "bench/results/h200-1gpu-push.json + h200-1gpu-push-sequential.json (vLLM 0.26.0, "
                  "Qwen3-0.6B shape, prefill and decode on one H200, UCX cuda_ipc), fitted by tests/vllm_sim/calibrate.py",
        "timing": push,
    }
    doc["profiles"]["h200-1gpu-pull-tcp"] = {
        "runs": ["h200-1gpu-pull-tcp.json"],
        "source": "bench/results/h200-1gpu-pull-tcp.json: the same engines in pull, whose READ UCX serves "
                  "over TCP between two processes on one GPU (an artefact, not pull's speed), fitted by tests/vllm_sim/calibrate.py",
        "timing": pull,
    }
    CALIBRATION.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v["timing"] for k, v in doc["profiles"].items()}, indent=1))


if __name__ == "__main__":
    main()
