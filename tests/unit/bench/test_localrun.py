"""disagg-localrun's CPU-side parts: $(VAR) expansion, argument extraction from the rendered Deployments of
every example, port and GPU assignment, the router's static endpoints, and the load generator's arithmetic."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from disagg_connector import contract
from disagg_connector.router.config import parse_args as router_args
from disagg_operator.api.validation import parse
from disagg_connector.router.discovery import backends_from_pod, pods_from_static
from disagg_bench.localrun import loadgen, report
from disagg_bench.localrun.bench import Sweep, cell_order, gauge_values, mode, parse_series, series_delta
from disagg_bench.localrun.kube_env import DownwardValues, UnresolvableEnv, expand, resolve_env
from disagg_bench.localrun.plan import PEER_ROUTER_MODES, LocalOptions, LocalPlan, LocalRunError, describe, flag_value, local_plan

from tests.fixtures.models import EXAMPLES, dm, load_example

# --- $(VAR) expansion, as the kubelet does it ------------------------------------------------------------
ENV = {"A": "alpha", "B": "$(A)"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "alpha"),
        ("x-$(A)-y", "x-alpha-y"),
        ("$(A)$(A)", "alphaalpha"),
        ("$(MISSING)", "$(MISSING)"),  # undefined: kept as written
        ("$$(A)", "$(A)"),  # escaped
        ("$$", "$"),
        ("a$", "a$"),  # a trailing $ stays
        ("$x", "$x"),  # $ before anything else stays
        ("$(A", "$(A"),  # unterminated reference stays
        ("$(B)", "$(A)"),  # values are not expanded twice
        ("", ""),
    ],
)
def test_expand_follows_kubernetes(text: str, expected: str) -> None:
    assert expand(text, ENV) == expected


def test_env_entries_see_only_earlier_entries() -> None:
    entries = [
        {"name": "LATE_REF", "value": "$(POD_IP):1"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "EARLY_REF", "value": "$(POD_IP):2"},
    ]
    env = resolve_env(entries, DownwardValues("p", "u", "10.0.0.7"), {})
    assert env == {"LATE_REF": "$(POD_IP):1", "POD_IP": "10.0.0.7", "EARLY_REF": "10.0.0.7:2"}


def test_secret_refs_come_from_the_local_environment_or_fail_clearly() -> None:
    entries = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}}]
    assert resolve_env(entries, DownwardValues("p", "u", "h"), {"HF_TOKEN": "t0k"}) == {"HF_TOKEN": "t0k"}
    with pytest.raises(UnresolvableEnv, match="export HF_TOKEN"):
        resolve_env(entries, DownwardValues("p", "u", "h"), {})


# --- plans of every example ---------------------------------------------------------------------------------
def local_options(doc: dict[str, Any], **over: Any) -> LocalOptions:
    """Options that let an example run here: enough GPUs, UCX without EFA, a model folder for PVC models."""
    spec = doc["spec"]
    pvc = str((spec["model"].get("source") or {}).get("uri", "")).startswith("pvc://")
    base: dict[str, Any] = {"gpus": tuple(str(i) for i in range(64)), "backend": "UCX", "port_base": 30000,
                            "model_path": "/models/local" if pvc else None, "workdir": "/tmp/lr"}
    return LocalOptions(**{**base, **over})


def _uids() -> Any:
    counter = itertools.count()
    return lambda: f"00000000-0000-4000-8000-{next(counter):012d}"


def plan_of(path: Path, **over: Any) -> LocalPlan:
    doc = load_example(path)
    return local_plan(doc, local_options(doc, **over), new_uid=_uids(), secrets={"HF_TOKEN": "hf_secret"})


RUNNABLE = [p for p in EXAMPLES if not p.stem.startswith("trn2")]  # Trainium: no local NVIDIA run
MINIMAL = next(p for p in EXAMPLES if p.stem == "minimal")


@pytest.mark.parametrize("path", RUNNABLE, ids=[p.stem for p in RUNNABLE])
def test_engines_get_the_rendered_arguments_with_local_values(path: Path) -> None:
    plan = plan_of(path)
    spec = load_example(path)["spec"]
    model = parse(load_example(path))
    for role in ("prefill", "decode"):  # a process per pod: engines x pods per engine
        assert len(plan.role(role)) == spec.get(role, {}).get("replicas", 1) * getattr(model.spec, role).shape.pods
    for e in plan.engines:
        vllm_argv = e.argv[3:] if e.argv[:2] == ("/bin/sh", "-c") else e.argv  # a pod of an engine over pods
        assert vllm_argv[0] == "vllm" and vllm_argv[1] == "serve"
        assert not any("$(" in a for a in vllm_argv) and not any("$(" in v for v in e.env.values())
        kv = json.loads(flag_value(e.argv, "--kv-transfer-config") or "{}")
        assert kv["engine_id"] == e.engine_id == contract.engine_id(e.name, e.uid)
        assert kv["kv_role"] == ("kv_producer" if e.role == "prefill" else "kv_consumer")
        assert contract.transfer_connector_config(kv)["kv_connector_extra_config"]["backends"] == ["UCX"]  # a CPU tier's too
        assert flag_value(e.argv, "--port") == str(e.http_port) and e.argv.count("--port") == 1
        assert flag_value(e.argv, "--host") == "127.0.0.1"
        assert e.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(e.side_channel_port)
        assert e.env[contract.ENV_POD_NAME] == e.name and e.env[contract.ENV_POD_UID] == e.uid
        role = spec.get(e.role, {})
        assert len(e.gpus) == role.get("accelerator", {}).get("count", 1)
        assert e.env["CUDA_VISIBLE_DEVICES"] == ",".join(e.gpus)
        assert not any(k.startswith("FI_") for k in e.env), "EFA env without EFA"


@pytest.mark.parametrize("path", RUNNABLE, ids=[p.stem for p in RUNNABLE])
def test_ports_and_gpus_are_distinct(path: Path) -> None:
    plan = plan_of(path, router_modes=("push", "push-sequential", "pull"))
    ports = [r.port for r in plan.routers]
    for e in plan.engines:
        ports += [e.http_port, *(i.side_channel_port for i in e.identities())]
    assert len(ports) == len(set(ports))
    gpus = [g for e in plan.engines for g in e.gpus]
    assert len(gpus) == len(set(gpus))


@pytest.mark.parametrize("path", RUNNABLE, ids=[p.stem for p in RUNNABLE])
def test_router_finds_each_engine_under_the_identity_it_was_started_with(path: Path) -> None:
    plan = plan_of(path)
    backends = [b for pod in pods_from_static(plan.static_endpoints()) for b in backends_from_pod(pod)]
    by_pod = {}
    for b in backends:
        by_pod.setdefault(b.pod, []).append(b)
    for e in plan.engines:
        found = by_pod[e.name]
        assert {b.revision for b in found} == {plan.revision}
        assert [b.base_url for b in found][0] == e.url
        wanted = e.identities() if e.role == "prefill" else e.identities()[:1]
        assert [b.identity for b in found] == wanted  # engine_id (+ _dp<rank>), host, side channel, tp/pp


@pytest.mark.parametrize("path", RUNNABLE, ids=[p.stem for p in RUNNABLE])
def test_router_runs_static_with_the_rendered_flags(path: Path) -> None:
    plan = plan_of(path)
    (router,) = plan.routers
    assert router.argv[:3] == (plan_of(path).routers[0].argv[:3])
    cfg = router_args(list(router.argv[3:]))  # after `python -m disagg_connector.router`
    spec = load_example(path)["spec"]
    assert cfg.static_endpoints == plan.static_endpoints_path and cfg.namespace is None and cfg.selector is None
    assert cfg.port == router.port and cfg.host == "127.0.0.1"
    # The protocol comes from each static entry's mode, as from each pod's annotation: one per revision.
    assert {e["mode"] for e in plan.static_endpoints()["endpoints"]} == {plan.transfer_mode}
    assert cfg.leg_timeout == spec.get("router", {}).get("requestDeadlineSeconds", 60)


def test_overrides_are_applied_and_listed() -> None:
    doc = load_example(MINIMAL)
    options = local_options(doc, gpus=("0",), colocate=True, kv_cache_memory_bytes=1 << 30, load_format="dummy",
                            enforce_eager=True, model_path="/m", extra_args=("--max-num-seqs", "8"),
                            env=(("VLLM_USE_FLASHINFER_SAMPLER", "0"),), transfer_mode="Pull",
                            launcher=("python3", "-m", "vllm.entrypoints.cli.main"), router_modes=("push-sequential",))
    plan = local_plan(doc, options, new_uid=_uids())
    for e in plan.engines:
        assert e.argv[:4] == ("python3", "-m", "vllm.entrypoints.cli.main", "serve") and e.argv[4] == "/m"
        assert flag_value(e.argv, "--load-format") == "dummy" and "--enforce-eager" in e.argv
        assert flag_value(e.argv, "--kv-cache-memory-bytes") == str(1 << 30)
        assert e.argv[-2:] == ("--max-num-seqs", "8") and e.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
        assert json.loads(flag_value(e.argv, "--kv-transfer-config") or "")["kv_connector"] == "NixlConnector"
        assert e.gpus == ("0",)
    listed = "\n".join(str(o) for o in plan.overrides)
    for phrase in ("spec.kvTransfer.mode = Pull", "spec.kvTransfer.backend = UCX", "efa.count = 0", "--load-format dummy",
                   "--enforce-eager", "--kv-cache-memory-bytes", "--max-num-seqs 8", "engine model = /m",
                   "VLLM_USE_FLASHINFER_SAMPLER=0", "router --mode = push-sequential"):
        assert phrase in listed
    assert listed in describe(plan).replace("#   ", "")


def test_secret_values_are_masked_in_the_plan() -> None:
    path = next(p for p in EXAMPLES if "p5en" in p.stem)
    plan = plan_of(path)
    assert all(e.env["HF_TOKEN"] == "hf_secret" for e in plan.engines)
    assert "hf_secret" not in describe(plan) and "HF_TOKEN='***'" in describe(plan)


@pytest.mark.parametrize(
    ("case", "doc_patch", "options", "phrase"),
    [
        ("neuron", None, {}, "NVIDIA GPUs only"),
        ("too-few-gpus", {}, {"gpus": ("0",)}, "--colocate"),
        ("colocated-without-kv-cache", {}, {"gpus": ("0",), "colocate": True}, "--kv-cache-memory-bytes"),
        ("pvc-without-model-path", {"model": {"source": {"uri": "pvc://cache/m"}}}, {}, "--model-path"),
        ("bad-router-mode", {}, {"router_modes": ("sideways",)}, "push, push-sequential, pull"),
    ],
)
def test_what_cannot_run_locally_says_what_to_change(case: str, doc_patch: dict | None, options: dict, phrase: str) -> None:
    doc = load_example(next(p for p in EXAMPLES if p.stem.startswith("trn2"))) if doc_patch is None else dm(doc_patch)
    opts = {"gpus": ("0", "1"), "backend": "UCX", **options}
    with pytest.raises(LocalRunError, match=phrase.replace(".", r"\.").replace("-", r"\-")):
        local_plan(doc, LocalOptions(**opts))


def test_spec_overrides_go_through_admission() -> None:
    from disagg_operator.api.validation import SpecError

    with pytest.raises(SpecError, match="bidirectional"):
        local_plan(dm({"kvTransfer": {"bidirectional": True}}), LocalOptions(gpus=("0", "1"), transfer_mode="Push"))


# --- the load generator's arithmetic ---------------------------------------------------------------------
def test_percentiles_interpolate_like_numpy() -> None:
    xs = [float(x) for x in range(1, 11)]
    assert loadgen.percentile(xs, 50) == 5.5
    assert loadgen.percentile(xs, 90) == pytest.approx(9.1)
    assert loadgen.percentile(xs, 99) == pytest.approx(9.91)
    assert loadgen.percentile([3.0], 90) == 3.0
    assert math.isnan(loadgen.percentile([], 50))
    s = loadgen.Stats.of([4.0, 1.0, 2.0, 3.0])
    assert (s.mean, s.p50, s.n) == (2.5, 2.5, 4)


def test_poisson_arrivals_are_reproducible_with_the_rate_as_mean() -> None:
    a = loadgen.poisson_arrivals(4.0, 4000, random.Random(7))
    assert a == loadgen.poisson_arrivals(4.0, 4000, random.Random(7))
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)  # 4000 draws: within 5 % for this seed
    with pytest.raises(ValueError):
        loadgen.poisson_arrivals(0.0, 3, random.Random(0))


def test_thinned_arrivals_follow_a_rate_that_changes_and_are_reproducible() -> None:
    rate = lambda t: 0.0 if t < 100 else 8.0  # noqa: E731  (silent, then 8 a second)
    a = list(loadgen.thinned_arrivals(rate, 600.0, 8.0, random.Random(5)))
    assert a == list(loadgen.thinned_arrivals(rate, 600.0, 8.0, random.Random(5)))
    assert 100 <= a[0] and a[-1] < 600 and all(x < y for x, y in zip(a, a[1:]))
    assert len(a) == pytest.approx(8.0 * 500, rel=0.05)
    half = list(loadgen.thinned_arrivals(lambda t: 4.0, 600.0, 8.0, random.Random(5)))
    assert len(half) == pytest.approx(4.0 * 600, rel=0.05), "thinned to the rate, not the peak"


def test_requests_per_cell() -> None:
    assert loadgen.requests_per_cell(1.0, 10.0, 12) == 12
    assert loadgen.requests_per_cell(8.0, 10.0, 12) == 80
    assert loadgen.requests_per_cell(2.5, 3.0, 1) == 8


def test_prompts_are_words_of_the_test_tokenizer() -> None:
    words = loadgen.random_prompt(500, random.Random(1)).split()
    assert len(words) == 500
    assert all(w.startswith("w") and int(w[1:]) in loadgen.WORD_IDS for w in words)


def record(**kw: Any) -> loadgen.RequestRecord:
    base: dict[str, Any] = {"mode": "m", "prompt_tokens": 100, "rate": 1.0, "index": 0, "scheduled": 0.0,
                            "start": 10.0, "first_token": 10.2, "end": 11.2, "chunks": 11, "status": 200}
    return loadgen.RequestRecord(**{**base, **kw})


def test_request_figures() -> None:
    r = record()
    assert r.ok and r.ttft == pytest.approx(0.2) and r.e2e == pytest.approx(1.2) and r.tpot == pytest.approx(0.1)
    assert record(usage_completion_tokens=21).tpot == pytest.approx(0.05)  # usage wins over counted chunks
    assert math.isnan(record(chunks=1).tpot)
    direct = record(prefill_done=10.15, decode_sent=10.0)
    assert direct.prefill_leg == pytest.approx(0.15) and direct.after_prefill == pytest.approx(0.05)
    seq = record(prefill_done=10.15, decode_sent=10.16)
    assert seq.after_prefill == pytest.approx(0.04)


def test_a_request_meets_an_slo_only_answered_within_both_targets() -> None:
    r = record()  # TTFT 0.2 s, TPOT 0.1 s
    assert r.meets(0.2, 0.1) and not r.meets(0.19, 0.1) and not r.meets(0.2, 0.09)
    assert record(chunks=1, end=10.2).meets(0.2, 0.0)  # one token: no TPOT to miss
    assert not record(status=500, error="HTTP 500: x").meets(10.0, 10.0)
    assert not record(error="unfinished", end=math.nan).meets(10.0, 10.0)


def test_summary_counts_and_splits() -> None:
    recs = [record(index=i, start=10.0 + i, first_token=10.1 + i + 0.01 * i, end=11.0 + i) for i in range(4)]
    recs += [record(index=4, status=500, error="HTTP 500: x"), record(index=5, error="unfinished", end=math.nan)]
    s = loadgen.summarize(recs)
    assert (s.sent, s.ok, s.failed, s.unfinished) == (6, 4, 1, 1)
    assert s.errors == {"HTTP 500: x": 1, "unfinished": 1}
    assert s.ttft.n == 4 and s.ttft.p50 == pytest.approx(0.115)
    assert s.duration_s == pytest.approx(4.0) and s.output_tokens == 11
    assert s.prefill_leg.n == 0  # router dispatch: the legs are not seen


def test_sse_events() -> None:
    assert loadgen.parse_sse_event(b'data: {"choices": [{"text": "a"}]}\n') == {"choices": [{"text": "a"}]}
    assert loadgen.parse_sse_event(b"data: [DONE]\n") == "[DONE]"
    assert loadgen.parse_sse_event(b": keep-alive\n") is None
    assert loadgen.parse_sse_event(b"data: not json\n") is None


def test_modes_name_their_engines_and_dispatcher() -> None:
    assert mode("router-push-sequential") == mode("router-push-sequential")
    m = mode("direct-pull")
    assert (m.transfer_mode, m.router_mode, m.direct_dispatch) == ("Pull", None, "pull")
    assert mode("router-push").router_mode == "push"
    with pytest.raises(ValueError, match="router-push"):
        mode("router-teleport")
    sweep = Sweep((1,), (1.0,), (mode("router-pull"), mode("router-push"), mode("direct-pull")))
    assert [(t, [x.name for x in ms]) for t, ms in sweep.groups()] == [("Pull", ["router-pull", "direct-pull"]), ("Push", ["router-push"])]


def test_markdown_shows_every_cell_and_ratios_to_the_baseline() -> None:
    cells = []
    for name, ttft in (("router-pull", 0.4), ("router-push", 0.2)):
        recs = [record(mode=name, index=i, first_token=10.0 + ttft) for i in range(3)]
        cells.append(report.summary_dict(loadgen.summarize(recs)))
    results = {"command": "disagg-localrun bench", "started": "now", "cells": cells, "groups": [], "environment": {},
               "sweep": {"modes": ["router-pull", "router-push"], "prompts": [100], "rates": [1.0], "max_tokens": 8,
                         "cell_seconds": 1, "min_requests": 3, "seed": 0}}
    md = report.markdown(results)
    assert "| 100 | 1 | router-pull | 3/3 | 400 | 400 | 400 | 400 | 80.0 |" in md
    assert "| 100 | 1 | router-push | 3/3 | 200 | 200 | 200 | 200 | 100 |" in md
    assert "## Ratio to router-pull" in md and "| 100 | 1 | 0.50 | 0.50 | 1.25 |" in md


def test_runs_merge_into_one_report() -> None:
    def run(name: str, ttft: float, prompt: int) -> dict[str, Any]:
        recs = [record(mode=name, prompt_tokens=prompt, index=i, first_token=10.0 + ttft) for i in range(2)]
        return {"command": f"bench {name}", "started": name, "cells": [report.summary_dict(loadgen.summarize(recs))],
                "groups": [{"transfer_mode": name, "modes": [name], "backend": "UCX", "revision": "r", "plan": "p", "overrides": []}],
                "warmup": [], "environment": {},
                "sweep": {"modes": [name], "prompts": [prompt], "rates": [1.0], "max_tokens": 8, "cell_seconds": 1,
                          "min_requests": 2, "seed": 0}}

    merged = report.merge([run("router-push", 0.2, 100), run("router-pull", 0.4, 100), run("router-pull", 0.5, 200)])
    assert merged["sweep"]["modes"] == ["router-push", "router-pull"] and merged["sweep"]["prompts"] == [100, 200]
    assert len(merged["cells"]) == 3 and len(merged["groups"]) == 3
    assert merged["command"] == "bench router-push ; bench router-pull ; bench router-pull"
    md = report.markdown(merged, "router-pull")
    assert "## Ratio to router-pull" in md and "| 100 | 1 | 0.50 | 0.50 |" in md


def test_ucx_on_one_gpu_gets_zero_copy_reads_and_says_so() -> None:
    doc = load_example(MINIMAL)
    shared = local_plan(doc, local_options(doc, gpus=("0",), colocate=True, kv_cache_memory_bytes=1 << 30,
                                           transfer_mode="Pull"), new_uid=_uids())  # fmt: skip
    assert shared.backend == "UCX"
    for e in shared.engines:
        assert e.env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on" and e.env["UCX_PROTO_EMULATION_ENABLE"] == "n"
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in describe(shared)
    own = local_plan(doc, local_options(doc, gpus=("0",), colocate=True, kv_cache_memory_bytes=1 << 30,
                                        env=(("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n"),)), new_uid=_uids())  # fmt: skip
    assert {e.env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] for e in own.engines} == {"n"}  # the user's choice wins
    separate = local_plan(doc, local_options(doc, gpus=tuple(str(i) for i in range(64))), new_uid=_uids())
    assert not any("UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in e.env for e in separate.engines)


def test_repetitions_report_the_median_of_each_runs_p50_and_its_spread() -> None:
    def run(push_ttft: float, pull_ttft: float) -> dict[str, Any]:
        cell = lambda mode, ttft: {"prompt_tokens": 1024, "rate": 2.0, "mode": mode,  # noqa: E731
                                   "ttft": {"p50": ttft}, "tpot": {"p50": 0.02}}
        return {"command": "x", "started": "t", "sweep": {"modes": ["router-push", "router-pull"], "prompts": [1024],
                "rates": [2.0]}, "groups": [], "warmup": [], "cells": [cell("router-push", push_ttft), cell("router-pull", pull_ttft)]}
    table = report.repeats_table([run(0.100, 0.200), run(0.300, 0.200), run(0.110, 0.400)], "router-pull")
    push, pull = table[2], table[3]
    assert push.startswith("| 1024 | 2 | router-push | 3 | 110 (100-300) | 0.55 |"), push  # median 110 / 200
    assert pull.startswith("| 1024 | 2 | router-pull | 3 | 200 (200-400) | 1.00 |"), pull


# --- a peer's router (vllm-router) on the same engines ------------------------------------------------------
def _values(argv: tuple[str, ...], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_peer_modes_run_vllm_router_against_the_same_engines() -> None:
    assert (mode("vllmrouter-push").transfer_mode, mode("vllmrouter-push").router_mode) == ("Push", "vllmrouter-push")
    assert (mode("vllmrouter-pull").transfer_mode, mode("vllmrouter-pull").direct_dispatch) == ("Pull", None)
    with pytest.raises(ValueError, match="vllmrouter-pull"):
        mode("vllmrouter-push-sequential")  # vllm-router has no such switch: it decides itself
    doc = load_example(MINIMAL)
    plan = local_plan(doc, local_options(doc, router_modes=("push", "vllmrouter-push"),
                                         peer_router_command=("python3", "-m", "vllm_router.launch_router")), new_uid=_uids())
    ours, peer = plan.router("push"), plan.router("vllmrouter-push")
    assert peer.argv[:3] == ("python3", "-m", "vllm_router.launch_router")
    assert _values(peer.argv, "--prefill") == [e.url for e in plan.role("prefill")]
    assert _values(peer.argv, "--decode") == [e.url for e in plan.role("decode")]
    assert flag_value(peer.argv, "--kv-connector") == "nixl" and "--vllm-pd-disaggregation" in peer.argv
    assert flag_value(peer.argv, "--port") == str(peer.port) and flag_value(peer.argv, "--host") == "127.0.0.1"
    assert flag_value(peer.argv, "--prometheus-port") == str(peer.metrics_port) and ours.metrics_port is None
    ports = [ours.port, peer.port, peer.metrics_port] + [p for e in plan.engines for p in (e.http_port, e.side_channel_port)]
    assert len(ports) == len(set(ports))
    assert "router (vllmrouter-push) = python3 -m vllm_router.launch_router" in describe(plan)


def test_a_peer_mode_needs_engines_of_its_transfer_mode() -> None:
    doc = load_example(MINIMAL)
    assert set(PEER_ROUTER_MODES) == {"vllmrouter-push", "vllmrouter-pull"}
    with pytest.raises(LocalRunError, match="needs engines in pull mode"):
        local_plan(doc, local_options(doc, transfer_mode="Push", router_modes=("vllmrouter-pull",)), new_uid=_uids())
    plan = local_plan(doc, local_options(doc, transfer_mode="Pull", router_modes=("vllmrouter-pull",)), new_uid=_uids())
    assert [r.mode for r in plan.routers] == ["vllmrouter-pull"]


# --- vLLM's own KV-transfer series per cell --------------------------------------------------------------
METRICS_BEFORE = """# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="m"} 1.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.02
vllm:nixl_xfer_time_seconds_created{engine="0",model_name="m"} 1.7e9
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
"""
METRICS_AFTER = METRICS_BEFORE.replace("_count{engine=\"0\",model_name=\"m\"} 2.0", "_count{engine=\"0\",model_name=\"m\"} 6.0") \
    .replace("_sum{engine=\"0\",model_name=\"m\"} 0.02", "_sum{engine=\"0\",model_name=\"m\"} 0.1") \
    + 'vllm:nixl_xfer_time_seconds_count{engine="1",model_name="m"} 1.0\nvllm:nixl_xfer_time_seconds_sum{engine="1",model_name="m"} 0.02\n'


def test_kv_series_are_summed_over_ranks_and_taken_per_cell() -> None:
    before = {"prefill-0": parse_series(METRICS_BEFORE, "vllm:nixl_"), "decode-0": {}}
    assert before["prefill-0"] == {"vllm:nixl_xfer_time_seconds_count": 2.0, "vllm:nixl_xfer_time_seconds_sum": 0.02,
                                   "vllm:nixl_num_failed_transfers_total": 0.0}  # no buckets, stamps, other series
    after = {"prefill-0": parse_series(METRICS_AFTER, "vllm:nixl_"), "decode-0": {}}
    delta = series_delta(before, after)
    assert delta["prefill-0"]["vllm:nixl_xfer_time_seconds_count"] == 5.0  # 4 on rank 0, 1 on rank 1
    assert math.isclose(delta["prefill-0"]["vllm:nixl_xfer_time_seconds_sum"], 0.1)
    assert delta["decode-0"] == {}
    cell = {"prompt_tokens": 1024, "rate": 2.0, "mode": "router-push", "ok": 5, "kv_transfer": delta}
    results = {"sweep": {"modes": ["router-push"], "prompts": [1024], "rates": [2.0]}, "cells": [cell]}
    (row,) = report.kv_transfer_table(results)[2:]
    assert row.startswith("| 1024 | 2 | router-push | 5 | 5 | 20.0 | - |"), row  # 0.1 s / 5 transfers
    run = {**results, "command": "x", "started": "t", "groups": [], "warmup": []}
    (rep,) = report.repeats_kv_table([run, run])[2:]
    assert rep.startswith("| 1024 | 2 | router-push | 2 | 10 | 20.0 |"), rep
    no_series = {**results, "cells": [{**cell, "kv_transfer": {"prefill-0": {}, "decode-0": {}}}]}
    assert report.kv_transfer_table(no_series) == []  # engines without vllm:nixl_* (the simulator): no table


GAUGES_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
"""


