"""A sweep over (prompt length, request rate, mode) against locally started engines.

A mode is a transfer mode of the engines plus a dispatcher: the router in one of its modes
(`router-push`, `router-push-sequential`, `router-pull`), the load generator sending both legs itself
(`direct-push`, `direct-push-sequential`, `direct-pull`: the router's protocol without the router, the
baseline for the router's own cost, and the split of TTFT into its legs), or a peer's router on the same
engines (`vllmrouter-push`, `vllmrouter-pull`: vllm-project/router, whose own dispatch decides sequential or
concurrent). A router mode may name a prefill policy after a colon: `router-push:prefix-and-load` (our
router's `--prefill-policy`), `vllmrouter-push:cache_aware` (vllm-router's `--prefill-policy`); modes that differ
only there compare routing on the same engines. Modes of one transfer mode share one set of engines; the
engines are restarted for the other.
Within a (prompt, rate) cell every mode gets the same arrival times; the results are written after every
cell, so a run cut short keeps what it measured.

Each cell also records what vLLM itself counted of the KV transfers during it: every engine's `vllm:nixl_*`
series (NIXL transfers, their time, post time, bytes, descriptors, failures, expired leases), scraped from
/metrics before and after the cell, as the difference; and, for routing, every engine's prefix-cache counters
(`vllm:prefix_cache_hits_total`, `vllm:prefix_cache_queries_total`) and requests served
(`vllm:request_success_total`; the simulator's prefill count where it has no such series), the same way.

`--workload multi-turn` replaces the independent prompts by conversations (loadgen.multi_turn_sessions): the
prompt axis is then the system prompt's tokens and the rate axis sessions per second.

`--router-replicas N` runs each router mode as N processes behind the one client (loadgen.Replicas: round robin
over sessions or over requests, `--replica-spread`); each cell then also records, per replica, what our router
counted during it (`disagg_router_requests_total` by status, `disagg_router_picks_total` by role, policy and
reason), and each request which replica it went to. `--prompt-format token-ids` sends the prompts as token ids
(what the router matches exactly against the engines' KV events).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import aiohttp

from disagg_connector import vllm_metrics

from . import loadgen, report
from .plan import PEER_POLICIES, PEER_ROUTER_MODES, PREFILL_POLICIES, LocalOptions, LocalPlan, describe, local_plan, split_policy
from .procs import Running, started


@dataclass(frozen=True)
class Mode:
    name: str
    transfer_mode: str  # Push | Pull
    router_mode: str | None  # the plan's router mode: dispatch[:prefill policy], or a peer's mode[:policy]
    direct_dispatch: str | None


def mode(name: str) -> Mode:
    base, policy = split_policy(name)
    kind, _, dispatch = base.partition("-")
    transfer = "Pull" if dispatch == "pull" else "Push"
    if base in PEER_ROUTER_MODES:
        if policy is not None and policy not in PEER_POLICIES:
            raise ValueError(f"mode {name!r}: vllm-router's prefill policy is one of {', '.join(PEER_POLICIES)}")
        return Mode(name, transfer, name, None)
    if kind not in ("router", "direct") or dispatch not in loadgen.DISPATCHES:
        choices = ", ".join([*(f"{k}-{d}" for k in ("router", "direct") for d in loadgen.DISPATCHES), *PEER_ROUTER_MODES])
        raise ValueError(f"mode {name!r}: choose from {choices} (a router mode may add :POLICY)")
    if policy is not None and (kind != "router" or policy not in PREFILL_POLICIES):
        raise ValueError(f"mode {name!r}: only a router mode takes a prefill policy, one of {', '.join(PREFILL_POLICIES)}")
    router = dispatch + (f":{policy}" if policy else "")
    return Mode(name, transfer, router if kind == "router" else None, dispatch if kind == "direct" else None)


@dataclass(frozen=True)
class Sweep:
    prompts: tuple[int, ...]
    rates: tuple[float, ...]
    modes: tuple[Mode, ...]
    max_tokens: int = 128
    cell_seconds: float = 12.0
    min_requests: int = 16
    drain_timeout: float = 60.0
    seed: int = 0
    workload: str = "no-reuse"  # | multi-turn: prompts = system prompt tokens, rates = sessions per second
    turns: int = 4
    user_tokens: int = 256
    think_time: float = 1.0
    prompt_format: str = "text"  # | token-ids (loadgen.as_prompt)
    replica_spread: str = "session"  # | request: how requests spread over router replicas (loadgen.Replicas)

    def multi_turn(self, system_tokens: int, session_rate: float) -> loadgen.MultiTurnWorkload:
        """A multi-turn cell; sessions like requests in the no-reuse cells (`cell_seconds` of arrivals, at
        least `min_requests`)."""
        sessions = loadgen.requests_per_cell(session_rate, self.cell_seconds, self.min_requests)
        return loadgen.MultiTurnWorkload(session_rate, sessions, self.turns, system_tokens, self.user_tokens,
                                         self.max_tokens, self.think_time)

    def groups(self) -> list[tuple[str, list[Mode]]]:
        """Modes by engine transfer mode, in the order given."""
        out: dict[str, list[Mode]] = {}
        for m in self.modes:
            out.setdefault(m.transfer_mode, []).append(m)
        return list(out.items())


T = TypeVar("T")


def cell_order(modes: Sequence[T], k: int) -> list[T]:
    """The order the modes of cell k run in on the shared engines: rotated by one each cell, so that each mode
    runs first as often as the others. The mode that ran second on the same engines was slower whichever it was
    (vLLM's own NIXL transfer times 3-5x the first's, bench/results/h200-issue19-routing.md)."""
    shift = k % len(modes) if modes else 0
    return [*modes[shift:], *modes[:shift]]


ModeOrder = Callable[[Sequence[Mode], int], list[Mode]]


def seed_of(*parts: Any) -> int:
    """A generator seed for these parts, different for any difference in them. (Until issue 19 this was the JSON's
    bytes read little-endian modulo 2**63: only its first 8 bytes counted, so every mode of a cell drew the same
    prompts, which a prefix cache then served from the previous mode's run.)"""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little")


def target(plan: LocalPlan, m: Mode, spread: str = "session") -> loadgen.Target | loadgen.Replicas:
    """Where a mode's requests go: its router (every replica of it, spread over them), or the engines."""
    if m.router_mode:
        replicas = plan.router_replicas(m.router_mode)
        if len(replicas) == 1:
            return loadgen.RouterTarget(replicas[0].url)
        return loadgen.Replicas(tuple(loadgen.RouterTarget(r.url) for r in replicas), spread)
    prefill, decode = plan.role("prefill")[0], plan.role("decode")[0]
    return loadgen.DirectTarget(m.direct_dispatch or "push", prefill.url, decode.url, prefill.identities()[0])


def environment(plan: LocalPlan) -> dict[str, Any]:
    """Versions and machine, as far as this process can tell (vLLM's from its own /version)."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("vllm", "nixl", "nixl-cu13", "nixl-cu12", "torch", "vllm-router"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        env["gpus"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    return env


async def _engine_version(plan: LocalPlan) -> str | None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        try:
            async with s.get(plan.engines[0].url + "/version") as r:
                return (await r.json(content_type=None)).get("version") if r.status == 200 else None
        except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError):
            return None


# Per engine (per pod, so per data-parallel rank range): what each one served, by vLLM's own counters (label
# `engine`: the DP rank), and the simulator's counters where vLLM has none.
ENGINE_COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


async def _engine_counters(plan: LocalPlan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for e in plan.engines:
            entry: dict[str, Any] = {"role": e.role, "url": e.url,
                                     "dp_ranks": [i.dp_rank for i in e.identities()], "metrics": {}}
            try:
                async with s.get(e.url + "/metrics") as r:
                    text = await r.text() if r.status == 200 else ""
                for line in text.splitlines():
                    if line.startswith(ENGINE_COUNTERS):
                        key, _, value = line.rpartition(" ")
                        entry["metrics"][key] = float(value)
                async with s.get(e.url + "/sim/stats") as r:
                    if r.status == 200:
                        entry["sim_counters"] = (await r.json(content_type=None)).get("counters")
            except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError) as err:
                entry["error"] = f"{type(err).__name__}: {err}"
            out[e.label] = entry
    return out


# vLLM's own KV-transfer series (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py, 0.26.0): histograms
# vllm:nixl_{xfer_time_seconds,post_time_seconds,bytes_transferred,num_descriptors} (their _sum and _count are
# kept), counters vllm:nixl_num_{failed_transfers,failed_notifications,kv_expired_reqs}.
KV_TRANSFER_PREFIX = "vllm:nixl_"


# For routing: each engine's prefix-cache counters (tokens queried and found cached, vLLM's v1/metrics/loggers.py) and
# the requests it finished (a prefill engine: its prefill legs), and the simulator's own count of prefills.
ROUTING_SERIES = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total",
                  "vllm:external_prefix_cache_hits_total")  # a CPU tier's hits (and a decode's KV from prefill)
SIM_PREFILLS = "sim:prefills"


def parse_series(text: str, prefix: str | tuple[str, ...]) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}, for the series named `prefix`...;
    histogram buckets and `_created` stamps left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if name.endswith(("_bucket", "_created")):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def series_delta(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per engine, what each series grew by between two scrapes (a series new in `after` counts from 0)."""
    return {label: {name: value - before.get(label, {}).get(name, 0.0) for name, value in series.items()}
            for label, series in after.items()}  # fmt: skip


async def _engine_snapshot(session: aiohttp.ClientSession, plan: LocalPlan) -> dict[str, dict[str, float]]:
    """Per engine: its vllm:nixl_* series, the ROUTING_SERIES and (the simulator) its prefill count."""
    out: dict[str, dict[str, float]] = {}
    timeout = aiohttp.ClientTimeout(total=10)
    for e in plan.engines:
        out[e.label] = {}
        try:
            async with session.get(e.url + "/metrics", timeout=timeout) as r:
                if r.status == 200:
                    out[e.label] = parse_series(await r.text(), (KV_TRANSFER_PREFIX, *ROUTING_SERIES))
            async with session.get(e.url + "/sim/stats", timeout=timeout) as r:
                if r.status == 200:  # real vLLM: 404
                    out[e.label][SIM_PREFILLS] = float(((await r.json(content_type=None)).get("counters") or {}).get("prefills", 0))
        except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError):
            pass
    return out


