"""Stream migration on real engines: ``disagg-localrun migrate`` (hack/gpu/run.sh issue30-migration).

The model's engines with two decode engines (one prefill), the router with its defaults (migration on), and two
passes of the same greedy requests (temperature 0, ``ignore_eos``, every stream asking for its token ids, half of
them chat with ``--chat``, when the model's tokenizer has a chat template):

- the reference: every stream uninterrupted;
- the crash: once every stream has ``kill_after`` tokens, the decode engine running the most of them is killed
  (SIGKILL to its process group, as a node's loss ends it), and the router continues its streams on the other.

Per stream of the crash pass: whole (its last event ``[DONE]``, every token there) or cut (an error event); exact (its
token ids and text equal the reference's) or not; migrated (the router's log names its id: "stream X continued as")
or not. For the migrated ones, the gap (the longest interval between two events) against the stream's inter-token
time before the kill. The streams that did not move say how exact greedy decoding is here at all (another batch
makes other kernels' rounding). The router's ``disagg_router_migrations_total`` by outcome. Written to
``migration.json`` and ``migration.md``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from disagg_bench.localrun import loadgen
from disagg_bench.localrun.bench import gauge_values
from disagg_connector import vllm_metrics
from disagg_bench.localrun.plan import LocalOptions, local_plan
from disagg_bench.localrun.procs import Running, started

_CONTINUED = re.compile(r"stream (\S+) continued as (\S+)")  # the router's log line of each migration


@dataclass
class Stream:
    index: int
    kind: str  # completions | chat
    xid: str = ""  # the router's X-Request-Id for it
    text: str = ""
    ids: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # when each event with tokens came
    done: bool = False
    error: str | None = None


def _body(kind: str, model: str, prompt: str, tokens: int) -> tuple[str, dict[str, Any]]:
    common = {"model": model, "max_tokens": tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
              "return_token_ids": True}  # fmt: skip
    if kind == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt}


async def _run_stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str, tokens: int, s: Stream) -> None:
    path, body = _body(s.kind, model, prompt, tokens)
    try:
        async with session.post(url + path, json=body) as resp:
            s.xid = resp.headers.get("X-Request-Id", "")
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for event in loadgen.sse_events(resp):
                if event == "[DONE]":
                    s.done = True
                elif isinstance(event, dict):
                    if "error" in event:
                        s.error = str(event["error"].get("message", event["error"]))[:500]
                        continue
                    for c in event.get("choices") or []:
                        new = c.get("token_ids") or []
                        s.ids += new
                        s.text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                        if new:
                            s.stamps.append(time.monotonic())
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        s.error = f"{type(e).__name__}: {e}"


async def _running(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as resp:
        return gauge_values(await resp.text()).get(vllm_metrics.RUNNING, 0.0)


async def _pass(running: Running, prompts: list[str], kinds: list[str], tokens: int, kill_after: int | None) -> tuple[list[Stream], dict[str, Any]]:
    plan = running.plan
    router = plan.routers[0].url
    streams = [Stream(i, kind) for i, kind in enumerate(kinds)]
    killed: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        tasks = [asyncio.create_task(_run_stream(session, router, plan.served_model_name, p, tokens, s)) for p, s in zip(prompts, streams)]
        if kill_after is not None:
            while not all(len(s.ids) >= kill_after or s.error or s.done for s in streams):
                await asyncio.sleep(0.02)
            decodes = [(e, p) for e, p in zip(plan.engines, running.engines) if e.role == "decode"]
            loads = [await _running(session, e.url) for e, _ in decodes]
            (victim, proc), load = max(zip(decodes, loads), key=lambda x: x[1])
            os.killpg(proc.popen.pid, signal.SIGKILL)
            killed = {"engine": victim.label, "running_then": load, "at": time.monotonic(), "loads": dict(zip([e.label for e, _ in decodes], loads))}
        await asyncio.gather(*tasks)
    return streams, killed


def _migrated_ids(router_log: Path) -> set[str]:
    try:
        return {m.group(1) for m in _CONTINUED.finditer(router_log.read_text(errors="replace"))}
    except OSError:
        return set()


def _migrations_total(metrics: str) -> dict[str, float]:
    """The router's disagg_router_migrations_total summed per outcome (series at 0 left out)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "disagg_router_migrations_total" and sample.value:
                outcome = sample.labels["outcome"]
                out[outcome] = out.get(outcome, 0.0) + sample.value
    return out


def _ms(values: list[float], p: float) -> float | None:
    return round(loadgen.percentile(values, p) * 1000, 1) if values else None