def test_scheduler_gauges_sum_requests_over_ranks_and_take_the_fullest_ranks_kv() -> None:
    assert gauge_values(GAUGES_PAGE) == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 5.0,
                                         "vllm:kv_cache_usage_perc": 0.75}  # a longer name sharing a prefix is not summed in
    assert gauge_values("") == {}
    cell = {"prompt_tokens": 16384, "rate": 8.0, "mode": "router-push", "engine_gauges": {
        "decode-0": {"vllm:num_requests_waiting": {"mean": 2.5, "max": 6.0, "samples": 10},
                     "vllm:kv_cache_usage_perc": {"mean": 0.5, "max": 0.97, "samples": 10}}}}
    sweep = {"modes": ["router-push"], "prompts": [16384], "rates": [8.0]}
    (row,) = report.gauges_table({"sweep": sweep, "cells": [cell]})[2:]
    assert row == "| 16384 | 8 | router-push | decode-0 | - | 2.5 | 6 | 0.50 | 0.97 | 10 |", row
    assert report.gauges_table({"sweep": sweep, "cells": [{**cell, "engine_gauges": {}}]}) == []  # older results: no table


def test_each_mode_of_a_cell_runs_first_in_turn() -> None:
    modes = [mode("router-push"), mode("direct-push"), mode("router-push-sequential")]
    firsts = [cell_order(modes, k)[0].name for k in range(6)]
    assert firsts == ["router-push", "direct-push", "router-push-sequential"] * 2
    assert all(sorted(m.name for m in cell_order(modes, k)) == sorted(m.name for m in modes) for k in range(6))
    assert cell_order([], 3) == []


