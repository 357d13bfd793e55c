"""The simulator the router tests rely on fails the way vLLM 0.33.0 fails (reference §3, §5).

Driven directly, without the router: both legs are sent by the test.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import uuid

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from disagg_bench.vllm_sim import harness as h  # noqa: E402


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-sim")
    s = {
        "P": h.launch_sim(d, "prefill", "push", pp=2),
        "D": h.launch_sim(d, "decode", "push"),
        "Pmain": h.launch_sim(d, "prefill", "push", extra=["--push-match", "transfer-id"]),
        "Dmain": h.launch_sim(d, "decode", "push", extra=["--push-match", "transfer-id"]),
        "Dkey": h.launch_sim(d, "decode", "push"),
        "Dwait": h.launch_sim(d, "decode", "push"),
        "Pshort": h.launch_sim(d, "prefill", "push", lease_seconds=0.3),
        "Dshort": h.launch_sim(d, "decode", "push"),
        "Ppull": h.launch_sim(d, "prefill", "pull", lease_seconds=0.5),
        "Dpull": h.launch_sim(d, "decode", "pull"),
        "Plong": h.launch_sim(d, "prefill", "pull", lease_seconds=3.0),
        # one 4.5 s descriptor prep per read (one block), engine steps of 0.2 s (= heartbeat period here)
        "Dslow": h.launch_sim(d, "decode", "pull", lease_seconds=3.0, descriptor_prep_us_per_block=4.5e6, step_ms=200.0),
        # its API server takes a prompt in at 1 ms per token (a 200-word prompt: 0.2 s and more)
        "Pintake": h.launch_sim(d, "prefill", "push"),
        "Dintake": h.launch_sim(d, "decode", "push", intake_us_per_token=1000.0),
    }
    try:
        h.wait_ready(*s.values())
        yield s
    finally:
        h.stop_all(*s.values())


async def _post(sim: h.Sim, body: dict, xid: str, timeout: float = 60.0) -> h.Reply:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(sim.url + "/v1/completions", json=body, headers={"X-Request-Id": xid}) as r:
            return h.Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read())


def _push_params(P: h.Sim, xid: str, **over) -> dict:
    p = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": P.engine_id, "remote_host": h.HOST,
        "remote_port": P.side_port, "tp_size": P.tp, "pp_size": P.pp, "remote_request_id": f"cmpl-{xid}-0",
    }
    p.update(over)
    return p


PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


def test_push_legs_rendezvous_by_request_id_and_wrong_pp_completes_wrong(sims):
    P, D = sims["P"], sims["D"]
    xid = uuid.uuid4().hex

    async def legs(pp: int):
        return await asyncio.gather(
            _post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), xid),
            _post(D, h.completion(max_tokens=3, kv_transfer_params=_push_params(P, xid, pp_size=pp)), xid),
        )

    p_reply, d_reply = asyncio.run(legs(2))
    assert p_reply.json()["kv_transfer_params"]["transfer_mode"] == "push"
    assert d_reply.json()["choices"][0]["text"] == " tok0 tok1 tok2"
    xid = uuid.uuid4().hex
    _, d_reply = asyncio.run(legs(1))  # pp_size too small: D completes after too few notices
    assert d_reply.json()["choices"][0]["text"] == " ??0 ??1 ??2"


def test_the_decodes_engine_sees_a_leg_only_after_its_api_server_took_the_prompt_in(sims):
    P, D = sims["Pintake"], sims["Dintake"]
    xid = uuid.uuid4().hex

    async def legs():
        return await asyncio.gather(
            _post(P, h.completion(prompt_words=200, max_tokens=1, kv_transfer_params=PREFILL), xid),
            _post(D, h.completion(prompt_words=200, max_tokens=3, kv_transfer_params=_push_params(P, xid)), xid),
        )

    _, d_reply = asyncio.run(legs())
    assert d_reply.json()["choices"][0]["text"] == " tok0 tok1 tok2"
    [arrived] = [e for e in D.events("leg_received") if e["xid"] == xid]
    [registered] = [e for e in D.events("registration_sent") if e["xid"] == xid]
    intake = arrived["prompt_tokens"] * 1000.0 * 1e-6
    assert arrived["prompt_tokens"] >= 200 and registered["t"] - arrived["t"] >= intake - 0.005  # timers: ms granularity


def test_mismatched_request_ids_never_complete(sims):
    P, D = sims["P"], sims["D"]
    xa, xb = uuid.uuid4().hex, uuid.uuid4().hex
    cancelled = D.counter("cancelled")

    async def legs():
        return await asyncio.gather(
            _post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), xa),
            _post(D, h.completion(kv_transfer_params=_push_params(P, xb)), xb, timeout=2.0),
            return_exceptions=True,
        )

    p_reply, d_reply = asyncio.run(legs())
    assert p_reply.status == 200
    assert isinstance(d_reply, asyncio.TimeoutError)  # nothing but the client's own deadline ends it
    h.wait_until(lambda: D.counter("cancelled") == cancelled + 1, 20, what="abort on disconnect")
    assert P.stats()["pending_registrations"] >= 1  # D's registration is still waiting at P


def test_vllm_main_matches_push_legs_by_transfer_id(sims):
    """vLLM main pairs the legs by the router's transfer_id, whatever their request ids."""
    P, D = sims["Pmain"], sims["Dmain"]

    async def legs(p_xid: str, d_xid: str, p_tid: str, d_tid: str, timeout: float = 60.0):
        return await asyncio.gather(
            _post(P, h.completion(max_tokens=1, kv_transfer_params={**PREFILL, "transfer_id": p_tid}), p_xid),
            _post(D, h.completion(max_tokens=2, kv_transfer_params=_push_params(P, d_xid, transfer_id=d_tid)), d_xid, timeout),
            return_exceptions=True,
        )

    # different request ids, one transfer_id: they rendezvous
    xa, xb = uuid.uuid4().hex, uuid.uuid4().hex
    _, d_reply = asyncio.run(legs(xa, xb, "xfer-1", "xfer-1"))
    assert d_reply.json()["choices"][0]["text"] == " tok0 tok1"
    [push] = [e for e in P.events("push_done") if e["rid"].startswith(f"cmpl-{xb}-0")]
    assert push["matched_by"] == "transfer_id"

    # one request id, two transfer_ids (a retry's legs meeting a stale one): they never rendezvous
    xid = uuid.uuid4().hex
    _, d_reply = asyncio.run(legs(xid, xid, "xfer-2", "xfer-3", timeout=2.0))
    assert isinstance(d_reply, asyncio.TimeoutError)