def split_cell_series(delta: Mapping[str, Mapping[str, float]]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """A cell's per-engine deltas as (the vllm:nixl_* series: `kv_transfer`, the routing series: `engine_series`)."""
    kv = {label: {k: v for k, v in series.items() if k.startswith(KV_TRANSFER_PREFIX)} for label, series in delta.items()}
    routing = {label: {k: v for k, v in series.items() if not k.startswith(KV_TRANSFER_PREFIX)} for label, series in delta.items()}
    return kv, routing


# The scheduler's own gauges (vLLM's v1/metrics/loggers.py), sampled while a cell runs: what each engine ran and
# queued (WAITING holds requests waiting for a remote KV too) and how full its KV cache was. Issue 20's inversion
# question needs them (h200-issue20-inversion.md: "Not recorded"); counters before and after cannot show a queue.
SCHEDULER_GAUGES = (vllm_metrics.RUNNING, vllm_metrics.WAITING, vllm_metrics.KV_USAGE)
GAUGE_SAMPLE_SECONDS = 0.5


def gauge_values(text: str) -> dict[str, float]:
    """One /metrics page -> each SCHEDULER_GAUGES value of the engine: requests summed over its DP ranks, the KV
    cache usage of its fullest rank."""
    out: dict[str, float] = {}
    for s in vllm_metrics.read_samples(text, SCHEDULER_GAUGES, only_their_lines=True):
        combine = max if s.name == vllm_metrics.KV_USAGE else (lambda a, b: a + b)
        out[s.name] = combine(out[s.name], s.value) if s.name in out else s.value
    return out


async def _sample_gauges(session: aiohttp.ClientSession, plan: LocalPlan, stop: asyncio.Event) -> dict[str, dict[str, dict[str, float]]]:
    """Every GAUGE_SAMPLE_SECONDS until `stop`: each engine's gauges; then per engine and gauge its mean, max and
    number of samples. A failed scrape is a missing sample, not an error: the cell's own figures come first."""
    samples: dict[str, dict[str, list[float]]] = {}
    timeout = aiohttp.ClientTimeout(total=GAUGE_SAMPLE_SECONDS * 4)
    while True:
        for e in plan.engines:
            try:
                async with session.get(e.url + "/metrics", timeout=timeout) as r:
                    values = gauge_values(await r.text()) if r.status == 200 else {}
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):  # ValueError: not Prometheus text
                continue
            for name, value in values.items():
                samples.setdefault(e.label, {}).setdefault(name, []).append(value)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), GAUGE_SAMPLE_SECONDS)
        if stop.is_set():
            break
    return {label: {name: {"mean": statistics.fmean(v), "max": max(v), "samples": len(v)} for name, v in gauges.items()}
            for label, gauges in samples.items()}  # fmt: skip