def test_peer_router_counters_tell_its_sequential_and_concurrent_legs_apart() -> None:
    counters = {'vllm_router_pd_prefill_requests_total{worker="http://127.0.0.1:18003"}': 1.0,
                'vllm_router_pd_prefill_requests_total{worker="127.0.0.1:18003"}': 41.0,
                'vllm_router_pd_decode_requests_total{worker="127.0.0.1:18005"}': 41.0}
    assert report.peer_router_paths(counters) == (1.0, 41.0)
    results = {"command": "x", "started": "t", "environment": {}, "cells": [], "sweep": {
        "modes": ["vllmrouter-push"], "prompts": [1], "rates": [1.0], "max_tokens": 1, "cell_seconds": 1, "min_requests": 1, "seed": 0},
        "groups": [{"transfer_mode": "Push", "modes": ["vllmrouter-push"], "backend": "UCX", "revision": "r", "plan": "p",
                    "overrides": [], "peer_router_counters": {"vllmrouter-push": counters}}]}
    assert "Prefill legs on its sequential path: 1; on its concurrent push path: 41" in report.markdown(results)


# --- routing comparisons: modes that differ only in the prefill policy (issue 19) ---------------------------
def test_a_router_mode_names_its_prefill_policy() -> None:
    m = mode("router-push:prefix-and-load")
    assert (m.transfer_mode, m.router_mode, m.direct_dispatch) == ("Push", "push:prefix-and-load", None)
    assert mode("router-pull:least-outstanding").router_mode == "pull:least-outstanding"
    peer = mode("vllmrouter-push:cache_aware")
    assert (peer.transfer_mode, peer.router_mode) == ("Push", "vllmrouter-push:cache_aware")
    for bad, phrase in (("router-push:teleport", "prefill policy"), ("direct-push:prefix-and-load", "only a router mode"),
                        ("vllmrouter-push:prefix-and-load", "vllm-router's prefill policy")):
        with pytest.raises(ValueError, match=phrase):
            mode(bad)