def summarize(reference: list[Stream], crash: list[Stream], migrated: set[str], killed_at: float, tokens: int) -> dict[str, Any]:
    """The crash pass judged against the reference, per group of streams (pure: the unit tests call it)."""
    rows: dict[str, Any] = {}
    moved = [s for s in crash if s.xid in migrated]
    stayed = [s for s in crash if s.xid not in migrated]
    for name, group in (("migrated", moved), ("not migrated", stayed)):
        whole = [s for s in group if s.done and s.error is None and len(s.ids) == tokens]
        exact = [s for s in whole if s.ids == reference[s.index].ids and s.text == reference[s.index].text]
        gaps, itls = [], []
        for s in group:
            before = [b - a for a, b in zip(s.stamps, s.stamps[1:]) if b <= killed_at]
            if before:
                itls.append(statistics.median(before))
            if name == "migrated" and len(s.stamps) > 1:
                gaps.append(max(b - a for a, b in zip(s.stamps, s.stamps[1:])))
        rows[name] = {
            "streams": len(group), "whole": len(whole), "exact": len(exact),
            "cut": [s.error for s in group if s.error is not None][:5],
            "gap_ms": {"p50": _ms(gaps, 50), "p99": _ms(gaps, 99), "max": _ms(gaps, 100)},
            "itl_ms_p50": _ms(itls, 50),
            "exact_by_kind": {k: f"{sum(s.kind == k for s in exact)}/{sum(s.kind == k for s in group)}" for k in sorted({s.kind for s in group})},
        }  # fmt: skip
    rows["reference_whole"] = sum(s.done and s.error is None and len(s.ids) == tokens for s in reference)
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Stream migration on {result['engines']}",
        "",
        f"{result['streams']} streams ({', '.join(result['kinds'])}) of {result['prompt_tokens']}-token prompts, "
        f"{result['output_tokens']} tokens each, greedy; {result['killed'].get('engine')} killed (SIGKILL) once every "
        f"stream had {result['kill_after']} tokens, with {result['killed'].get('running_then')} streams running on it.",
        f"Router's migrations by outcome: {json.dumps(result['router_migrations'])}; reference pass whole: "
        f"{result['summary']['reference_whole']} of {result['streams']}.",
        "",
        "| streams | count | whole | exact (ids and text = reference) | exact by kind | gap p50 / p99 / max (ms) | inter-token p50 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("migrated", "not migrated"):
        r = result["summary"][name]
        g = r["gap_ms"]
        by_kind = ", ".join(f"{k} {v}" for k, v in r["exact_by_kind"].items())
        lines.append(f"| {name} | {r['streams']} | {r['whole']} | {r['exact']} | {by_kind} | {g['p50']} / {g['p99']} / {g['max']} | {r['itl_ms_p50']} |")
    cut = [e for name in ("migrated", "not migrated") for e in result["summary"][name]["cut"]]
    if cut:
        lines += ["", "Cut streams (first errors):", *[f"- {e}" for e in cut]]
    return "\n".join(lines) + "\n"


def run_migration(doc: dict[str, Any], options: LocalOptions, out: Path, startup_timeout: float, *, streams: int, prompt_tokens: int,
                  output_tokens: int, kill_after: int, chat: bool, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Start the engines and the router, run both passes, write ``migration.json`` and ``migration.md``."""
    spec = doc.setdefault("spec", {})
    spec.setdefault("decode", {})["replicas"] = 2
    spec.setdefault("prefill", {})["replicas"] = 1
    spec.setdefault("router", {})["disaggregationThresholdTokens"] = 0  # every request takes both legs
    plan = local_plan(doc, options)
    rng = random.Random(seed)
    prompts = [loadgen.random_prompt(prompt_tokens, rng) for _ in range(streams)]
    # pairs of each kind (c c h h ...): a router that spreads streams in turn over two decodes gives each both kinds
    kinds = ["chat" if chat and (i // 2) % 2 else "completions" for i in range(streams)]
    out.mkdir(parents=True, exist_ok=True)
    with started(plan, out / "logs", startup_timeout) as running:
        reference, _ = asyncio.run(_pass(running, prompts, kinds, output_tokens, None))
        crash, killed = asyncio.run(_pass(running, prompts, kinds, output_tokens, kill_after))
        router_log = next(p.log_path for p in running.routers)
        metrics = asyncio.run(_get(plan.routers[0].url + "/metrics"))
    result = {
        "engines": f"{plan.transfer_mode.lower()} 1P2D, {' '.join(options.launcher)}",
        "streams": streams, "kinds": sorted(set(kinds)), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "kill_after": kill_after, "killed": {k: v for k, v in killed.items() if k != "at"},
        "router_migrations": _migrations_total(metrics),
        "summary": summarize(reference, crash, _migrated_ids(router_log), killed.get("at", float("inf")), output_tokens),
        "crash": [asdict(s) | {"stamps": len(s.stamps)} for s in crash],
    }  # fmt: skip
    (out / "migration.json").write_text(json.dumps(result, indent=1))
    (out / "migration.md").write_text(markdown(result))
    return result


async def _get(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(url) as resp:
            return await resp.text()
