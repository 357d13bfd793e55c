"""Nothing hangs: a prefill that dies mid-request, a wrong or missing identity, an expired lease.

Each case ends in a deadline, a retry on another pair with a fresh id, or a clean 5xx in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import pathlib
import signal
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.vllm_sim import harness as h  # noqa: E402

SLOW_PREFILL = {"prefill_us_per_token": 5000.0}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("router-failures")


def _error(reply: h.Reply, status: int) -> dict:
    assert reply.status == status, reply.body
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_prefill_dies_mid_request_retries_on_another_pair(log_dir):
    P1 = h.launch_sim(log_dir, "prefill", "push", **SLOW_PREFILL)
    P2 = h.launch_sim(log_dir, "prefill", "push", **SLOW_PREFILL)
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "dies.json"
    h.write_static(static, [P1.static_entry(), P2.static_entry(), D.static_entry()])
    only_p1 = log_dir / "dies-only-p1.json"
    h.write_static(only_p1, [P1.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", max_retries=1, name="router-dies")
    R0 = h.launch_router(log_dir, only_p1, "push", max_retries=0, name="router-dies-noretry")
    try:
        h.wait_ready(P1, P2, D, R, R0)

        async def go():
            task = asyncio.create_task(h.post(R.url + "/v1/completions", h.completion(prompt_words=400, max_tokens=3, stream=True)))
            victim = await asyncio.to_thread(
                h.wait_until,
                lambda: next((p for p in (P1, P2) if p.counter("requests") == 1 and p.events("prefill_start")), None),
                30,
                0.02,
                "a prefill in progress",
            )
            victim.proc.signal(signal.SIGKILL)  # the prefill engine dies while computing
            return victim, await task

        victim, reply = asyncio.run(go())
        survivor = P2 if victim is P1 else P1
        assert reply.status == 200, reply.body
        assert reply.body.endswith(b"data: [DONE]\n\n")
        # served by the other pair with a fresh id; the first id died with its prefill
        assert [e["xid"] for e in survivor.events("leg_received")] == [reply.xid]
        decode_legs = D.events("leg_received")
        decode_ids = [e["xid"] for e in decode_legs]
        assert len(decode_ids) == 2 and decode_ids[-1] == reply.xid and decode_ids[0] != reply.xid
        # each dispatch minted its own transfer_id, the same on both of its legs (the victim's log died with it)
        first_tid, retry_tid = (e["kv_transfer_params"]["transfer_id"] for e in decode_legs)
        assert first_tid != retry_tid
        assert survivor.events("leg_received")[0]["kv_transfer_params"]["transfer_id"] == retry_tid
        h.wait_until(lambda: D.counter("cancelled") == 1, 20, what="abandoned decode leg cancelled")
        assert 'disagg_router_retries_total{mode="push"} 1.0' in R.metrics()

        # Without retries and with only the dead prefill engine left: a clean error, not a hang.
        if victim is P1:
            reply = asyncio.run(h.post(R0.url + "/v1/completions", h.completion()))
            _error(reply, 502)
    finally:
        h.stop_all(R, R0, P1, P2, D)


def test_wrong_identity_is_a_clean_error(log_dir):
    """The router's table has a stale engine id for P (e.g. P restarted): D's handshake is refused."""
    P = h.launch_sim(log_dir, "prefill", "push")
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "stale.json"
    h.write_static(static, [P.static_entry(engine_id="stale-incarnation"), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", max_retries=1, name="router-stale")
    try:
        h.wait_ready(P, D, R)
        for stream in (False, True):
            reply = asyncio.run(h.post(R.url + "/v1/completions", h.completion(stream=stream)))
            err = _error(reply, 502)
            assert "decode" in err["message"]
        assert P.counter("handshake_failures") == 4  # two attempts per request, each with a fresh id
        assert D.counter("kv_load_failures") == 4
        assert D.stats()["waiting_for_kv"] == 0
    finally:
        h.stop_all(R, P, D)


def test_wrong_tp_size_never_completes_until_the_deadline(log_dir):
    """tp_size too large: D waits for notices P never sends. The router's leg deadline ends it."""
    P = h.launch_sim(log_dir, "prefill", "push")
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "tp.json"
    h.write_static(static, [P.static_entry(tp_size=2), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", max_retries=1, leg_timeout=2.0, name="router-tp")
    try:
        h.wait_ready(P, D, R)
        reply = asyncio.run(h.post(R.url + "/v1/completions", h.completion(stream=True)))
        _error(reply, 504)
        assert P.counter("pushes") == 2 and D.counter("kv_received") == 0
        h.wait_until(lambda: D.counter("cancelled") == 2, 20, what="both decode legs cancelled")
        assert 'cause="decode_timeout"' in R.metrics()
    finally:
        h.stop_all(R, P, D)


def test_expired_lease_never_completes_until_the_deadline(log_dir):
    """Legs sent one after the other with a lease shorter than the gap: P frees the blocks first."""
    P = h.launch_sim(log_dir, "prefill", "push", lease_seconds=0.001)
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "lease.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, "push-sequential", max_retries=0, leg_timeout=2.0, name="router-lease")
    try:
        h.wait_ready(P, D, R)
        reply = asyncio.run(h.post(R.url + "/v1/chat/completions", h.chat(stream=True)))
        _error(reply, 504)
        h.wait_until(lambda: P.counter("expired") == 1, 10, what="expiry")
        assert P.stats()["pending_registrations"] == 1  # the late registration found nothing to match
        h.wait_until(lambda: D.counter("cancelled") == 1, 20, what="decode leg cancelled")
    finally:
        h.stop_all(R, P, D)


def test_no_pair_is_503(log_dir):
    P = h.launch_sim(log_dir, "prefill", "push")
    static = log_dir / "half.json"
    h.write_static(static, [P.static_entry()])
    R = h.launch_router(log_dir, static, "push", name="router-half")
    try:
        h.wait_ready(P, R)
        _error(asyncio.run(h.post(R.url + "/v1/completions", h.completion())), 503)
        assert P.counter("requests") == 0
    finally:
        h.stop_all(R, P)