def test_a_leg_aborted_while_its_registration_is_in_flight_ends_once(sims):
    """A push decode aborted (the router gave up its prefill) while its registration with that prefill is still
    in flight: the registration failing afterwards fails no load, as vLLM's scheduler no longer holds the request."""
    D = sims["D"]
    xid = uuid.uuid4().hex
    cancelled = D.counter("cancelled")

    async def aborted_mid_registration() -> None:
        arrived, held = asyncio.Event(), []

        async def silent_side_channel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # takes the registration in and never answers: a prefill that hangs, then dies
            arrived.set()

        server = await asyncio.start_server(silent_side_channel, h.HOST, 0)
        port = server.sockets[0].getsockname()[1]
        params = {**_push_params(sims["P"], xid), "remote_port": port, "pp_size": 1}
        leg = asyncio.create_task(_post(D, h.completion(max_tokens=2, kv_transfer_params=params), xid))
        try:
            await asyncio.wait_for(arrived.wait(), 20)
            leg.cancel()  # the router gives the pair up: vLLM aborts the decode request
            await asyncio.to_thread(h.wait_until, lambda: D.counter("cancelled") == cancelled + 1, 20, what="the abort")
        finally:
            for writer in held:
                writer.close()  # the side channel dies: the registration fails now
            server.close()
            await server.wait_closed()

    asyncio.run(aborted_mid_registration())
    h.wait_until(lambda: [e for e in D.events("transfer_failed_after_abort") if e["xid"] == xid], 20, what="the failed registration")
    assert not [e for e in D.events("kv_load_failed") if e["xid"] == xid]
    assert D.counter("cancelled") == cancelled + 1