def test_routers_that_differ_in_policy_run_side_by_side_on_the_same_engines() -> None:
    doc = load_example(MINIMAL)
    modes = ("push:least-outstanding", "push:prefix-and-load", "vllmrouter-push:cache_aware")
    plan = local_plan(doc, local_options(doc, router_modes=modes, peer_router_command=("vllm-router",)), new_uid=_uids())
    lo, pal, peer = (plan.router(m) for m in modes)
    assert flag_value(lo.argv, "--prefill-policy") == "least-outstanding" and _values(lo.argv, "--prefill-policy") == ["least-outstanding"]
    assert flag_value(pal.argv, "--prefill-policy") == "prefix-and-load"
    assert "--mode" not in lo.argv  # the engines' own transfer mode
    assert _values(peer.argv, "--policy") == ["round_robin"] and _values(peer.argv, "--prefill-policy") == ["cache_aware"]
    assert len({lo.port, pal.port, peer.port, peer.metrics_port}) == 4
    assert router_args(list(lo.argv[3:])).prefill_policy == "least-outstanding"  # our router's own parser takes it
    assert "router (push:prefix-and-load) --prefill-policy = prefix-and-load" in describe(plan)
    with pytest.raises(LocalRunError, match="unknown prefill policy"):
        local_plan(doc, local_options(doc, router_modes=("push:teleport",)), new_uid=_uids())


