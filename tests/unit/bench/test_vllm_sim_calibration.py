"""The simulator as a stand-in for `vllm serve` (bench/disagg_bench/vllm_sim/as_vllm.py) and its calibration from real runs
(bench/disagg_bench/vllm_sim/calibrate.py, calibration.json)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg_bench.localrun.plan import LocalOptions, local_plan
from disagg_bench.results import load_results, raw_files
from disagg_bench.vllm_sim import calibrate, sim
from disagg_bench.vllm_sim.as_vllm import CALIBRATION, profile, sim_argv

from tests.fixtures.models import dm


def _flags(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--") and not argv[i + 1].startswith("--")}


@pytest.mark.parametrize("mode", ["Push", "Pull"])
@pytest.mark.parametrize("tier", [{}, {"prefill": {"kvCache": {"cpu": "8Gi"}}, "decode": {"kvCache": {"cpu": "8Gi"}}}],
                         ids=["nixl", "nixl-in-a-multi-connector"])
def test_the_simulator_reads_a_rendered_command_line_like_vllm(mode: str, tier: dict[str, Any]) -> None:
    plan = local_plan(dm({"kvTransfer": {"leaseSeconds": 90}, "engine": {"blockSize": 64}, **tier}),
                      LocalOptions(gpus=("0", "1"), transfer_mode=mode))  # type: ignore[arg-type]
    for e in plan.engines:
        args = sim.build_parser().parse_args(sim_argv(e.argv[1:], e.env, {"tpot_ms": 3.0}))
        assert (args.role, args.mode) == (e.role, mode.lower())
        assert args.engine_id == e.engine_id and args.port == e.http_port
        assert (args.host, args.side_channel_port) == ("127.0.0.1", e.side_channel_port)
        assert args.http_host == "127.0.0.1"  # localrun's --host
        assert (args.lease_seconds, args.kv_load_failure_policy, args.block_size, args.tpot_ms) == (90.0, "fail", 64, 3.0)
        assert args.served_model_name == plan.served_model_name
        assert args.cpu_offload_bytes == (8 << 30 if tier else 0)  # the OffloadingConnector's cpu_bytes_to_use


def test_without_host_the_api_listens_on_every_interface_as_vllm_does_and_the_side_channel_on_the_pod_ip() -> None:
    """An engine pod's command line names no --host: vLLM's API server then listens on every interface, so the
    pod's own preStop (disagg-drain, on 127.0.0.1) and the kubelet's probes (on the pod IP) both reach it. The
    simulator bound only the side channel's host, the pod IP: under a real kubelet the drain found nothing
    listening on 127.0.0.1, returned at once, and SIGTERM cut every stream (tests/integration/containers)."""
    kv = '{"kv_connector":"NixlPushConnector","kv_role":"kv_consumer"}'
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.244.1.7"}
    args = sim.build_parser().parse_args(sim_argv(["serve", "m", "--kv-transfer-config", kv], env, {}))
    assert (args.http_host, args.host) == ("", "10.244.1.7")


def test_peers_of_different_configs_fail_the_handshake() -> None:
    def compat(*extra: str) -> str:
        kv = '{"kv_connector":"NixlPushConnector","kv_role":"kv_producer"}'
        return _flags(sim_argv(["serve", "m", "--kv-transfer-config", kv, *extra], {}, {}))["--compat-hash"]

    assert compat() == compat("--enforce-eager")  # flags vLLM's hash ignores
    assert compat() != compat("--block-size", "64") and compat() != compat("--dtype", "float16")


def test_what_the_simulator_cannot_be_is_refused() -> None:
    with pytest.raises(SystemExit, match="kv_connector"):
        sim_argv(["serve", "m", "--kv-transfer-config", '{"kv_connector":"LMCacheConnector","kv_role":"kv_producer"}'], {}, {})


def test_every_profile_is_a_set_of_simulator_flags() -> None:
    profiles = json.loads(CALIBRATION.read_text())["profiles"]
    assert {"fast", "h200-1gpu-push", "h200-1gpu-pull-tcp", "h200-1gpu-fair"} <= set(profiles)
    for name in profiles:
        flags = [x for k, v in profile(name).items() for x in (f"--{k.replace('_', '-')}", str(v))]
        sim.build_parser().parse_args(["--role", "prefill", "--engine-id", "e", *flags])
    with pytest.raises(SystemExit, match="no calibration profile"):
        profile("no-such-profile")


# --- fitting -------------------------------------------------------------------------------------------------
def test_least_squares_recovers_a_line() -> None:
    assert calibrate.least_squares([1.0, 2.0, 4.0], [5.0, 7.0, 11.0]) == pytest.approx((3.0, 2.0))


def test_transfer_rate_is_weighted_by_bytes() -> None:
    lines = [
        "INFO [metrics.py:103] KV Transfer metrics: Num successful transfers=2, Avg xfer time (ms)=10.0, P90 xfer time (ms)=12, "
        "Avg post time (ms)=1, P90 post time (ms)=1, Avg MB per transfer=100.0, Throughput (MB/s)=1, Avg number of descriptors=3",
        "INFO Engine 000: Avg prompt throughput: 1.0 tokens/s",
        "INFO KV Transfer metrics: Num successful transfers=1, Avg xfer time (ms)=30.0, Avg MB per transfer=400.0",
    ]
    assert calibrate.transfer_gbps(lines) == pytest.approx((200 + 400) / (20 + 30) * 8)
    with pytest.raises(ValueError):
        calibrate.transfer_gbps(["nothing here"])


def _cell(mode: str, prompt: int, rate: float, **p50: float) -> dict[str, Any]:
    stats = lambda v: {"mean": v, "p50": v, "p90": v, "p99": v, "n": 1}  # noqa: E731
    return {"mode": mode, "prompt_tokens": prompt, "rate": rate, "ok": 1,
            **{k: stats(p50.get(k)) for k in ("ttft", "tpot", "e2e", "prefill_leg", "after_prefill")}}


def test_fit_from_runs_whose_figures_follow_the_model() -> None:
    # A world that follows the simulator's own model with known parameters, 1 GB/s link, 1 KB of KV per token.
    base, per_token, tpot, rtt, pickup, kv, intake = 0.02, 10e-6, 0.025, 0.05, 0.03, 1000, 5e-6
    lengths = [1000, 4000, 16000]
    xfer = lambda n: n * kv * 8 / 8e9  # noqa: E731
    prefill = lambda n: base + per_token * n  # noqa: E731
    push_cells = []
    for n in lengths:
        after = xfer(n) + rtt / 2 + tpot + pickup
        push_cells += [_cell("direct-push", n, 1.0, prefill_leg=prefill(n), after_prefill=after, tpot=tpot, ttft=prefill(n) + after),
                       _cell("router-push", n, 1.0, tpot=tpot, ttft=prefill(n) + after),
                       _cell("direct-push", n, 8.0, prefill_leg=9.0, after_prefill=9.0, tpot=1.0, ttft=9.0)]  # loaded: ignored
    metrics = f"KV Transfer metrics: Num successful transfers=10, Avg xfer time (ms)={xfer(4000) * 1e3}, Avg MB per transfer=4.0"
    push = {"sweep": {"rates": [1.0, 8.0]}, "cells": push_cells,
            "groups": [{"key_log_lines": {"prefill-0-push": [metrics], "decode-0-push": []}}]}
    seq_extra = lambda n: rtt / 2 + calibrate.STEP_MS / 2000 + intake * n  # noqa: E731 - D's intake on the path
    sequential = {"sweep": {"rates": [1.0]}, "cells": [
        c for n in lengths for c in (_cell("router-push", n, 1.0, ttft=0.2), _cell("router-push-sequential", n, 1.0, ttft=0.2 + seq_extra(n)))]}
    fitted = calibrate.fit_push(push, sequential, kv)
    assert fitted["prefill_base_ms"] == pytest.approx(20.0, abs=0.01)
    assert fitted["prefill_us_per_token"] == pytest.approx(10.0, abs=0.001)
    assert fitted["tpot_ms"] == pytest.approx(25.0) and fitted["link_gbps"] == pytest.approx(8.0)
    assert fitted["registration_rtt_ms"] == pytest.approx(50.0, abs=0.1)
    assert fitted["intake_us_per_token"] == pytest.approx(5.0, abs=0.001)
    assert fitted["kv_pickup_ms"] == pytest.approx(30.0, abs=0.1)
    flat = {"sweep": {"rates": [1.0]}, "cells": [  # no growth with the prompt: no intake, all of it the message
        c for n in lengths for c in (_cell("router-push", n, 1.0, ttft=0.2), _cell("router-push-sequential", n, 1.0, ttft=0.2 + seq_extra(0)))]}
    assert (calibrate.fit_push(push, flat, kv)["intake_us_per_token"], calibrate.fit_push(push, flat, kv)["registration_rtt_ms"]) == (0.0, pytest.approx(50.0, abs=0.1))


def test_the_committed_profiles_are_what_calibrate_fits_from_the_committed_results() -> None:
    committed = json.loads(CALIBRATION.read_text())["profiles"]
    fitted = calibrate.fitted_profiles(lambda name: load_results(calibrate.RESULTS / name))
    assert {name: committed[name] for name in fitted} == fitted


def test_pull_has_its_own_read_rate_and_pick_up_and_falls_back_to_push_figures() -> None:
    t = sim.Timing(kv_bytes_per_token=1000, link_gbps=8.0, kv_pickup_ms=10.0)
    assert t.xfer(1000) == t.xfer(1000, read=True) == pytest.approx(1e-3)
    assert t.kv_pickup(pull=True) == t.kv_pickup() == pytest.approx(0.01)
    t = sim.Timing(kv_bytes_per_token=1000, link_gbps=8.0, kv_pickup_ms=10.0, read_gbps=16.0, pull_pickup_ms=30.0)
    assert (t.xfer(1000), t.xfer(1000, read=True)) == pytest.approx((1e-3, 0.5e-3))
    assert (t.kv_pickup(), t.kv_pickup(pull=True)) == pytest.approx((0.01, 0.03))


def test_repetitions_become_one_run_of_per_cell_medians() -> None:
    def run(ttft: float, ok: int) -> dict[str, Any]:
        c = _cell("router-pull", 1024, 2.0, ttft=ttft, tpot=0.02)
        return {"sweep": {"rates": [2.0], "seed": 0}, "groups": [{"plan": "x"}], "cells": [{**c, "ok": ok, "sent": 10}]}

    merged = calibrate.median_of_runs([run(0.1, 10), run(0.3, 9), run(0.2, 10)])
    (cell,) = merged["cells"]
    assert cell["ttft"]["p50"] == pytest.approx(0.2) and cell["tpot"]["mean"] == pytest.approx(0.02)
    assert (cell["ok"], cell["sent"], cell["runs"]) == (29, 30, 3) and len(merged["groups"]) == 3
    other = {**run(0.1, 10), "sweep": {"rates": [8.0], "seed": 0}}
    with pytest.raises(ValueError, match="different sweeps"):
        calibrate.median_of_runs([run(0.1, 10), other])


def test_fair_pull_fit_recovers_a_world_that_follows_the_model() -> None:
    # READs at 16 GB/s, 50 us of inline prep per block of 128 tokens, 40 ms pick-up, 1 KB of KV per token.
    kv, read_bps, prep, pickup, tpot, block = 1000, 16e9, 50e-6, 0.04, 0.02, 128
    lengths = [1024, 4096, 16384]
    blocks = {n: -(-n // block) for n in lengths}
    read = lambda n: n * kv / read_bps  # noqa: E731
    counters = {"vllm:nixl_xfer_time_seconds_count": 0.0}
    peer_cells = []
    for n in lengths:
        m = {"vllm:nixl_xfer_time_seconds_count": 10.0, "vllm:nixl_xfer_time_seconds_sum": 10 * read(n),
             "vllm:nixl_post_time_seconds_sum": 10 * blocks[n] * prep, "vllm:nixl_bytes_transferred_sum": 10.0 * n * kv}
        peer_cells += [{**_cell("router-pull", n, 2.0), "kv_transfer": {"decode-0": m, "prefill-0": counters}},
                       {**_cell("router-pull", n, 8.0), "kv_transfer": {"decode-0": {**m, "vllm:nixl_xfer_time_seconds_sum": 99.0},
                                                                       "prefill-0": counters}}]  # loaded: ignored
    reads = calibrate.nixl_counters([{"sweep": {"rates": [2.0, 8.0]}, "cells": peer_cells}], "router-pull", "decode-0")
    assert calibrate.counters_gbps(reads) == pytest.approx(128.0)
    intake = 7e-6  # D's intake of the prompt: on pull's path (its leg follows the prefill)
    pull = {"sweep": {"rates": [2.0]}, "cells": [
        _cell("direct-pull", n, 2.0, after_prefill=intake * n + blocks[n] * prep + read(n) + pickup + tpot) for n in lengths]}
    push_timing = {"tpot_ms": tpot * 1e3, "kv_bytes_per_token": kv, "link_gbps": 100.0, "intake_us_per_token": intake * 1e6}
    fitted = calibrate.fit_pull_fair(pull, reads, push_timing, block)
    assert fitted["read_gbps"] == pytest.approx(128.0) and fitted["link_gbps"] == 100.0
    assert fitted["descriptor_prep_us_per_block"] == pytest.approx(50.0)
    assert fitted["pull_pickup_ms"] == pytest.approx(40.0, abs=0.1)
    with pytest.raises(ValueError, match="no vllm:nixl"):
        calibrate.nixl_counters([{"sweep": {"rates": [2.0]}, "cells": peer_cells}], "router-push", "decode-0")


def test_the_block_size_is_the_engines_own() -> None:
    assert calibrate.block_size({"groups": [{"plan": "vllm serve m --block-size 64 --port 1"}] * 2}) == 64
    with pytest.raises(ValueError):
        calibrate.block_size({"groups": [{"plan": "--block-size 64"}, {"plan": "--block-size 16"}]})


def test_sim_vs_real_replays_each_profile_once_and_names_what_it_does_not_replay() -> None:
    from disagg_bench import sim_vs_real

    paths = raw_files(calibrate.RESULTS, "h200-*")
    sets, orphans = sim_vs_real.replay_sets(paths)
    profiles = json.loads(CALIBRATION.read_text())["profiles"]
    replays = {tuple(p.name for p in ps): name for name, ps in sets}
    assert replays[tuple(calibrate.FAIR_RUNS)] == "h200-1gpu-fair"  # three repetitions of one sweep: one replay
    assert replays[("h200-1gpu-push.json",)] == replays[("h200-1gpu-push-sequential.json",)] == "h200-1gpu-push"  # two sweeps
    for name, ps in sets:
        assert all(p.name in profiles[name]["runs"] for p in ps)
        assert len({json.dumps(load_results(p)["sweep"]) for p in ps}) == 1
    assert orphans and all(sim_vs_real.profile_for(p) is None for p in orphans)
    assert sorted([*orphans, *(p for _, ps in sets for p in ps)]) == paths
