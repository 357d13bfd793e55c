"""Router in pull mode: prefill first, then decode with P's kv_transfer_params verbatim."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from disagg_bench.vllm_sim import harness as h  # noqa: E402
from tests.fixtures.router import client_events  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("router-pull")
    P = h.launch_sim(d, "prefill", "pull", tp=2)
    D1 = h.launch_sim(d, "decode", "pull")
    D2 = h.launch_sim(d, "decode", "pull")
    static = d / "endpoints.json"
    h.write_static(static, [P.static_entry(), D1.static_entry(), D2.static_entry()])
    R = h.launch_router(d, static, "pull")
    try:
        h.wait_ready(P, D1, D2, R)
        yield P, D1, D2, R
    finally:
        h.stop_all(R, P, D1, D2)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_pull_is_sequential_with_params_verbatim(env, kind, stream):
    P, D1, D2, R = env
    path, body = (
        ("/v1/completions", h.completion(max_tokens=3, stream=stream, min_tokens=2, stream_options={"include_usage": True}))
        if kind == "completions"
        else ("/v1/chat/completions", h.chat(max_tokens=3, max_completion_tokens=3, stream=stream))
    )
    if not stream:
        body.pop("stream_options", None)
    reply = asyncio.run(h.post(R.url + path, body))
    assert reply.status == 200, reply.body
    xid = reply.xid

    [p_leg] = [e for e in P.events("leg_received") if e["xid"] == xid]
    assert p_leg["stream"] is False and p_leg["max_tokens"] == 1
    assert p_leg["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": f"xfer-{xid}",
    }
    returned = json.loads(P.body(xid))["kv_transfer_params"]
    assert returned["transfer_mode"] == "pull" and returned["tp_size"] == 2

    # The decode leg carries exactly what P returned (and the dispatch's transfer_id); it can only have
    # been sent after P answered, since it contains P's internal request id (with P's random suffix).
    d_legs = [e for D in (D1, D2) for e in D.events("leg_received") if e["xid"] == xid]
    assert len(d_legs) == 1
    assert "transfer_id" not in returned
    assert d_legs[0]["kv_transfer_params"] == {**returned, "transfer_id": f"xfer-{xid}"}
    assert returned["remote_request_id"].startswith(("cmpl-" if kind == "completions" else "chatcmpl-") + xid + "-")
    D = D1 if any(e["xid"] == xid for e in D1.events("leg_received")) else D2
    if stream:  # event for event, less the token ids the router asked for (stream migration) and took out again
        assert client_events(reply.body) == client_events(D.body(xid)) and b"token_ids" not in reply.body
    else:
        assert reply.body == D.body(xid)
    assert D.counter("invalid_kv_params") == 0 and D.counter("kv_load_failures") == 0


def test_pull_decode_is_chosen_by_load(env):
    P, D1, D2, R = env
    before = D1.counter("requests"), D2.counter("requests")

    async def many():
        return await asyncio.gather(*(h.post(R.url + "/v1/completions", h.completion(max_tokens=20)) for _ in range(6)))

    assert [r.status for r in asyncio.run(many())] == [200] * 6
    after = D1.counter("requests"), D2.counter("requests")
    assert after[0] > before[0] and after[1] > before[1]
    assert P.counter("reads") == P.counter("prefills")  # every prefill was read by a decode
