"""Results of a sweep as JSON-ready dicts and as markdown tables (pure)."""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from dataclasses import dataclass
from typing import Any

from disagg_connector import vllm_metrics

from .loadgen import CellSummary


def summary_dict(s: CellSummary) -> dict[str, Any]:
    return dataclasses.asdict(s)


def _ms(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-"
    ms = x * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    return f"{a / b:.2f}"


def cell_line(s: CellSummary) -> str:
    return (f"{s.prompt_tokens:>6} x {s.rate:g}/s {s.mode:<24} ok {s.ok}/{s.sent}  TTFT mean {_ms(s.ttft.mean)} "
            f"p50 {_ms(s.ttft.p50)} p90 {_ms(s.ttft.p90)} ms  TPOT mean {_ms(s.tpot.mean)} p50 {_ms(s.tpot.p50)} ms")


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results as one (e.g. push and pull measured in two calls): every cell, group and
    warm-up request; modes, prompts and rates in the order first seen."""
    def union(key: str) -> list[Any]:
        out: list[Any] = []
        for r in runs:
            out += [x for x in r["sweep"][key] if x not in out]
        return out

    first = runs[0]
    return {
        **first,
        "command": " ; ".join(r["command"] for r in runs),
        "started": ", ".join(r["started"] for r in runs),
        "sweep": {**first["sweep"], "modes": union("modes"), "prompts": union("prompts"), "rates": union("rates")},
        "groups": [g for r in runs for g in r["groups"]],
        "cells": [c for r in runs for c in r["cells"]],
        "warmup": [w for r in runs for w in r["warmup"]],
        "records": [x for r in runs for x in r.get("records", [])],
    }


def _cells(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Cells by prompt, rate, then mode, in the sweep's orders."""
    sweep = results["sweep"]
    order = {key: {v: i for i, v in enumerate(sweep[key])} for key in ("prompts", "rates", "modes")}
    return sorted(results.get("cells", []), key=lambda c: (order["prompts"].get(c["prompt_tokens"], 0),
                                                           order["rates"].get(c["rate"], 0), order["modes"].get(c["mode"], 0)))


def main_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| prompt | rate/s | mode | ok/sent | TTFT mean | p50 | p90 | p99 | TPOT mean | p50 | p90 | e2e p50 | p90 |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in _cells(results):
        t, p, e = c["ttft"], c["tpot"], c["e2e"]
        lines.append(
            f"| {c['prompt_tokens']} | {c['rate']:g} | {c['mode']} | {c['ok']}/{c['sent']} | {_ms(t['mean'])} | {_ms(t['p50'])} | "
            f"{_ms(t['p90'])} | {_ms(t['p99'])} | {_ms(p['mean'])} | {_ms(p['p50'])} | {_ms(p['p90'])} | {_ms(e['p50'])} | {_ms(e['p90'])} |"
        )
    return lines


def ratio_table(results: dict[str, Any], baseline: str) -> list[str]:
    """Each mode's TTFT and TPOT over the baseline mode's, cell by cell."""
    by_key = {(c["prompt_tokens"], c["rate"], c["mode"]): c for c in _cells(results)}
    modes = [m for m in results["sweep"]["modes"] if m != baseline]
    if baseline not in results["sweep"]["modes"] or not modes:
        return []
    head = " | ".join(f"{m} TTFT mean | p50 | TPOT mean" for m in modes)
    lines = [f"| prompt | rate/s | {head} |", "|---:|---:|" + "---:|" * (3 * len(modes))]
    for prompt in results["sweep"]["prompts"]:
        for rate in results["sweep"]["rates"]:
            base = by_key.get((prompt, rate, baseline))
            if base is None:
                continue
            cols = []
            for m in modes:
                c = by_key.get((prompt, rate, m))
                if c is None:
                    cols += ["-", "-", "-"]
                    continue
                cols += [_ratio(c["ttft"]["mean"], base["ttft"]["mean"]), _ratio(c["ttft"]["p50"], base["ttft"]["p50"]),
                         _ratio(c["tpot"]["mean"], base["tpot"]["mean"])]
            lines.append(f"| {prompt} | {rate:g} | " + " | ".join(cols) + " |")
    return lines


def split_table(results: dict[str, Any]) -> list[str]:
    """Direct dispatch: TTFT = prefill leg (+ for push, overlapped) and what follows it."""
    rows = [c for c in _cells(results) if c["prefill_leg"]["n"]]
    if not rows:
        return []
    lines = ["| prompt | rate/s | mode | TTFT p50 | prefill leg p50 | after prefill p50 (KV wait + first step) | mean |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for c in rows:
        lines.append(f"| {c['prompt_tokens']} | {c['rate']:g} | {c['mode']} | {_ms(c['ttft']['p50'])} | {_ms(c['prefill_leg']['p50'])} | "
                     f"{_ms(c['after_prefill']['p50'])} | {_ms(c['after_prefill']['mean'])} |")
    return lines


def kv_transfer_totals(cell: dict[str, Any]) -> dict[str, float]:
    """A cell's vLLM KV-transfer series (bench.KV_TRANSFER_PREFIX), summed over its engines (in push the
    prefill engine counts the WRITEs, in pull the decode engine the READs)."""
    total: dict[str, float] = {}
    for series in (cell.get("kv_transfer") or {}).values():
        for name, value in series.items():
            total[name] = total.get(name, 0.0) + value
    return total


def _per(total: dict[str, float], name: str, scale: float, fmt: str) -> str:
    n = total.get(f"{name}_count", 0.0)
    return format(total.get(f"{name}_sum", 0.0) / n * scale, fmt) if n else "-"


def peer_router_paths(counters: dict[str, float]) -> tuple[float, float]:
    """vllm-router's prefill legs by dispatch path, from its `vllm_router_pd_prefill_requests_total{worker}`."""
    legs = [(k, v) for k, v in counters.items() if k.startswith("vllm_router_pd_prefill_requests_total{")]
    sequential = sum(v for k, v in legs if 'worker="http' in k)
    return sequential, sum(v for _, v in legs) - sequential


def kv_transfer_table(results: dict[str, Any]) -> list[str]:
    """Per cell, what vLLM counted of its NIXL transfers during the cell (its /metrics, after - before)."""
    rows = [(c, kv_transfer_totals(c)) for c in _cells(results)]
    rows = [(c, t) for c, t in rows if t]  # engines that publish no vllm:nixl_* series (the simulator): no table
    if not rows:
        return []
    lines = ["| prompt | rate/s | mode | requests ok | NIXL transfers | xfer time mean (ms) | post time mean (ms) | "
             "MB per transfer | descriptors per transfer | failed transfers | failed notifications | expired KV |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c, t in rows:
        lines.append(
            f"| {c['prompt_tokens']} | {c['rate']:g} | {c['mode']} | {c['ok']} | {t.get('vllm:nixl_xfer_time_seconds_count', 0):.0f} | "
            f"{_per(t, 'vllm:nixl_xfer_time_seconds', 1e3, '.1f')} | {_per(t, 'vllm:nixl_post_time_seconds', 1e3, '.1f')} | "
            f"{_per(t, 'vllm:nixl_bytes_transferred', 1e-6, '.1f')} | {_per(t, 'vllm:nixl_num_descriptors', 1, '.0f')} | "
            f"{t.get('vllm:nixl_num_failed_transfers_total', 0):.0f} | {t.get('vllm:nixl_num_failed_notifications_total', 0):.0f} | "
            f"{t.get('vllm:nixl_num_kv_expired_reqs_total', 0):.0f} |"
        )
    return lines


def repeats_table(runs: list[dict[str, Any]], baseline: str) -> list[str]:
    """The same sweep run several times: per cell, the median over the runs of each run's TTFT p50 and TPOT
    p50 (with the runs' spread), and the median TTFT's ratio to the baseline mode's."""
    cells: dict[tuple[int, float, str], list[dict[str, Any]]] = {}
    for run in runs:
        for c in run["cells"]:
            cells.setdefault((c["prompt_tokens"], c["rate"], c["mode"]), []).append(c)

    def median(key: tuple[int, float, str], metric: str) -> tuple[float, float, float] | None:
        values = [c[metric]["p50"] for c in cells.get(key, []) if c[metric]["p50"] is not None and not math.isnan(c[metric]["p50"])]
        return (statistics.median(values), min(values), max(values)) if values else None

    sweep = merge(runs)["sweep"]
    lines = [f"| prompt | rate/s | mode | runs | TTFT p50, median of runs (min-max) | / {baseline} | TPOT p50, median (min-max) |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for prompt in sweep["prompts"]:
        for rate in sweep["rates"]:
            base = median((prompt, rate, baseline), "ttft")
            for m in sweep["modes"]:
                ttft, tpot = median((prompt, rate, m), "ttft"), median((prompt, rate, m), "tpot")
                if ttft is None:
                    continue
                spread = lambda v: f"{_ms(v[0])} ({_ms(v[1])}-{_ms(v[2])})" if v else "-"  # noqa: E731
                lines.append(f"| {prompt} | {rate:g} | {m} | {len(cells[prompt, rate, m])} | {spread(ttft)} | "
                             f"{_ratio(ttft[0], base[0] if base else None)} | {spread(tpot)} |")
    return lines


def repeats_kv_table(runs: list[dict[str, Any]]) -> list[str]:
    """The same sweep run several times: per cell, vLLM's NIXL transfers summed over the runs and the median over
    the runs of each run's mean transfer and post time; empty when no run recorded `vllm:nixl_*` series."""
    cells: dict[tuple[int, float, str], list[dict[str, float]]] = {}
    for run in runs:
        for c in run["cells"]:
            totals = kv_transfer_totals(c)
            if totals:
                cells.setdefault((c["prompt_tokens"], c["rate"], c["mode"]), []).append(totals)
    if not cells:
        return []

    def median_ms(totals: list[dict[str, float]], name: str) -> str:
        values = [t[f"{name}_sum"] / t[f"{name}_count"] for t in totals if t.get(f"{name}_count")]
        return f"{statistics.median(values) * 1e3:.1f}" if values else "-"

    sweep = merge(runs)["sweep"]
    lines = ["| prompt | rate/s | mode | runs | NIXL transfers (all runs) | xfer time mean, median of runs (ms) | "
             "post time mean, median (ms) | failed transfers | expired KV |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for prompt in sweep["prompts"]:
        for rate in sweep["rates"]:
            for m in sweep["modes"]:
                totals = cells.get((prompt, rate, m))
                if not totals:
                    continue
                count = lambda name: sum(t.get(name, 0.0) for t in totals)  # noqa: E731
                lines.append(f"| {prompt} | {rate:g} | {m} | {len(totals)} | {count('vllm:nixl_xfer_time_seconds_count'):.0f} | "
                             f"{median_ms(totals, 'vllm:nixl_xfer_time_seconds')} | {median_ms(totals, 'vllm:nixl_post_time_seconds')} | "
                             f"{count('vllm:nixl_num_failed_transfers_total'):.0f} | {count('vllm:nixl_num_kv_expired_reqs_total'):.0f} |")
    return lines


# --- routing: prefix-cache hits and how the prefill engines shared the work --------------------------------
HITS, QUERIES, SERVED = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens a connector (a CPU tier) gave back
SIM_PREFILLS = "sim:prefills"


@dataclass(frozen=True)
class Routing:
    """One cell's routing figures, from every prefill engine's counters (after - before the cell)."""

    hit_ratio: float  # pooled over the prefill engines: sum of hits / sum of queries (tokens)
    engine_hit_ratios: dict[str, float]  # per prefill engine
    shares: dict[str, float]  # each prefill engine's share of the cell's prefill requests
    external_hit_ratio: float = 0.0  # pooled: prompt tokens a CPU tier gave back / sum of queries (tokens)

    @property
    def imbalance(self) -> float:
        """The busiest prefill engine's share times the number of engines: 1 = even, N = all on one."""
        return max(self.shares.values()) * len(self.shares) if self.shares else math.nan


def routing(cell: dict[str, Any]) -> Routing | None:
    """A cell's routing figures, or None when it recorded no engine series. Requests served per engine: vLLM's
    `vllm:request_success_total`, or the simulator's prefill count where vLLM's series is absent."""
    series, roles = cell.get("engine_series") or {}, cell.get("engine_roles") or {}
    prefill = sorted(label for label in series if roles.get(label) == "prefill")
    if not prefill:
        return None
    hits = {label: series[label].get(HITS, 0.0) for label in prefill}
    queries = {label: series[label].get(QUERIES, 0.0) for label in prefill}
    served = {label: series[label].get(SERVED) if SERVED in series[label] else series[label].get(SIM_PREFILLS, 0.0)
              for label in prefill}  # fmt: skip
    total_served, total_queries = sum(served.values()), sum(queries.values())
    external = sum(series[label].get(EXTERNAL_HITS, 0.0) for label in prefill)
    return Routing(
        external_hit_ratio=external / total_queries if total_queries else math.nan,
        hit_ratio=sum(hits.values()) / total_queries if total_queries else math.nan,
        engine_hit_ratios={label: hits[label] / queries[label] if queries[label] else math.nan for label in prefill},
        shares={label: served[label] / total_served for label in prefill} if total_served else {},
    )


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _labels(series: str) -> dict[str, str]:
    """`name{a="x",b="y"}` -> {"a": "x", "b": "y"}."""
    _, _, rest = series.partition("{")
    return dict(_LABEL.findall(rest))


@dataclass(frozen=True)
class ReplicaCounts:
    """What one router replica counted during a cell (its own /metrics, after - before)."""

    requests: dict[str, float]  # by HTTP status code
    prefill_picks: dict[str, float]  # by the policy's reason (cache_hit, load, in_flight, only)
    failures: dict[str, float]  # by cause (its attempts' and streams' failures, client disconnects)

    @property
    def ok(self) -> float:
        return self.requests.get("200", 0.0)

    @property
    def not_ok(self) -> float:
        return sum(v for code, v in self.requests.items() if code != "200")


def router_replicas(cell: dict[str, Any]) -> dict[str, ReplicaCounts]:
    """A cell's counts per router replica (by replica label: the mode, then `mode#1`, ...); {} when none recorded."""
    out: dict[str, ReplicaCounts] = {}
    for label, series in (cell.get("router_series") or {}).items():
        requests: dict[str, float] = {}
        picks: dict[str, float] = {}
        failures: dict[str, float] = {}
        for key, value in series.items():
            labels = _labels(key)
            if key.startswith("disagg_router_requests_total"):
                requests[labels.get("code", "?")] = requests.get(labels.get("code", "?"), 0.0) + value
            elif key.startswith("disagg_router_picks_total") and labels.get("role") == "prefill":
                picks[labels.get("reason", "?")] = picks.get(labels.get("reason", "?"), 0.0) + value
            elif key.startswith("disagg_router_failures_total"):
                failures[labels.get("cause", "?")] = failures.get(labels.get("cause", "?"), 0.0) + value
        nonzero = lambda d: {k: v for k, v in d.items() if v}  # noqa: E731
        out[label] = ReplicaCounts(nonzero(requests), nonzero(picks), nonzero(failures))
    return out


def replicas_table(results: dict[str, Any]) -> list[str]:
    """Per cell and router replica: its requests by status and its prefill picks by reason; empty with one replica."""
    rows = [(c, router_replicas(c)) for c in _cells(results)]
    if not any(len(r) > 1 for _, r in rows):
        return []
    lines = ["| prompt | rate/s | mode | replica | requests 200 | other | prefill picks by reason | failures by cause |",
             "|---:|---:|---|---|---:|---:|---|---|"]
    for c, replicas in rows:
        for label, counts in replicas.items():
            picks = ", ".join(f"{reason} {n:g}" for reason, n in sorted(counts.prefill_picks.items())) or "-"
            failures = ", ".join(f"{cause} {n:g}" for cause, n in sorted(counts.failures.items())) or "-"
            lines.append(f"| {c['prompt_tokens']} | {c['rate']:g} | {c['mode']} | {label} | {counts.ok:g} | {counts.not_ok:g} | {picks} | {failures} |")
    return lines


def ideal_hit_ratio(results: dict[str, Any], system_tokens: int, rate: float) -> float | None:
    """A multi-turn cell's hit ratio on one engine holding everything (loadgen.MultiTurnWorkload), with the block
    size of the engines' command line; None for other workloads."""
    from .loadgen import MultiTurnWorkload, requests_per_cell

    sweep = results["sweep"]
    if sweep.get("workload") != "multi-turn":
        return None
    plan = next((g["plan"] for g in results.get("groups", []) if g.get("plan")), "")
    block = re.search(r"--block-size[ =](\d+)", plan)
    w = MultiTurnWorkload(rate, requests_per_cell(rate, sweep["cell_seconds"], sweep["min_requests"]), sweep["turns"],
                          system_tokens, sweep["user_tokens"], sweep["max_tokens"], sweep["think_time"])
    return w.ideal_hit_ratio(int(block.group(1)) if block else 1)


def _ratio_fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def routing_table(runs: list[dict[str, Any]], baseline: str) -> list[str]:
    """One row per (prompt, rate, mode): the prefill prefix hit ratio (pooled, and per engine), the prefill
    engines' shares of the requests and their imbalance, TTFT p50/p90, TPOT p50, e2e p50 and TTFT p50 over the
    baseline mode's. Several runs of one sweep (repetitions): the median over the runs of each run's figure.
    Empty when no cell recorded engine series."""
    cells: dict[tuple[int, float, str], list[dict[str, Any]]] = {}
    for run in runs:
        for c in run["cells"]:
            if routing(c) is not None:
                cells.setdefault((c["prompt_tokens"], c["rate"], c["mode"]), []).append(c)
    if not cells:
        return []

    def med(values: list[float | None]) -> float:
        xs = [v for v in values if v is not None and not math.isnan(v)]
        return statistics.median(xs) if xs else math.nan

    def figure(key: tuple[int, float, str], pick: Any) -> float:
        return med([pick(c) for c in cells.get(key, [])])

    merged = merge(runs)
    sweep = merged["sweep"]
    multi = sweep.get("workload") == "multi-turn"
    axis = "system prompt" if multi else "prompt"
    lines = [f"| {axis} | rate/s | mode | runs | prefill hit ratio | per engine | prefill share per engine | imbalance | "
             f"TTFT p50 | p90 | TPOT p50 | e2e p50 | TTFT p50 / {baseline} |",
             "|---:|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for prompt in sweep["prompts"]:
        for rate in sweep["rates"]:
            ideal = ideal_hit_ratio(merged, prompt, rate)
            base = figure((prompt, rate, baseline), lambda c: c["ttft"]["p50"])
            for m in sweep["modes"]:
                key = (prompt, rate, m)
                if key not in cells:
                    continue
                figs = [routing(c) for c in cells[key]]
                labels = sorted({label for f in figs if f for label in f.shares} | {label for f in figs if f for label in f.engine_hit_ratios})
                per_engine = " / ".join(_ratio_fmt(med([f.engine_hit_ratios.get(label) for f in figs if f])) for label in labels)
                shares = " / ".join(_ratio_fmt(med([f.shares.get(label) for f in figs if f])) for label in labels)
                ttft = figure(key, lambda c: c["ttft"]["p50"])
                lines.append(
                    f"| {prompt} | {rate:g} | {m} | {len(cells[key])} | {_ratio_fmt(med([f.hit_ratio for f in figs if f]))} | "
                    f"{per_engine} | {shares} | {_ratio_fmt(med([f.imbalance for f in figs if f]))} | {_ms(ttft)} | "
                    f"{_ms(figure(key, lambda c: c['ttft']['p90']))} | {_ms(figure(key, lambda c: c['tpot']['p50']))} | "
                    f"{_ms(figure(key, lambda c: c['e2e']['p50']))} | {_ratio(ttft, base)} |")
            if ideal is not None:
                lines.append(f"| {prompt} | {rate:g} | *one engine holding everything* | | {ideal:.2f} | | | | | | | | |")
    return lines


def gauges_table(results: dict[str, Any]) -> list[str]:
    """Per cell and engine, the scheduler's gauges sampled while the cell ran (bench.SCHEDULER_GAUGES)."""
    rows = [c for c in _cells(results) if c.get("engine_gauges")]
    if not rows:
        return []
    lines = ["| prompt | rate/s | mode | engine | running mean | waiting mean | waiting max | KV usage mean | KV usage max | samples |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in rows:
        for engine, g in sorted(c["engine_gauges"].items()):
            get = lambda name, stat: g.get(name, {}).get(stat)  # noqa: E731
            lines.append(
                f"| {c['prompt_tokens']} | {c['rate']:g} | {c['mode']} | {engine} | {_num(get(vllm_metrics.RUNNING, 'mean'), '.1f')} | "
                f"{_num(get(vllm_metrics.WAITING, 'mean'), '.1f')} | {_num(get(vllm_metrics.WAITING, 'max'), '.0f')} | "
                f"{_num(get(vllm_metrics.KV_USAGE, 'mean'), '.2f')} | {_num(get(vllm_metrics.KV_USAGE, 'max'), '.2f')} | "
                f"{max((s.get('samples', 0) for s in g.values()), default=0)} |"
            )
    return lines


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(results: dict[str, Any], baseline: str | None = None) -> str:
    sweep = results["sweep"]
    baseline = baseline or sweep["modes"][0]
    env = results.get("environment") or {}
    out = [
        "# disagg-localrun results",
        "",
        f"Command: `{results['command']}`  ",
        f"Started {results['started']}; {sweep['max_tokens']} output tokens; Poisson arrivals, "
        f"{sweep['cell_seconds']:g} s of arrivals per cell (at least {sweep['min_requests']} requests); seed {sweep['seed']}.  ",
        *([f"Workload multi-turn: sessions arrive at the rate (sessions/s), {sweep['turns']} turns each, the prompt column is "
           f"the shared system prompt's tokens, {sweep['user_tokens']} tokens per user message, answers of {sweep['max_tokens']} "
           f"tokens resent as history, think time {sweep['think_time']:g} s mean (exponential).  "]
          if sweep.get("workload") == "multi-turn" else []),
        *([f"Prompts sent as {sweep['prompt_format']}.  "] if sweep.get("prompt_format", "text") != "text" else []),
        *([f"Router replicas: requests spread over them per {sweep.get('replica_spread', 'session')} (round robin).  "]
          if any(len(router_replicas(c)) > 1 for c in results.get("cells", [])) else []),
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "gpus") + ("  " if env else ""),
    ]
    if env.get("gpus"):
        out.append("GPUs: " + "; ".join(env["gpus"]))
    for g in results.get("groups", []):
        out += ["", f"## Engines for {', '.join(g['modes'])} ({g['transfer_mode']} via {g['backend']}, revision {g['revision']})", ""]
        if g.get("engine_version"):
            out.append(f"vLLM (GET /version): {g['engine_version']}; healthy after " + ", ".join(
                f"{k} {v:.0f} s" for k, v in (g.get("startup_seconds") or {}).items()))
            out.append("")
        out += ["Local overrides:", ""] + [f"- {o}" for o in g["overrides"]] + ["", "```", g["plan"], "```"]
    out += ["", "## TTFT, TPOT, end to end (ms)", ""] + main_table(results)
    ratios = ratio_table(results, baseline)
    if ratios:
        out += ["", f"## Ratio to {baseline} (< 1: faster)", ""] + ratios
    routes = routing_table([results], baseline)
    if routes:
        out += ["", "## Routing: prefill prefix-cache hits (vLLM's `vllm:prefix_cache_{hits,queries}_total`, tokens) and each "
                "prefill engine's share of the requests, per cell", "", *routes, "",
                "Imbalance: the busiest prefill engine's share times the number of prefill engines (1 = even). Per-engine "
                "columns in engine order (prefill-0 / prefill-1 / ...)."]
    replicas = replicas_table(results)
    if replicas:
        out += ["", "## Router replicas: what each counted per cell (its own /metrics, after - before)", "", *replicas]
    split = split_table(results)
    if split:
        out += ["", "## Where TTFT goes (direct dispatch: the client sees both legs)", ""] + split
    kv = kv_transfer_table(results)
    if kv:
        out += ["", "## vLLM's own KV-transfer metrics per cell (/metrics `vllm:nixl_*`, after - before the cell, all engines)", ""] + kv
    gauges = gauges_table(results)
    if gauges:
        out += ["", "## The engines' scheduler gauges while each cell ran (/metrics, sampled every 0.5 s)", ""] + gauges
    peers = [(mode, counters) for g in results.get("groups", []) for mode, counters in (g.get("peer_router_counters") or {}).items()]
    for mode, counters in peers:
        out += ["", f"## {mode}: the peer router's own counters at the end of its group", ""]
        sequential, concurrent = peer_router_paths(counters)
        out += [f"Prefill legs on its sequential path: {sequential:g}; on its concurrent push path: {concurrent:g} "
                "(vllm-router 0.1.17 labels a worker by its URL on the first, by host:port on the second).", ""]
        out += [f"- `{k}` {v:g}" for k, v in sorted(counters.items()) if k.endswith("_total") or "_total{" in k]
    errors = [(c["mode"], c["prompt_tokens"], c["rate"], c["errors"]) for c in _cells(results) if c["errors"]]
    if errors:
        out += ["", "## Failed or unfinished requests", ""] + [f"- {m} {p} x {r:g}/s: {e}" for m, p, r, e in errors]
    for g in results.get("groups", []):
        for name, lines in (g.get("key_log_lines") or {}).items():
            out += ["", f"## Key lines of {name}'s log", "", "```"] + lines + ["```"]
    return "\n".join(out) + "\n"


def render(runs: list[dict[str, Any]], baseline: str | None = None, repeats: bool = False) -> str:
    """What `disagg-localrun report` prints of several runs' results: one markdown report of them merged, or with
    `repeats` (repetitions of one sweep) the tables of per-cell medians over them."""
    merged = merge(runs)
    if not repeats:
        return markdown(merged, baseline)
    baseline = baseline or merged["sweep"]["modes"][0]
    out = "\n".join(repeats_table(runs, baseline)) + "\n"
    routes = routing_table(runs, baseline)
    if routes:
        out += "\nRouting (prefill prefix hit ratio and shares, medians of runs):\n\n" + "\n".join(routes) + "\n"
    kv = repeats_kv_table(runs)
    if kv:
        out += "\nvLLM's own KV-transfer metrics (/metrics vllm:nixl_*, per cell):\n\n" + "\n".join(kv) + "\n"
    return out
