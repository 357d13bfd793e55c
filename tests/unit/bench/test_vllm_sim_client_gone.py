"""A client that goes before its answer starts: the simulator aborts the request as vLLM does for a disconnect
(counted and recorded as cancelled, nothing of it kept), whether aiohttp cancels the handler or the handler finds
the connection closed when it writes the headers. The second happened in an e2e run: the router dropped a push
decode's leg while D was still taking the prompt in, and D logged an unhandled ClientConnectionResetError, the
request never counted as cancelled."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from aiohttp import web

from tests.fixtures.vllm_sim import sim_engine


async def _until(what: str, ready, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_a_client_gone_while_its_prompt_is_taken_in_is_a_cancelled_request(caplog: pytest.LogCaptureFixture) -> None:
    # 1 s of intake per 10 prompt tokens: the client closes while the API server still takes the prompt in.
    engine = sim_engine("decode", "push", "--intake-us-per-token", "100000")
    body = json.dumps({"model": "sim-model", "prompt": "a b c d e f g h i j", "max_tokens": 4, "stream": True}).encode()

    async def go() -> None:
        # Without handler cancellation (aiohttp's default) the handler always runs on after the client went and
        # meets the closed connection when it writes the answer's headers; the simulator's runner cancels, but
        # its handler can meet the closed connection before the cancellation arrives (the e2e run).
        runner = web.AppRunner(engine.http_app(), handler_cancellation=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = runner.addresses[0][1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
                         b"X-Request-Id: gone\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            await writer.drain()
            await _until("the leg received", lambda: any(e["kind"] == "leg_received" for e in engine.events))
            writer.close()
            await writer.wait_closed()
            await _until("the handler's end", lambda: not engine.inflight)
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.ERROR):
        asyncio.run(go())
    assert engine.counters["cancelled"] == 1
    assert [e["xid"] for e in engine.events if e["kind"] == "cancelled"] == ["gone"]
    assert not engine.by_rid
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