# A peer router's own counters (vllm-router 0.1.17: vllm_router_pd_{prefill,decode}_requests_total{worker}, whose
# worker label is the URL on its sequential path and host:port without the scheme on its concurrent push path).
PEER_ROUTER_PREFIX = "vllm_router_pd_"


async def _peer_router_counters(plan: LocalPlan) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for r in plan.routers:
            if r.metrics_port is None:
                continue
            try:
                async with s.get(f"http://{r.host}:{r.metrics_port}/metrics") as resp:
                    text = await resp.text() if resp.status == 200 else ""
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                text = ""
            out[r.label] = {key: float(value) for key, _, value in (line.rpartition(" ") for line in text.splitlines())
                           if key.startswith(PEER_ROUTER_PREFIX) and "_bucket" not in key and _is_number(value)}
    return out


# Our router's own counters, per replica and cell (label sets kept): requests by status, picks by reason, failures by cause.
ROUTER_SERIES = ("disagg_router_requests_total", "disagg_router_picks_total", "disagg_router_failures_total")


def parse_labelled(text: str, prefix: str | tuple[str, ...]) -> dict[str, float]:
    """Prometheus text -> {series with its labels: value} for the series named `prefix`..."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            if _is_number(value):
                out[key] = float(value)
    return out


async def _router_snapshot(session: aiohttp.ClientSession, plan: LocalPlan, m: Mode) -> dict[str, dict[str, float]]:
    """Per replica of the mode's router (ours only: a peer's has its own counters), its ROUTER_SERIES."""
    out: dict[str, dict[str, float]] = {}
    if not m.router_mode:
        return out
    for r in plan.router_replicas(m.router_mode):
        if r.metrics_port is not None:
            continue
        try:
            async with session.get(r.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                out[r.label] = parse_labelled(await resp.text(), ROUTER_SERIES) if resp.status == 200 else {}
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            out[r.label] = {}
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


WARMUP_RETRY_SECONDS = 60.0


async def _warm_up(session: aiohttp.ClientSession, t: loadgen.Target, name: str, prompt: int, body: dict[str, Any]) -> loadgen.RequestRecord:
    """One request; a 503 is retried for a while: a router re-admits engines only at its next health
    probe, seconds after they first answer /health (seen with real engines)."""
    deadline = time.monotonic() + WARMUP_RETRY_SECONDS
    while True:
        rec = loadgen.RequestRecord(name, prompt, 0.0, 0, 0.0)
        await loadgen.send(session, t, body, rec)
        if rec.status != 503 or time.monotonic() > deadline:
            return rec
        await asyncio.sleep(1.0)


async def _measure_group(running: Running, modes: list[Mode], sweep: Sweep, results: dict[str, Any], save: Callable[[], None],
                         order: ModeOrder) -> None:
    plan = running.plan
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        for m in modes:  # warm-up: one request per prompt length (and router replica), one after the other (kept apart)
            t = target(plan, m, sweep.replica_spread)
            for prompt in sweep.prompts:
                for k, each in enumerate(t.targets if isinstance(t, loadgen.Replicas) else (t,)):
                    rng = random.Random(seed_of(sweep.seed, "warmup", m.name, prompt, *([k] if k else [])))
                    prompt_text = loadgen.as_prompt(loadgen.random_prompt(prompt, rng), sweep.prompt_format)
                    body = loadgen.completion_body(plan.served_model_name, prompt_text, sweep.max_tokens)
                    results["warmup"].append((await _warm_up(session, each, m.name, prompt, body)).as_dict())
        save()
        cells = [(prompt, rate) for prompt in sweep.prompts for rate in sweep.rates]
        for k, (prompt, rate) in enumerate(cells):
            n = loadgen.requests_per_cell(rate, sweep.cell_seconds, sweep.min_requests)
            for m in order(modes, k):
                before = await _engine_snapshot(session, plan)
                routers_before = await _router_snapshot(session, plan, m)
                stop_sampling = asyncio.Event()
                sampler = asyncio.create_task(_sample_gauges(session, plan, stop_sampling))
                try:
                    records = await _run_cell(session, plan, m, sweep, prompt, rate, n)
                finally:
                    stop_sampling.set()
                    gauges = await sampler
                summary = loadgen.summarize(records, sweep.workload)
                kv, routing = split_cell_series(series_delta(before, await _engine_snapshot(session, plan)))
                router_series = series_delta(routers_before, await _router_snapshot(session, plan, m))
                results["cells"].append({**report.summary_dict(summary), "kv_transfer": kv, "engine_series": routing,
                                         "engine_roles": {e.label: e.role for e in plan.engines}, "engine_gauges": gauges,
                                         "router_series": router_series})
                results["records"] += [r.as_dict() for r in records]
                print(report.cell_line(summary), flush=True)
                save()


async def _run_cell(session: aiohttp.ClientSession, plan: LocalPlan, m: Mode, sweep: Sweep, prompt: int, rate: float,
                    n: int) -> list[loadgen.RequestRecord]:
    """One mode's run of a cell: its sessions (multi-turn) or its requests (no-reuse)."""
    if sweep.workload == "multi-turn":  # same arrivals and think times for every mode, own words
        sessions = loadgen.multi_turn_sessions(sweep.multi_turn(prompt, rate), seed_of(sweep.seed, prompt, rate),
                                               seed_of(sweep.seed, prompt, rate, m.name))
        return await loadgen.run_sessions(
            session, target(plan, m, sweep.replica_spread), sessions, mode=m.name, model=plan.served_model_name,
            cell_tokens=prompt, rate=rate, max_tokens=sweep.max_tokens, drain_timeout=sweep.drain_timeout,
            prompt_format=sweep.prompt_format)  # fmt: skip
    return await loadgen.run_cell(
        session, target(plan, m, sweep.replica_spread), mode=m.name, model=plan.served_model_name, prompt_tokens=prompt,
        rate=rate, n=n, max_tokens=sweep.max_tokens,
        arrival_rng=random.Random(seed_of(sweep.seed, prompt, rate)),
        prompt_rng=random.Random(seed_of(sweep.seed, prompt, rate, m.name)),
        drain_timeout=sweep.drain_timeout, prompt_format=sweep.prompt_format,
    )  # fmt: skip