def _waiting(sim: h.Sim) -> tuple[float, float, float]:
    """vllm:num_requests_waiting, and its reason="capacity" and reason="deferred" parts, summed over the engines."""
    text = h.http_get(sim.url + "/metrics")[1].decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    total = sum(s.value for s in samples if s.name == "vllm:num_requests_waiting")
    by = {r: sum(s.value for s in samples if s.name == "vllm:num_requests_waiting_by_reason" and s.labels["reason"] == r)
          for r in ("capacity", "deferred")}  # fmt: skip
    return total, by["capacity"], by["deferred"]


def test_a_decode_waiting_on_its_remote_kv_is_waiting_deferred_not_for_capacity(sims):
    """vLLM counts a request in WAITING_FOR_REMOTE_KVS in num_requests_waiting, as reason "deferred" of
    num_requests_waiting_by_reason: the simulator's decode whose prefill never comes reads so until it is aborted."""
    P, D = sims["P"], sims["Dwait"]
    assert _waiting(D) == (0.0, 0.0, 0.0)
    xid = uuid.uuid4().hex

    async def waiting_on_kv() -> None:
        leg = asyncio.create_task(_post(D, h.completion(max_tokens=2, kv_transfer_params=_push_params(P, xid)), xid))
        try:
            await asyncio.to_thread(h.wait_until, lambda: _waiting(D) == (1.0, 0.0, 1.0), 10.0, what="a decode waiting on its KV")
            assert not leg.done()
        finally:
            leg.cancel()  # the client goes: vLLM aborts the request

    asyncio.run(waiting_on_kv())
    h.wait_until(lambda: _waiting(D) == (0.0, 0.0, 0.0), 10.0, what="the aborted request gone from the gauges")


def test_push_decode_missing_a_key_kills_the_engine_then_its_server_exits(sims):
    """vLLM 0.33.0: KeyError in the engine core; /health 503; a new request 500 and the API server exits."""
    P, D = sims["P"], sims["Dkey"]
    xid = uuid.uuid4().hex
    params = _push_params(P, xid)
    del params["tp_size"]
    reply = asyncio.run(_post(D, h.completion(kv_transfer_params=params), xid))
    assert reply.status == 500 and reply.json()["error"]["type"] == "InternalServerError"
    assert D.stats()["dead"].startswith("KeyError")
    assert h.http_get(D.url + "/health")[0] == 503
    reply = asyncio.run(_post(D, h.completion(), uuid.uuid4().hex))
    assert reply.status == 500
    assert reply.json()["error"]["message"] == "The server had an error while processing your request."
    assert D.proc.popen.wait(30) == 1  # the API server exited: the port is closed
    assert not D.listening()


def test_missing_pp_size_defaults_to_one(sims):
    P, D = sims["P"], sims["D"]
    xid = uuid.uuid4().hex
    params = _push_params(P, xid)
    del params["pp_size"]

    async def legs():
        return await asyncio.gather(
            _post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), xid),
            _post(D, h.completion(max_tokens=2, kv_transfer_params=params), xid),
        )

    _, d_reply = asyncio.run(legs())
    assert d_reply.status == 200  # P has pp 2: with pp_size 1 assumed, D completes after too few notices
    assert d_reply.json()["choices"][0]["text"] == " ??0 ??1"


def test_push_registration_after_the_lease_never_completes(sims):
    """P frees the blocks when its lease ends; a registration after that finds nothing to match."""
    P, D = sims["Pshort"], sims["Dshort"]
    xid = uuid.uuid4().hex
    assert asyncio.run(_post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), xid)).status == 200
    h.wait_until(lambda: P.counter("expired") == 1, 20, what="lease expiry")
    reply = asyncio.run(_gather_one(_post(D, h.completion(kv_transfer_params=_push_params(P, xid)), xid, timeout=2.0)))
    assert isinstance(reply, asyncio.TimeoutError)
    assert P.stats()["pending_registrations"] == 1 and D.counter("kv_received") == 0


async def _gather_one(coro):
    [r] = await asyncio.gather(coro, return_exceptions=True)
    return r


