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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.vllm_sim import harness as h  # noqa: E402


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-sim")
    s = {
        "P": h.launch_sim(d, "prefill", "push", pp=2),
        "D": h.launch_sim(d, "decode", "push"),
        "Pmain": h.launch_sim(d, "prefill", "push", extra=["--push-match", "transfer-id"]),
        "Dmain": h.launch_sim(d, "decode", "push", extra=["--push-match", "transfer-id"]),
        "Dkey": h.launch_sim(d, "decode", "push"),
        "Ppull": h.launch_sim(d, "prefill", "pull", lease_seconds=0.5),
        "Dpull": h.launch_sim(d, "decode", "pull"),
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


def test_push_decode_missing_a_key_kills_the_engine(sims):
    P, D = sims["P"], sims["Dkey"]
    xid = uuid.uuid4().hex
    params = _push_params(P, xid)
    del params["tp_size"]
    reply = asyncio.run(_post(D, h.completion(kv_transfer_params=params), xid))
    assert reply.status == 500 and reply.json()["error"]["type"] == "InternalServerError"
    assert D.stats()["dead"].startswith("KeyError")
    assert h.http_get(D.url + "/health")[0] == 500
    assert asyncio.run(_post(D, h.completion(), uuid.uuid4().hex)).status == 500


def test_pull_invalid_params_recompute_and_expired_lease_fails(sims):
    P, D = sims["Ppull"], sims["Dpull"]
    xid = uuid.uuid4().hex
    reply = asyncio.run(_post(D, h.completion(max_tokens=2, kv_transfer_params={"do_remote_prefill": True}), xid))
    assert reply.status == 200 and D.counter("recomputed") == 1 and D.counter("invalid_kv_params") == 1

    xid = uuid.uuid4().hex
    p_reply = asyncio.run(_post(P, h.completion(max_tokens=1, kv_transfer_params=PREFILL), xid))
    params = p_reply.json()["kv_transfer_params"]
    h.wait_until(lambda: P.counter("expired") == 1, 20, what="lease expiry")
    reply = asyncio.run(_post(D, h.completion(kv_transfer_params=params), xid))
    assert reply.status == 500 and reply.json()["error"]["message"] == "Internal server error"
    assert P.counter("reads_of_freed_blocks") == 1