def test_engines_that_publish_kv_events_get_their_own_event_ports() -> None:
    doc = dm({"prefill": {"replicas": 2}, "engine": {"enablePrefixCaching": True}}, name="events")
    plan = local_plan(doc, local_options(doc, gpus=("0", "1", "2")), new_uid=_uids())
    configs = [json.loads(flag_value(e.argv, "--kv-events-config") or "{}") for e in plan.engines]
    if not any(configs):
        pytest.fail("the rendered engines publish no KV events (spec.router.prefillPolicy PrefixAndLoad renders them)")
    ports = [p for e in plan.engines for p in (e.http_port, e.side_channel_port)]
    for e, config in zip(plan.engines, configs):
        pub, replay = int(config["endpoint"].rsplit(":", 1)[1]), int(config["replay_endpoint"].rsplit(":", 1)[1])
        assert config["endpoint"].startswith("tcp://*:")  # as rendered, only the port is local
        assert (e.annotations[contract.ANNOTATION_KV_EVENTS_PORT], e.annotations[contract.ANNOTATION_KV_EVENTS_REPLAY_PORT]) == (str(pub), str(replay))
        entry = e.static_entry(plan.revision)
        assert (entry["kv_events_port"], entry["kv_events_replay_port"]) == (pub, replay)
        assert entry["kv_block_size"] == e.identities()[0].kv_block_size and entry["kv_hash_seed"] == e.identities()[0].kv_hash_seed
        ports += [pub, replay]
    assert len(ports) == len(set(ports))