def test_pull_wrong_protocol_and_expired_lease(sims):
    P, D = sims["Ppull"], sims["Dpull"]
    # push-style params to a pull decode (no block ids): it prefills itself, silently, and answers
    xid = uuid.uuid4().hex
    reply = asyncio.run(_post(D, h.completion(max_tokens=2, kv_transfer_params=_push_params(P, xid)), xid))
    assert reply.status == 200 and D.counter("recomputed") == 1 and D.counter("invalid_kv_params") == 0
    # block ids but no engine id: "Got invalid KVTransferParams", prefilled locally
    xid = uuid.uuid4().hex
    reply = asyncio.run(_post(D, h.completion(max_tokens=2, kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [0]}), xid))
    assert reply.status == 200 and D.counter("recomputed") == 2 and D.counter("invalid_kv_params") == 1

    # a read after P's lease ended still reads (NIXL READ is one-sided): D answers from freed blocks
    xid = uuid.uuid4().hex
    p_reply = asyncio.run(_post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), xid))
    params = p_reply.json()["kv_transfer_params"]
    h.wait_until(lambda: P.counter("expired") == 1, 20, what="lease expiry")
    reply = asyncio.run(_post(D, h.completion(max_tokens=2, kv_transfer_params=params), xid))
    assert reply.status == 200 and reply.json()["choices"][0]["text"] == " ??0 ??1"
    assert P.counter("notifications_after_expiry") == 1 and P.counter("reads") == 0

    # pull params to a push decode: it registers with the pull prefill, whose hash differs: load fails
    D = sims["D"]
    failures = D.counter("kv_load_failures")
    xid = uuid.uuid4().hex
    p_reply = asyncio.run(_post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), xid))
    reply = asyncio.run(_post(D, h.completion(kv_transfer_params=p_reply.json()["kv_transfer_params"]), xid))
    assert reply.status == 500 and reply.json()["error"]["message"] == "Internal server error"
    assert D.counter("kv_load_failures") == failures + 1


def test_heartbeats_extend_a_pull_lease_only_under_prefills_own_id(sims):
    """D reads 4.5 s after P finished, P's lease is 3 s. D heartbeats every step (3 // 6 = 0) and each one
    extends the lease to now + 3 * 2 // 3 = 2 s, but only for P's exact request id."""
    P, D = sims["Plong"], sims["Dslow"]
    p_xids = [uuid.uuid4().hex, uuid.uuid4().hex]

    async def both():
        prefills = await asyncio.gather(*(_post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), x) for x in p_xids))
        params = [r.json()["kv_transfer_params"] for r in prefills]
        suffixless = {**params[1], "remote_request_id": f"cmpl-{p_xids[1]}-0"}  # what a push router would send
        return await asyncio.gather(
            _post(D, h.completion(max_tokens=2, kv_transfer_params=params[0]), p_xids[0]),
            _post(D, h.completion(max_tokens=2, kv_transfer_params=suffixless), p_xids[1]),
        )

    kept, lost = asyncio.run(both())
    assert kept.json()["choices"][0]["text"] == " tok0 tok1"
    assert lost.json()["choices"][0]["text"] == " ??0 ??1"  # its lease ran out: D read freed blocks
    assert P.counter("leases_extended") >= 1 and D.counter("heartbeats_sent") >= 1
    assert P.counter("expired") == 1 and P.counter("notifications_after_expiry") == 1


def test_injected_faults(sims):
    P, D = sims["P"], sims["D"]
    D.control(fail_transfers=True)
    try:
        xid = uuid.uuid4().hex

        async def legs():
            return await asyncio.gather(
                _post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), xid),
                _post(D, h.completion(kv_transfer_params=_push_params(P, xid)), xid),
            )

        _, d_reply = asyncio.run(legs())
        assert d_reply.status == 500 and d_reply.json()["error"]["message"] == "Internal server error"
    finally:
        D.control(fail_transfers=False)
    P.control(unavailable=True)
    try:
        reply = asyncio.run(_post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), uuid.uuid4().hex))
        assert reply.status == 503 and reply.json()["error"]["type"] == "ServiceUnavailableError"
        assert h.http_get(P.url + "/health")[0] == 200  # a paused engine is alive
    finally:
        P.control(unavailable=False)
