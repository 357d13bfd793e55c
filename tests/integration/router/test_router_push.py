"""Router in push mode against simulated vLLM engines, all separate processes on loopback."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

import aiohttp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from disagg_bench.vllm_sim import harness as h  # noqa: E402
from tests.fixtures.router import client_events  # noqa: E402

# Slow prefill (5 ms per prompt token) so that "the decode leg arrived while the prefill was still
# running" is a matter of ordering with a wide margin, never of timing.
SLOW_PREFILL = {"prefill_us_per_token": 5000.0}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("router-push")
    P = h.launch_sim(d, "prefill", "push", **SLOW_PREFILL)
    D = h.launch_sim(d, "decode", "push")
    main = ["--push-match", "transfer-id"]  # vLLM main: P pairs the legs by transfer_id
    Pmain = h.launch_sim(d, "prefill", "push", revision="main", extra=main, **SLOW_PREFILL)
    Dmain = h.launch_sim(d, "decode", "push", revision="main", extra=main)
    Pdp = h.launch_sim(d, "prefill", "push", revision="dp", dp=2)
    Ddp = h.launch_sim(d, "decode", "push", revision="dp")
    static = d / "endpoints.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    static_dp = d / "endpoints-dp.json"
    h.write_static(static_dp, [Pdp.static_entry(), Ddp.static_entry()])
    static_main = d / "endpoints-main.json"
    h.write_static(static_main, [Pmain.static_entry(), Dmain.static_entry()])
    R = h.launch_router(d, static, "push")
    Rdp = h.launch_router(d, static_dp, "push", name="router-dp")
    Rmain = h.launch_router(d, static_main, "push", name="router-main")
    Rseq = h.launch_router(d, static, "push-sequential", name="router-seq")
    try:
        h.wait_ready(P, D, Pdp, Ddp, Pmain, Dmain, R, Rdp, Rmain, Rseq)
        yield {"P": P, "D": D, "R": R, "Pdp": Pdp, "Ddp": Ddp, "Rdp": Rdp, "Pmain": Pmain, "Dmain": Dmain, "Rmain": Rmain, "Rseq": Rseq}
    finally:
        h.stop_all(R, Rdp, Rmain, Rseq, P, D, Pdp, Ddp, Pmain, Dmain)


def _leg(sim: h.Sim, xid: str) -> dict:
    [ev] = [e for e in sim.events("leg_received") if e["xid"] == xid]
    return ev


def test_push_legs_are_concurrent_and_carry_p_identity(env):
    P, D, R = env["P"], env["D"], env["R"]
    reply = asyncio.run(h.post(R.url + "/v1/completions", h.completion(prompt_words=200, max_tokens=3)))
    assert reply.status == 200, reply.body
    xid = reply.xid
    assert reply.json()["choices"][0]["text"] == " tok0 tok1 tok2"

    # Both legs carried the same X-Request-Id, hit the same endpoint type, and carry one transfer_id.
    p_leg, d_leg = _leg(P, xid), _leg(D, xid)
    assert p_leg["endpoint"] == d_leg["endpoint"] == "completions"
    assert p_leg["kv_transfer_params"]["do_remote_decode"] is True and p_leg["max_tokens"] == 1
    transfer_id = p_leg["kv_transfer_params"]["transfer_id"]
    assert transfer_id == f"xfer-{xid}"
    # The decode leg carried P's identity per the contract, every key vLLM reads with [].
    assert d_leg["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": P.engine_id,
        "remote_host": h.HOST,
        "remote_port": P.side_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": f"cmpl-{xid}-0",
        "transfer_id": transfer_id,
    }
    # Concurrency, observed by P itself: D's registration (sent only once D had the decode leg) reached P
    # while P was still computing this request's prefill.
    [reg] = [e for e in P.events("registration_received") if e["rid"].startswith(f"cmpl-{xid}-0-")]
    assert reg["prefill_done"] is False
    [done] = [e for e in P.events("prefill_done") if e["xid"] == xid]
    assert reg["n"] < done["n"]
    # ... and P wrote this request's KV into D's registered blocks exactly once.
    assert len([e for e in P.events("push_done") if e["rid"] == reg["rid"]]) == 1


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_vllm_main_pairs_the_legs_by_the_routers_transfer_id(env, kind):
    P, D, R = env["Pmain"], env["Dmain"], env["Rmain"]
    path, body = ("/v1/completions", h.completion(max_tokens=2)) if kind == "completions" else ("/v1/chat/completions", h.chat(max_tokens=2))
    reply = asyncio.run(h.post(R.url + path, body))
    assert reply.status == 200, reply.body
    transfer_id = _leg(P, reply.xid)["kv_transfer_params"]["transfer_id"]
    assert _leg(D, reply.xid)["kv_transfer_params"]["transfer_id"] == transfer_id
    [push] = [e for e in P.events("push_done") if reply.xid in e["rid"]]
    assert push["matched_by"] == "transfer_id"


def test_push_sequential_baseline_sends_decode_after_prefill_with_its_own_id(env):
    P, D, R = env["P"], env["D"], env["Rseq"]
    reply = asyncio.run(h.post(R.url + "/v1/completions", h.completion(prompt_words=50, max_tokens=2)))
    assert reply.status == 200, reply.body
    [done] = [e for e in P.events("prefill_done") if e["xid"] == reply.xid]
    d_leg = _leg(D, reply.xid)
    assert d_leg["t"] > done["t"]
    assert d_leg["kv_transfer_params"]["remote_request_id"] == done["rid"]  # P's id, random suffix included


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_streaming_is_the_engines_stream(env, kind):
    """Event for event what the engine sent, less the token ids the router asked for (a migration's continuation
    needs them) and the client did not."""
    D, R = env["D"], env["R"]
    path, body = (
        ("/v1/completions", h.completion(max_tokens=6, stream=True, stream_options={"include_usage": True}))
        if kind == "completions"
        else ("/v1/chat/completions", h.chat(max_tokens=6, stream=True))
    )
    reply = asyncio.run(h.post(R.url + path, body))
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.body.endswith(b"data: [DONE]\n\n") and b"token_ids" not in reply.body
    engine = h.wait_until(lambda: D.body(reply.xid), what="engine body")
    assert b'"token_ids"' in engine
    assert client_events(reply.body) == client_events(engine)


def test_non_streaming_is_byte_identical_to_the_engine(env):
    D, R = env["D"], env["R"]
    reply = asyncio.run(h.post(R.url + "/v1/chat/completions", h.chat(max_tokens=2)))
    assert reply.status == 200
    assert reply.json()["id"] == f"chatcmpl-{reply.xid}"
    assert reply.body == D.body(reply.xid)


def test_data_parallel_prefill_is_pinned_to_its_rank(env):
    Pdp, Ddp, Rdp = env["Pdp"], env["Ddp"], env["Rdp"]

    async def many():
        return await asyncio.gather(*(h.post(Rdp.url + "/v1/completions", h.completion()) for _ in range(4)))

    replies = asyncio.run(many())
    assert [r.status for r in replies] == [200] * 4
    ranks = set()
    for r in replies:
        p_leg, d_leg = _leg(Pdp, r.xid), _leg(Ddp, r.xid)
        rank = int(p_leg["rank_header"])
        ranks.add(rank)
        params = d_leg["kv_transfer_params"]
        assert params["remote_engine_id"] == f"{Pdp.engine_id}_dp{rank}"
        assert params["remote_port"] == Pdp.side_port + rank
    assert ranks == {0, 1}  # least outstanding spreads over both ranks
    assert Pdp.counter("handshake_failures") == 0


def test_client_disconnect_cancels_both_legs(env):
    P, D, R = env["P"], env["D"], env["R"]
    p0, d0 = P.counter("cancelled"), D.counter("cancelled")
    p_legs, d_legs = P.counter("requests"), D.counter("requests")

    async def go():
        async with aiohttp.ClientSession() as s:
            # 2000 prompt tokens at 5 ms each: the prefill runs for 10 s, far beyond this test's needs.
            # The router answers a stream's headers only with its first chunk, so the request is pending.
            body = h.completion(prompt_words=2000, max_tokens=50, stream=True)
            task = asyncio.create_task(s.post(R.url + "/v1/completions", json=body))
            await asyncio.to_thread(
                h.wait_until, lambda: P.counter("requests") > p_legs and D.counter("requests") > d_legs, 30, 0.05, "both legs"
            )
            assert not task.done()
            task.cancel()  # the client goes away before anything was streamed: its connection closes
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    h.wait_until(lambda: P.counter("cancelled") > p0 and D.counter("cancelled") > d0, 30, what="both legs cancelled")
    [p_cancel] = [e for e in P.events("cancelled")][-1:]
    [d_cancel] = [e for e in D.events("cancelled") if e["xid"] == p_cancel["xid"]]
    assert p_cancel["t"] < d_cancel["t"]  # the prefill leg first (one clock: CLOCK_MONOTONIC)
    h.wait_until(lambda: 'cause="client_disconnect"' in R.metrics(), 10, what="metric")
    h.wait_until(lambda: all(b["inflight"] == 0 for b in R.health()["backends"]), 10, what="no leg in flight")


def test_metrics_and_models(env):
    R = env["R"]
    text = R.metrics()
    for name in (
        "disagg_router_requests_total",
        "disagg_router_prefill_seconds_bucket",
        "disagg_router_kv_wait_seconds_bucket",
        "disagg_router_time_to_first_token_seconds_bucket",
        "disagg_router_request_duration_seconds_bucket",
        "disagg_router_backend_in_flight",
        "disagg_router_backend_draining",
        "disagg_router_backend_ejected",
        "disagg_router_ready_pairs",
        "disagg_router_revision_weight",
        "disagg_router_ready_backends",
    ):
        assert name in text, name
    # every streamed request so far went through push on r1 and has its prefill leg and KV wait observed
    assert R.metric("disagg_router_kv_wait_seconds_count", revision="r1", mode="push") >= 1
    assert R.metric("disagg_router_prefill_seconds_count", revision="r1", mode="push") == R.metric(
        "disagg_router_requests_total", revision="r1", mode="push", endpoint="completions", code="200"
    ) + (R.metric("disagg_router_requests_total", revision="r1", mode="push", endpoint="chat", code="200") or 0)
    assert R.metric("disagg_router_ready_pairs", revision="r1") == 1.0
    status, body = h.http_get(R.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == h.MODEL
