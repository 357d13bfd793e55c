"""disagg-localrun end to end on CPU: the simulator stands in for vLLM and is started from the very
`vllm serve` command lines and env the operator renders (bench/disagg_bench/vllm_sim/as_vllm.py reads them as vLLM does),
the real router runs in static mode from the same identities, and the load generator measures."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg_bench.localrun.migrate import run_migration
from disagg_bench.localrun.plan import LocalOptions, local_plan
from disagg_bench.localrun.procs import started
from disagg_bench.vllm_sim import harness as h

from tests.fixtures.models import REPO, dm

SIM = h.AS_VLLM
FAST = (("DISAGG_SIM_PROFILE", "fast"),)


def test_engines_serve_under_the_rendered_identities_and_push_through_the_router(tmp_path: Path) -> None:
    # 64-word prompts are below the router's default disaggregation threshold: disaggregate every request
    doc = dm({"engine": {"enablePrefixCaching": False}, "decode": {"replicas": 2}, "router": {"disaggregationThresholdTokens": 0}}, name="local")
    options = LocalOptions(gpus=("0", "1", "2"), port_base=h.free_port_block(64), workdir=str(tmp_path), launcher=SIM, env=FAST)
    plan = local_plan(doc, options)
    with started(plan, tmp_path / "logs", startup_timeout=60) as running:
        for e in plan.engines:
            stats = h.get_json(e.url + "/sim/stats")
            assert stats["engine_ids"] == [e.engine_id] and stats["role"] == e.role and stats["mode"] == "push"
        router = plan.routers[0]
        body = h.completion(model=plan.served_model_name, prompt_words=64, max_tokens=4, stream=True)
        replies = [asyncio.run(h.post(router.url + "/v1/completions", body)) for _ in range(4)]
        assert [r.status for r in replies] == [200] * 4
        assert all(r.body.rstrip().endswith(b"data: [DONE]") for r in replies)
        (prefill,) = plan.role("prefill")
        p_counters = h.get_json(prefill.url + "/sim/stats")["counters"]
        assert p_counters["pushes"] == 4 and p_counters.get("handshake_failures", 0) == 0
        served = [h.get_json(d.url + "/sim/stats")["counters"].get("kv_received", 0) for d in plan.role("decode")]
        assert sum(served) == 4 and all(served), served  # both decode engines took requests
        assert running.startup_seconds.keys() == {p.name for p in running.engines + running.routers}
    for proc in running.engines + running.routers:
        assert not proc.alive()


def test_bench_sweeps_modes_and_writes_results(tmp_path: Path) -> None:
    model = tmp_path / "dm.yaml"
    model.write_text(json.dumps(dm({"engine": {"enablePrefixCaching": False}}, name="bench")))
    out = tmp_path / "out"
    proc = h.localrun_bench(
        model, out, 2, "--modes", "router-push,direct-push,router-pull,direct-pull", "--prompts", "64,512", "--rates", "8",
        "--cell-seconds", "0.5", "--min-requests", "4", "--max-tokens", "6", timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    cells = {(c["prompt_tokens"], c["mode"]): c for c in results["cells"]}
    assert set(cells) == {(p, m) for p in (64, 512) for m in ("router-push", "direct-push", "router-pull", "direct-pull")}
    for c in cells.values():
        assert (c["ok"], c["sent"]) == (4, 4), c["errors"]
        assert c["output_tokens"] == 6 and c["ttft"]["p50"] > 0 and c["tpot"]["p50"] > 0
        assert c["measured_prompt_tokens"] in (64, 512)
    for m in ("direct-push", "direct-pull"):
        assert cells[512, m]["prefill_leg"]["n"] == 4 and cells[512, m]["after_prefill"]["n"] == 4
    # the two transfer modes ran on their own engines, and the overrides were recorded
    groups = {g["transfer_mode"]: g for g in results["groups"]}
    assert set(groups) == {"Push", "Pull"} and groups["Push"]["revision"] != groups["Pull"]["revision"]
    assert any("--load-format dummy" in o for o in groups["Push"]["overrides"])
    assert "NixlConnector" in groups["Pull"]["plan"] and "NixlPushConnector" in groups["Push"]["plan"]
    md = (out / "results.md").read_text()
    assert "## Ratio to router-push" in md and "## Where TTFT goes" in md
    assert len(results["warmup"]) == 4 * 2  # one per mode and prompt length
    # on shared engines each mode runs first in turn: the second to run was slower, whichever it was
    ran = [(c["prompt_tokens"], c["mode"]) for c in results["cells"]]
    assert ran[:4] == [(64, "router-push"), (64, "direct-push"), (512, "direct-push"), (512, "router-push")], ran
    # the engines' scheduler gauges were sampled while each cell ran (the simulator exports vLLM's names)
    for c in results["cells"]:
        assert set(c["engine_gauges"]) == {"prefill-0", "decode-0"}, c["engine_gauges"]
        assert all(g["vllm:kv_cache_usage_perc"]["samples"] >= 1 for g in c["engine_gauges"].values())
    assert "## The engines' scheduler gauges while each cell ran" in md


@pytest.mark.parametrize("bad", ["--gpus 0 --backend UCX", "--modes router-teleport"])
def test_bad_input_says_what_to_change(tmp_path: Path, bad: str) -> None:
    model = tmp_path / "dm.yaml"
    model.write_text(json.dumps(dm()))
    proc = subprocess.run([sys.executable, "-m", "disagg_bench.localrun", "bench", "-f", str(model), *bad.split()],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert ("--colocate" in proc.stderr) if "gpus" in bad else ("choose from" in proc.stderr)


def _peer_router_command() -> str:
    """vllm-router's command: $DISAGG_PEER_ROUTER (e.g. `env PYTHONPATH=SITE python3 -m vllm_router.launch_router`),
    or this interpreter's (the test extra pins vllm-router: hack/setup.sh installs it)."""
    return os.environ.get("DISAGG_PEER_ROUTER") or f"{sys.executable} -m vllm_router.launch_router"