def _routing_cell(mode_name: str, ttft: float, hits: tuple[float, float], queries: tuple[float, float],
                  served: tuple[float, float]) -> dict[str, Any]:  # fmt: skip
    series = {f"prefill-{i}": {report.HITS: hits[i], report.QUERIES: queries[i], report.SERVED: served[i]} for i in range(2)}
    series["decode-0"] = {report.HITS: 999.0, report.QUERIES: 1000.0, report.SERVED: sum(served)}  # not a prefill: left out
    return {"prompt_tokens": 2048, "rate": 2.0, "mode": mode_name, "ttft": {"p50": ttft, "p90": 2 * ttft},
            "tpot": {"p50": 0.01}, "e2e": {"p50": 1.0}, "engine_series": series,
            "engine_roles": {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}}


def test_routing_figures_pool_the_prefill_engines_and_measure_imbalance() -> None:
    r = report.routing(_routing_cell("m", 0.2, hits=(600.0, 200.0), queries=(800.0, 400.0), served=(30.0, 10.0)))
    assert r is not None
    assert r.hit_ratio == pytest.approx(800 / 1200) and r.engine_hit_ratios == {"prefill-0": 0.75, "prefill-1": 0.5}
    assert r.shares == {"prefill-0": 0.75, "prefill-1": 0.25} and r.imbalance == pytest.approx(1.5)
    sim = {"engine_series": {"prefill-0": {"sim:prefills": 5.0}, "prefill-1": {"sim:prefills": 5.0}},
           "engine_roles": {"prefill-0": "prefill", "prefill-1": "prefill"}}
    r = report.routing(sim)  # the simulator without vLLM's request counter: its own prefill count
    assert r is not None and r.imbalance == 1.0 and math.isnan(r.hit_ratio)
    assert report.routing({"kv_transfer": {}}) is None  # results of older runs


