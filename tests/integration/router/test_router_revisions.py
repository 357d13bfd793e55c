"""Revisions side by side: traffic in proportion to ready pairs, each in its own pods' protocol, pairs never
mixed; draining pods get no new request while their streams finish.

The simulated engines of each revision carry their own NIXL compatibility hash (and transfer mode, a factor
of the hash in vLLM 0.33.0), as real engines of two revisions would: a cross-revision or cross-protocol pair
fails its handshake and shows in the counters. A pull decode sent push-style params prefills locally without
a word, as vLLM's does: its ``recomputed`` counter shows it.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
from collections import Counter

import aiohttp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from disagg_bench.vllm_sim import harness as h  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("router-revisions")
    sims = {
        # revision "a": push, 2 pairs; revision "b": pull, 1 pair
        "a-p1": h.launch_sim(d, "prefill", "push", revision="a", name="a-p1"),
        "a-p2": h.launch_sim(d, "prefill", "push", revision="a", name="a-p2"),
        "a-d1": h.launch_sim(d, "decode", "push", revision="a", name="a-d1"),
        "a-d2": h.launch_sim(d, "decode", "push", revision="a", name="a-d2"),
        "b-p1": h.launch_sim(d, "prefill", "pull", revision="b", name="b-p1"),
        "b-d1": h.launch_sim(d, "decode", "pull", revision="b", name="b-d1", tpot_ms=40.0),
    }
    try:
        h.wait_ready(*sims.values())
        yield d, sims
    finally:
        h.stop_all(*sims.values())


def entries(sims: dict[str, h.Sim], **per_pod: dict) -> list[dict]:
    """Static entries with each pod's transfer-mode annotation, as the operator renders it."""
    return [s.static_entry(mode=s.mode.capitalize(), **per_pod.get(name, {})) for name, s in sims.items()]


def _burst(url: str, n: int, **body) -> list[h.Reply]:
    async def go():
        return await asyncio.gather(*(h.post(url + "/v1/completions", h.completion(max_tokens=3, stream=i % 2 == 0, **body)) for i in range(n)))

    return asyncio.run(go())


def _legs(sims: dict[str, h.Sim]) -> dict[str, list[dict]]:
    return {name: s.events("leg_received") for name, s in sims.items()}


def _no_wrong_protocol(sims: dict[str, h.Sim]) -> None:
    for name, s in sims.items():
        c = s.stats()["counters"]
        bad = {k: c.get(k, 0) for k in ("handshake_failures", "kv_load_failures", "recomputed", "invalid_kv_params", "kv_wrong", "engine_dead")}
        assert not any(bad.values()), (name, bad)


@pytest.fixture
def router(env, request):
    d, sims = env
    static = d / f"{request.node.name}.json"
    h.write_static(static, entries(sims))
    R = h.launch_router(d, static, "push", name=f"router-{request.node.name}")
    try:
        h.wait_ready(R)
        yield R
    finally:
        R.proc.stop()


def test_two_revisions_of_different_modes_serve_side_by_side_in_proportion(env, router):
    _, sims = env
    R = router
    health = R.health()["revisions"]
    assert (health["a"]["mode"], health["a"]["readyPairs"], health["b"]["mode"], health["b"]["readyPairs"]) == ("Push", 2, "Pull", 1)
    assert (health["a"]["weight"], health["b"]["weight"]) == (pytest.approx(2 / 3), pytest.approx(1 / 3))
    before = {name: len(legs) for name, legs in _legs(sims).items()}
    replies = _burst(R.url, 12)
    assert [r.status for r in replies] == [200] * 12
    legs = {name: evs[before[name]:] for name, evs in _legs(sims).items()}
    served = Counter(name[0] for name, evs in legs.items() for e in evs if sims[name].role == "decode")
    assert served == {"a": 8, "b": 4}  # exactly 2:1: smooth weighted round robin over ready pairs

    for name, evs in legs.items():
        for e in evs:
            params = e["kv_transfer_params"]
            if sims[name].role == "decode" and name.startswith("a"):
                assert "remote_block_ids" not in params  # push: P's identity, D registers its own blocks
            if sims[name].role == "decode" and name.startswith("b"):
                assert params["transfer_mode"] == "pull" and params["remote_block_ids"] is not None
    _no_wrong_protocol(sims)
    failures = {rev: r["failures"] for rev, r in R.health()["revisions"].items()}
    assert failures == {"a": {}, "b": {}}