def test_bench_runs_vllm_router_as_a_peer_on_the_same_engines(tmp_path: Path) -> None:
    model = tmp_path / "dm.yaml"
    model.write_text(json.dumps(dm({"engine": {"enablePrefixCaching": False}}, name="peer")))
    out = tmp_path / "out"
    proc = h.localrun_bench(
        model, out, 2, "--peer-router-command", str(_peer_router_command()),
        "--modes", "router-push,vllmrouter-push,vllmrouter-pull", "--prompts", "512", "--rates", "8",
        "--cell-seconds", "0.5", "--min-requests", "4", "--max-tokens", "6", timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    for c in results["cells"]:
        assert (c["ok"], c["sent"]) == (4, 4), c["errors"]
        assert set(c["kv_transfer"]) == {"prefill-0", "decode-0"}  # scraped from every engine around the cell
    groups = {g["transfer_mode"]: g for g in results["groups"]}
    assert groups["Push"]["modes"] == ["router-push", "vllmrouter-push"]  # one set of push engines for both routers
    from disagg_bench.localrun.report import peer_router_paths

    # the simulated engines answer as vLLM 0.33.0 (transfer_mode "push"): vllm-router learns push from its warm-up
    sequential, concurrent = peer_router_paths(groups["Push"]["peer_router_counters"]["vllmrouter-push"])
    assert sequential == 1 and concurrent == 4, (sequential, concurrent)
    assert peer_router_paths(groups["Pull"]["peer_router_counters"]["vllmrouter-pull"]) == (5, 0)


def test_multi_turn_sessions_compare_prefill_policies_by_the_engines_own_prefix_hits(tmp_path: Path) -> None:
    """Issue 19: conversations on two prefill engines with prefix caching, through two routers that differ only in
    the prefill policy, on the same engines; each cell has every engine's prefix-cache counters, and the KV-aware
    policy finds more of each conversation's history cached than least-outstanding's blind pick."""
    model = tmp_path / "dm.yaml"
    spec = {"engine": {"enablePrefixCaching": True, "blockSize": 16}, "prefill": {"replicas": 2}, "router": {"prefillPolicy": "PrefixAndLoad"}}
    model.write_text(json.dumps(dm(spec, name="turns")))
    out = tmp_path / "out"
    modes = ("router-push:least-outstanding", "router-push:prefix-and-load")
    proc = h.localrun_bench(
        model, out, 3, "--workload", "multi-turn", "--modes", ",".join(modes), "--system-tokens", "512", "--turns", "4",
        "--user-tokens", "128", "--think-time", "0.2", "--rates", "4", "--cell-seconds", "2", "--min-requests", "8",
        "--max-tokens", "8", timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["sweep"]["workload"] == "multi-turn" and [g["modes"] for g in results["groups"]] == [list(modes)]
    cells = {c["mode"]: c for c in results["cells"]}
    assert set(cells) == set(modes)
    for c in cells.values():
        assert (c["ok"], c["sent"], c["sessions"]) == (32, 32, 8), c["errors"]  # 8 sessions x 4 turns
    turns = [r for r in results["records"] if r["mode"] == modes[0]]
    assert sorted({r["turn"] for r in turns}) == [0, 1, 2, 3]
    assert all(r["usage_prompt_tokens"] == r["sent_prompt_tokens"] == 512 + r["turn"] * 136 + 128 for r in turns)
    assert all(r["request_id"] for r in turns)  # the router's X-Request-Id, per request
    from disagg_bench.localrun.report import routing

    figures = {m: routing(c) for m, c in cells.items()}
    for m, f in figures.items():
        assert f is not None and 0 < f.hit_ratio <= 1, (m, f)  # the engines' own vllm:prefix_cache_* counters
        assert set(f.shares) == {"prefill-0", "prefill-1"} and sum(f.shares.values()) == pytest.approx(1.0)
    md = (out / "results.md").read_text()
    assert "## Routing" in md and "*one engine holding everything*" in md
    # the KV-aware policy finds more of each conversation cached than the blind pick
    lo, pal = figures[modes[0]], figures[modes[1]]
    assert lo is not None and pal is not None and pal.hit_ratio > lo.hit_ratio, (pal, lo)


@pytest.mark.parametrize("mode", ["Push", "Pull"])
def test_migrate_kills_the_busiest_decode_and_every_stream_ends_whole_and_exact(tmp_path: Path, mode: str) -> None:
    # the H200 profile's 26.5 ms per token: the streams are still running when the decode is killed
    doc = dm({"engine": {"enablePrefixCaching": False}}, name="mig")
    options = LocalOptions(gpus=("0", "1", "2"), port_base=h.free_port_block(64), workdir=str(tmp_path), launcher=SIM,
                           env=(("DISAGG_SIM_PROFILE", "h200-1gpu-push"),), transfer_mode=mode)  # fmt: skip
    result = run_migration(doc, options, tmp_path, 60, streams=8, prompt_tokens=256, output_tokens=80, kill_after=20, chat=True)
    moved, stayed = result["summary"]["migrated"], result["summary"]["not migrated"]
    assert moved["streams"] == result["router_migrations"]["migrated"] == result["killed"]["running_then"] > 0, result["summary"]
    assert moved["streams"] + stayed["streams"] == 8 and set(moved["exact_by_kind"]) == {"chat", "completions"}
    for group in (moved, stayed):
        assert group["whole"] == group["exact"] == group["streams"], group
    assert moved["gap_ms"]["p50"] > moved["itl_ms_p50"]  # the continuation prefilled prompt and tokens again
    assert (tmp_path / "migration.md").read_text().startswith(f"# Stream migration on {mode.lower()} 1P2D")