def test_the_routing_table_takes_medians_of_repetitions_and_ratios_to_the_baseline() -> None:
    def run(lo_ttft: float, pal_ttft: float) -> dict[str, Any]:
        return {"command": "x", "started": "t", "groups": [{"plan": "vllm serve m --block-size 128 ..."}], "warmup": [],
                "sweep": {"modes": ["router-push:least-outstanding", "router-push:prefix-and-load"], "prompts": [2048], "rates": [2.0],
                          "workload": "multi-turn", "turns": 4, "user_tokens": 256, "max_tokens": 128, "think_time": 1.0,
                          "cell_seconds": 10, "min_requests": 8},
                "cells": [_routing_cell("router-push:least-outstanding", lo_ttft, (500.0, 500.0), (1000.0, 1000.0), (10.0, 10.0)),
                          _routing_cell("router-push:prefix-and-load", pal_ttft, (900.0, 800.0), (1000.0, 1000.0), (12.0, 8.0))]}
    lines = report.routing_table([run(0.2, 0.1), run(0.4, 0.1), run(0.3, 0.3)], "router-push:least-outstanding")
    lo, pal, ideal = lines[2:]
    assert lo.startswith("| 2048 | 2 | router-push:least-outstanding | 3 | 0.50 | 0.50 / 0.50 | 0.50 / 0.50 | 1.00 | 300 | 600 |"), lo
    assert pal.startswith("| 2048 | 2 | router-push:prefix-and-load | 3 | 0.85 | 0.90 / 0.80 | 0.60 / 0.40 | 1.20 | 100 | 200 |"), pal
    assert pal.endswith("| 0.33 |")  # 100 / 300 ms
    from disagg_bench.localrun.loadgen import MultiTurnWorkload

    expected = MultiTurnWorkload(2.0, 20, 4, 2048, 256, 128, 1.0).ideal_hit_ratio(128)
    assert f"| *one engine holding everything* | | {expected:.2f} |" in ideal


def test_every_mode_and_cell_draws_its_own_seed() -> None:
    from disagg_bench.localrun.bench import seed_of

    # prompts from a mode's seed must differ from every other mode's: engines shared by the modes keep a prefix cache
    seeds = {seed_of(0, 2048, rate, m) for rate in (4.0, 8.0) for m in ("router-push:least-outstanding", "router-push:prefix-and-load")}
    assert len(seeds) == 4 and seed_of(0, 2048, 4.0) != seed_of(0, 2048, 8.0) != seed_of(1, 2048, 8.0)
    assert seed_of(0, 2048, 4.0, "m") == seed_of(0, 2048, 4.0, "m")


@pytest.mark.parametrize(("args", "phrase"), [(["--turns", "0"], "at least one session of at least one turn"),
                                              (["--rates", "0"], "must be positive")])
def test_a_multi_turn_shape_that_cannot_run_is_refused_before_anything_starts(args: list[str], phrase: str,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from disagg_bench.localrun.cli import EXIT_USAGE, main

    assert main(["bench", "-f", "/nonexistent.yaml", "--workload", "multi-turn", *args]) == EXIT_USAGE
    assert phrase in capsys.readouterr().err