def run_bench(
    doc: dict[str, Any],
    options: LocalOptions,
    sweep: Sweep,
    out_dir: Path,
    startup_timeout: float,
    command: list[str],
    secrets: Mapping[str, str] | None = None,
    order: ModeOrder = cell_order,
) -> dict[str, Any]:
    """The sweep, group by group (the modes that share engines), cell by cell; `order` says in which order the modes
    of cell k run (a replay of a real run passes the order that run had)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": shlex.join(command),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sweep": {**dataclasses.asdict(sweep), "modes": [m.name for m in sweep.modes]},
        "environment": {},
        "groups": [],
        "cells": [],
        "warmup": [],
        "records": [],
    }

    def save() -> None:
        (out_dir / "results.json").write_text(json.dumps(_no_nan(results), indent=1))
        (out_dir / "results.md").write_text(report.markdown(results))

    for transfer_mode, modes in sweep.groups():
        routers = tuple(m.router_mode for m in modes if m.router_mode)
        plan_options = dataclasses.replace(options, transfer_mode=transfer_mode, router_modes=routers)  # type: ignore[arg-type]
        plan = local_plan(doc, plan_options, secrets=secrets)
        group: dict[str, Any] = {
            "transfer_mode": transfer_mode,
            "modes": [m.name for m in modes],
            "revision": plan.revision,
            "backend": plan.backend,
            "plan": describe(plan),
            "overrides": [str(o) for o in plan.overrides],
        }
        results["groups"].append(group)
        print(describe(plan), flush=True)
        with started(plan, out_dir / "logs", startup_timeout) as running:
            group["startup_seconds"] = running.startup_seconds
            if not results["environment"]:
                results["environment"] = environment(plan)
            group["engine_version"] = asyncio.run(_engine_version(plan))
            save()
            try:
                asyncio.run(_measure_group(running, modes, sweep, results, save, order))
            finally:
                group["engine_counters"] = asyncio.run(_engine_counters(plan))
                if any(r.metrics_port is not None for r in plan.routers):
                    group["peer_router_counters"] = asyncio.run(_peer_router_counters(plan))
                group["key_log_lines"] = running.key_log_lines()
                save()
    return results


def _no_nan(value: Any) -> Any:
    """JSON has no NaN: a figure that does not exist (no successful request) is null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value
