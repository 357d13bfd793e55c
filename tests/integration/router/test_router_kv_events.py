"""The router follows its prefill engines' KV events (docs/router.md, Policies): it sees the blocks another client
(say, another router replica) put in an engine's prefix cache, and sends a token-id prompt that starts with them
to that engine, although its own prefix index never saw the prompt. Simulated engines publish vLLM's events on
vLLM's wire format with vLLM's block hashes (the seed is PYTHONHASHSEED, shared by the router's static entries as
the operator shares it through the pods' annotations)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from disagg_connector import contract
from disagg_bench.vllm_sim import harness as h

SEED = "4242"
BLOCK = 16


def _engine(tmp: Path, role: str) -> tuple[h.Sim, int, int]:
    events, replay = h.free_port(), h.free_port()
    config = {
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": contract.KV_EVENTS_TOPIC,
        "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}",
    }  # fmt: skip
    extra = ["--block-size", str(BLOCK), "--prefix-caching-hash-algo", contract.KV_HASH_ALGO, "--kv-events-config", json.dumps(config)]
    return h.launch_sim(tmp, role, "push", extra=extra), events, replay


def _entry(sim: h.Sim, events: int, replay: int) -> dict[str, Any]:
    return sim.static_entry(kv_events_port=events, kv_events_replay_port=replay, kv_hash_seed=SEED, kv_block_size=BLOCK)


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _served(sims: list[h.Sim]) -> dict[str, int]:
    return {s.name: len(s.events("leg_received")) for s in sims}


def _backend(router: h.Router, pod: str) -> dict[str, Any]:
    return next(b for b in router.health()["backends"] if b["pod"] == pod)


def test_a_prefix_cached_by_traffic_the_router_did_not_send_draws_the_request(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", SEED)  # the engines' seed (the simulators inherit it, as vLLM reads it)
    (p0, e0, r0), (p1, e1, r1), (d, _, _) = _engine(tmp_path, "prefill"), _engine(tmp_path, "prefill"), _engine(tmp_path, "decode")
    static = tmp_path / "endpoints.json"
    h.write_static(static, [_entry(p0, e0, r0), _entry(p1, e1, r1), d.static_entry()])
    router = h.launch_router(tmp_path, static, "push", extra=("--load-scrape-interval-seconds", "0.2"))
    try:
        h.wait_ready(p0, p1, d, router)
        h.wait_until(lambda: router.health()["revisions"]["r1"]["readyPairs"] == 1, what="a ready pair")
        h.wait_until(lambda: all(_backend(router, p.name)["routing"]["kvBlocks"] is not None for p in (p0, p1)),
                     what="the router following both prefills' KV events")  # fmt: skip

        # Another client warms each prefill with a prompt of its own, straight to the engine.
        warm = {p1.name: _tokens(1000, 40 * BLOCK), p0.name: _tokens(5000, 40 * BLOCK)}
        for sim in (p0, p1):
            reply = asyncio.run(h.post(sim.url + "/v1/completions", {**h.completion(max_tokens=1), "prompt": warm[sim.name]}))
            assert reply.status == 200
        for sim in (p0, p1):
            h.wait_until(lambda sim=sim: _backend(router, sim.name)["routing"]["kvBlocks"] >= 40, what=f"{sim.name}'s blocks indexed")

        # Through the router: each prompt starts with one engine's cached prefix and goes there, three times over.
        for pod, sim in ((p1.name, p1), (p0.name, p0)):
            before = _served([p0, p1])
            for turn in range(3):
                body = {**h.completion(max_tokens=2), "prompt": warm[pod] + _tokens(90_000 + 100 * turn, 3 * BLOCK)}
                reply = asyncio.run(h.post(router.url + "/v1/completions", body))
                assert reply.status == 200, reply.body
            after = _served([p0, p1])
            assert after[pod] - before[pod] == 3 and sum(after.values()) - sum(before.values()) == 3, (pod, before, after)
        picks = h.http_get(router.url + "/metrics")[1].decode()
        assert 'disagg_router_picks_total{policy="prefix-and-load",reason="cache_hit",role="prefill"} 6.0' in picks
        # the router expected the 40 warmed blocks of each of the six prompts (43 blocks long) to be cached
        routing = _backend(router, p1.name)["routing"]
        assert routing["expectedHitRatio"] == pytest.approx(40 / 43, abs=0.01)
    finally:
        h.stop_all(router, p0, p1, d)