def test_without_annotations_a_pull_revision_is_caught_as_a_protocol_mismatch(env):
    """Pods without the annotation: the router's --mode (push) is assumed. Revision b's prefill answers
    transfer_mode "pull": the router fails that attempt as a protocol mismatch instead of waiting."""
    d, sims = env
    b = {k: v for k, v in sims.items() if k.startswith("b")}
    static = d / "unannotated.json"
    h.write_static(static, [s.static_entry() for s in b.values()])
    R = h.launch_router(d, static, "push", max_retries=0, name="router-unannotated")
    try:
        h.wait_ready(R)
        reply = asyncio.run(h.post(R.url + "/v1/completions", h.completion(stream=True)))
        assert reply.status in (200, 502), reply.body  # the pull decode may answer first (it prefilled itself)
        h.wait_until(lambda: R.health()["revisions"]["b"]["failures"].get("protocol_mismatch") == 1, 10, what="mismatch seen")
        verdict = R.health()["revisions"]["b"]
        assert verdict["mode"] == "Push" and verdict["succeeded"] == 0
    finally:
        R.proc.stop()


def test_pods_that_disagree_on_the_mode_take_no_traffic(env):
    d, sims = env
    a = {k: v for k, v in sims.items() if k.startswith("a")}
    static = d / "conflict.json"
    h.write_static(static, [s.static_entry(mode="Pull" if name == "a-d2" else "Push") for name, s in a.items()])
    R = h.launch_router(d, static, "push", name="router-conflict")
    try:
        h.wait_ready(R)
        rev = R.health()["revisions"]["a"]
        assert rev["mode"] is None and "a-d2=Pull" in rev["modeConflict"] and rev["readyPairs"] == 0
        reply = asyncio.run(h.post(R.url + "/v1/completions", h.completion()))
        assert reply.status == 503 and "disagree" in reply.json()["error"]["message"]
    finally:
        R.proc.stop()


def test_a_draining_pod_gets_no_new_request_and_its_stream_finishes(env, router):
    d, sims = env
    R = router
    b_decode = sims["b-d1"]  # 40 ms per token

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(R.url + "/v1/completions", json=h.completion(max_tokens=60, stream=True)) as resp:
                assert resp.status == 200
                first = await resp.content.readany()
                busy = await asyncio.to_thread(
                    h.wait_until, lambda: next((b for b in R.health()["backends"] if b["role"] == "decode" and b["inflight"]), None), 10
                )
                # the operator marks the pod that is streaming as draining
                h.write_static(R.static_path, entries(sims, **{busy["pod"]: {"draining": True}}))
                await asyncio.to_thread(h.wait_until, lambda: R.backend(busy["pod"])["draining"], 10)
                assert R.backend(busy["pod"])["inflight"] == 1
                pod = busy["pod"]
                assert R.metric("disagg_router_backend_draining", pod=pod, role="decode", revision="b") == 1.0
                assert R.metric("disagg_router_backend_in_flight", pod=pod, role="decode", revision="b") == 1.0
                # new requests avoid it
                others = {n: s.counter("requests") for n, s in sims.items()}
                replies = await asyncio.gather(*(h.post(R.url + "/v1/completions", h.completion(max_tokens=2)) for _ in range(6)))
                assert [r.status for r in replies] == [200] * 6
                assert sims[busy["pod"]].counter("requests") == others[busy["pod"]]
                return busy["pod"], first + await resp.read()

    # The long stream must land on b's decode (60 x 40 ms): a's decodes are drained until it started.
    h.write_static(R.static_path, entries(sims, **{"a-d1": {"draining": True}, "a-d2": {"draining": True}}))
    h.wait_until(lambda: R.serving() == {"b"}, 10, what="only b serving")
    pod, body = asyncio.run(go())
    assert pod == "b-d1" and b_decode.counter("completed") >= 1
    assert body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body  # the in-flight stream finished
    assert R.backend(pod)["inflight"] == 0 and R.backend(pod)["draining"] is True
