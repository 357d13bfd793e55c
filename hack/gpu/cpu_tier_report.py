"""Issue 31's CPU-tier run (hack/gpu/run.sh issue31-cpu-tier): vLLM's own /metrics of every engine, whole pages,
and the comparison of the run with the tier against the same workload without it.

  cpu_tier_report.py watch DIR URL...      # until killed: every 2 s each engine's /metrics page; the first page that
                                           # answers is kept as DIR/<host_port>-first.prom, the latest as -last.prom
  cpu_tier_report.py report OUT_JSON OUT_MD NAME=RESULTS_DIR...   # per run: results.json's cells (requests served,
                                           # TTFT p50/p90, per engine the prefix-cache and external (connector) hits,
                                           # the vllm:nixl_* transfers) and, from the pages, every series whose
                                           # name has offload/external/cpu/connector/nixl/prefix_cache: last - first

Engines start with their counters at 0, so a fresh engine's first page is the run's "before" (the bench's own
per-cell snapshots, results.json `engine_series`, are exact per cell; the pages add what the bench does not
parse). Standard library only: it runs on the device machine's own python3.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

GREP = re.compile(r"offload|external|cpu|connector|nixl|prefix_cache|request_success|kv_cache_usage|preempt", re.I)


def watch(out: Path, urls: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    while True:
        for url in urls:
            key = re.sub(r"[^0-9A-Za-z]+", "_", url.split("://", 1)[-1]).strip("_")
            try:
                with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            first = out / f"{key}-first.prom"
            if not first.exists():
                first.write_text(text)
            tmp = out / f"{key}-last.prom.tmp"
            tmp.write_text(text)
            tmp.replace(out / f"{key}-last.prom")
        time.sleep(2)


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {series with its labels: value} for the GREP series (histogram buckets left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if not GREP.search(name) or name.endswith(("_bucket", "_created")):
            continue
        try:
            out[key] = float(value)
        except ValueError:
            pass
    return out


def by_name(series: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in series.items():
        name = key.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + value
    return out


HITS, QUERIES, EXT_HITS, EXT_QUERIES = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                                        "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def run_summary(folder: Path) -> dict[str, Any]:
    results = json.loads((folder / "results.json").read_text()) if (folder / "results.json").exists() else {}
    cells = []
    for c in results.get("cells", []):
        roles = c.get("engine_roles", {})
        engines = {}
        for label, series in (c.get("engine_series") or {}).items():
            nixl = (c.get("kv_transfer") or {}).get(label, {})
            engines[label] = {
                "role": roles.get(label), **{k: series.get(k) for k in (HITS, QUERIES, EXT_HITS, "vllm:request_success_total")},
                "hit_ratio": _ratio(series.get(HITS, 0.0), series.get(QUERIES, 0.0)),
                "external_hit_ratio": _ratio(series.get(EXT_HITS, 0.0), series.get(QUERIES, 0.0)),
                "gpu_or_cpu_hit_ratio": _ratio(series.get(HITS, 0.0) + series.get(EXT_HITS, 0.0), series.get(QUERIES, 0.0)),
                "nixl_transfers": nixl.get("vllm:nixl_xfer_time_seconds_count"),
                "nixl_bytes": nixl.get("vllm:nixl_bytes_transferred_sum"),
                "nixl_failed": nixl.get("vllm:nixl_num_failed_transfers_total", nixl.get("vllm:nixl_num_failed_transfers")),
            }
        cells.append({"mode": c.get("mode"), "system_tokens": c.get("prompt_tokens"), "rate": c.get("rate"),
                      "sent": c.get("sent"), "ok": c.get("ok"), "ttft_p50": (c.get("ttft") or {}).get("p50"),
                      "ttft_p90": (c.get("ttft") or {}).get("p90"), "ttft_mean": (c.get("ttft") or {}).get("mean"),
                      "tpot_p50": (c.get("tpot") or {}).get("p50"), "engines": engines})
    pages = {}
    for first in sorted((folder / "metrics").glob("*-first.prom")):
        key = first.name[: -len("-first.prom")]
        last = first.with_name(f"{key}-last.prom")
        a, b = parse(first.read_text()), parse(last.read_text() if last.exists() else "")
        delta = {k: v - a.get(k, 0.0) for k, v in b.items()}
        names = by_name(delta)
        pages[key] = {
            "series_names": sorted(names),
            "delta_by_name": names,
            "delta": {k: v for k, v in delta.items() if v},
            "hit_ratio": _ratio(names.get(HITS, 0.0), names.get(QUERIES, 0.0)),
            "external_hit_ratio_of_queries": _ratio(names.get(EXT_HITS, 0.0), names.get(QUERIES, 0.0)),
            "external_hit_ratio_of_external_queries": _ratio(names.get(EXT_HITS, 0.0), names.get(EXT_QUERIES, 0.0)),
        }
    groups = results.get("groups", [])
    return {"cells": cells, "pages": pages, "startup_seconds": [g.get("startup_seconds") for g in groups],
            "engine_version": [g.get("engine_version") for g in groups], "command": results.get("command")}


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.0f}" if digits == 0 else f"{x:.{digits}f}" if abs(x) < 1e6 else f"{x:.4g}"
    return str(x)


def markdown(runs: dict[str, dict[str, Any]]) -> str:
    lines = ["# Issue 31: a CPU tier (MultiConnector of NIXL push + OffloadingConnector) on real vLLM", "",
             "## Cells (client: requests served, TTFT; per engine: vLLM's counters over the cell)", "",
             "| run | system x sessions/s | ok/sent | TTFT p50 ms | TTFT p90 ms | engine | hits/queries (tokens) | hit ratio | external hits | external / queries | (hits + external) / queries | NIXL transfers | NIXL failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        for c in run["cells"]:
            for label, e in c["engines"].items():
                lines.append(
                    f"| {name} | {c['system_tokens']} x {c['rate']:g} | {c['ok']}/{c['sent']} | {_ms(c['ttft_p50'])} | {_ms(c['ttft_p90'])} "
                    f"| {label} ({e['role']}) | {_f(e[HITS], 0)}/{_f(e[QUERIES], 0)} | {_f(e['hit_ratio'])} | {_f(e[EXT_HITS], 0)} "
                    f"| {_f(e['external_hit_ratio'])} | {_f(e['gpu_or_cpu_hit_ratio'])} | {_f(e['nixl_transfers'], 0)} | {_f(e['nixl_failed'], 0)} |")
    lines += ["", "## Whole run, from each engine's /metrics pages (last - first; the series whose names match "
              f"`{GREP.pattern}`)", ""]
    for name, run in runs.items():
        for key, p in run["pages"].items():
            lines += [f"### {name}: {key}", "",
                      f"hit ratio {_f(p['hit_ratio'])}, external hits / queries {_f(p['external_hit_ratio_of_queries'])}, "
                      f"external hits / external queries {_f(p['external_hit_ratio_of_external_queries'])}", "",
                      "| series | delta |", "|---|---|"]
            lines += [f"| `{k}` | {_f(v, 3)} |" for k, v in sorted(p["delta_by_name"].items())]
            lines.append("")
    return "\n".join(lines) + "\n"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["watch"]:
        watch(Path(argv[1]), argv[2:])
        return 0
    if argv[:1] == ["report"]:
        runs = {}
        for arg in argv[3:]:
            name, _, folder = arg.partition("=")
            runs[name] = run_summary(Path(folder))
        Path(argv[1]).write_text(json.dumps(runs, indent=1))
        Path(argv[2]).write_text(markdown(runs))
        print(markdown(runs))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
