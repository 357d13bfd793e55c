"""The router's HTTP surface: OpenAI-shaped 4xx for bad requests, graceful shutdown of in-flight streams."""

from __future__ import annotations

import asyncio
import pathlib
import signal
import sys

import aiohttp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from disagg_bench.vllm_sim import harness as h  # noqa: E402
from tests.fixtures.router import client_events  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("router-http")
    P = h.launch_sim(d, "prefill", "push")
    D = h.launch_sim(d, "decode", "push", tpot_ms=40.0)  # 40 ms per token: a 40-token stream lasts ~1.6 s
    static = d / "endpoints.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    R = h.launch_router(d, static, "push")
    try:
        h.wait_ready(P, D, R)
        yield P, D, R, d, static
    finally:
        h.stop_all(R, P, D)


@pytest.mark.parametrize(
    "raw,status,param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"prompt": "hi"}', 400, "model"),
        (b'{"model": 7, "prompt": "hi"}', 400, "model"),
        (b'{"model": "other-model", "prompt": "hi"}', 404, "model"),
        (b'{"model": "sim-model", "prompt": "hi", "stream": "yes"}', 400, "stream"),
    ],
    ids=["invalid-json", "not-an-object", "missing-model", "model-not-a-string", "unknown-model", "stream-not-bool"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_requests_get_openai_errors(env, path, raw, status, param):
    P, D, R, *_ = env
    before = P.counter("requests") + D.counter("requests")
    reply = asyncio.run(h.post(R.url + path, None, raw=raw))
    assert reply.status == status
    assert reply.headers["content-type"].startswith("application/json")
    err = reply.json()["error"]
    assert err["code"] == status and err["param"] == param and err["message"] and err["type"].endswith("Error")
    assert P.counter("requests") + D.counter("requests") == before  # never reached an engine


def test_engine_rejection_is_passed_through(env):
    P, D, R, *_ = env
    reply = asyncio.run(h.post(R.url + "/v1/completions", {"model": h.MODEL, "max_tokens": 3}))  # no prompt
    assert reply.status == 400
    assert reply.json()["error"]["message"] == "Field required: prompt"


def test_graceful_shutdown_finishes_in_flight_streams(env):
    P, D, _, d, static = env
    R = h.launch_router(d, static, "push", grace=30.0, name="router-shutdown")
    try:
        h.wait_ready(R)

        async def go():
            async with aiohttp.ClientSession() as s:
                resp = await s.post(R.url + "/v1/completions", json=h.completion(max_tokens=40, stream=True))
                assert resp.status == 200
                first = await resp.content.readany()
                assert first.startswith(b"data: ")
                R.proc.signal(signal.SIGTERM)  # mid-stream
                await asyncio.to_thread(h.wait_until, lambda: "shutting down" in R.proc.log_text(), 20, 0.05, "draining")
                rest = await resp.read()
                return resp.headers["X-Request-Id"], first + rest

        xid, body = asyncio.run(go())
        assert body.endswith(b"data: [DONE]\n\n")
        assert client_events(body) == client_events(D.body(xid))
        assert R.proc.popen.wait(30) == 0
        with pytest.raises(aiohttp.ClientConnectionError):  # no longer listening
            asyncio.run(h.post(R.url + "/v1/completions", h.completion(), timeout=5))
    finally:
        R.proc.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_time_per_output_token_of_a_stream(env, path):
    """The decode simulator streams one token every 40 ms: the router's TPOT histogram sees about that, per
    stream, and nothing for an answer that was not streamed."""
    _, _, R, *_ = env
    endpoint = "chat" if "chat" in path else "completions"
    body = h.chat(max_tokens=20, stream=True) if endpoint == "chat" else h.completion(max_tokens=20, stream=True)

    def observed() -> tuple[float, float]:
        labels = {"revision": "r1", "mode": "push"}
        count = R.metric("disagg_router_time_per_output_token_seconds_count", **labels) or 0.0
        return count, R.metric("disagg_router_time_per_output_token_seconds_sum", **labels) or 0.0

    count0, sum0 = observed()
    reply = asyncio.run(h.post(R.url + path, body))
    assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
    count1, sum1 = observed()
    assert count1 == count0 + 1
    assert 0.035 <= sum1 - sum0 <= 0.08, sum1 - sum0  # 40 ms a token, with room for a loaded machine
    unstreamed = {**body, "stream": False}
    assert asyncio.run(h.post(R.url + path, unstreamed)).status == 200
    assert observed() == (count1, sum1)
