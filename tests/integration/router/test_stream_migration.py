"""Stream migration against simulated engines in separate processes (docs/router.md, "Failures and stream
migration"): a decode engine killed with streams in flight cuts none of them. The simulator's tokens are a function
of the token-id prefix (greedy), so a continued stream is compared token for token with an uncrashed run of the
same request."""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import signal
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from disagg_bench.vllm_sim import harness as h  # noqa: E402

STREAMS = 32
MAX_TOKENS = 80
TPOT_MS = 20.0  # 80 tokens: a 1.6 s stream


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("stream-migration")


def _requests() -> list[tuple[str, dict]]:
    """Both APIs, streamed (half of them asking for usage) and not, prompts of different lengths."""
    out = []
    for i in range(STREAMS):
        kind = "chat" if i % 2 else "completions"
        stream = i % 8 != 7
        extra = {"stream_options": {"include_usage": True}} if stream and i % 4 < 2 else {}
        words = 40 + 7 * i
        body = (h.chat(words=words, max_tokens=MAX_TOKENS, stream=stream, **extra) if kind == "chat"
                else h.completion(prompt_words=words, max_tokens=MAX_TOKENS, stream=stream, **extra))  # fmt: skip
        body["temperature"] = 0
        out.append((kind, body))
    return out


def _answer(kind: str, reply: h.Reply) -> dict:
    """What the client got: its text, usage, the response ids it saw, and how the stream ended."""
    assert reply.status == 200, reply.body
    if not reply.headers["content-type"].startswith("text/event-stream"):
        doc = reply.json()
        c = doc["choices"][0]
        return {"text": c["text"] if kind == "completions" else c["message"]["content"], "usage": doc["usage"], "ids": {doc["id"]}, "done": 0}
    # SSE comments (the router's keepalive while a stream waits for a pair) are not events: clients skip them
    events = [e for e in reply.body.split(b"\n\n") if e and not e.startswith(b":")]
    done = sum(e == b"data: [DONE]" for e in events)
    assert events[-1] == b"data: [DONE]", events[-3:]
    objs = [json.loads(e[6:]) for e in events if e != b"data: [DONE]"]
    assert not [o for o in objs if "error" in o]
    text = "".join((c.get("text") or "") if kind == "completions" else (c["delta"].get("content") or "") for o in objs for c in o["choices"])
    usage = [o["usage"] for o in objs if o.get("usage")]
    waited = reply.body.count(b"\n\n: waiting for an engine to continue this stream\n\n")
    return {"text": text, "usage": usage, "ids": {o["id"] for o in objs}, "done": done, "waited": waited}


def _migrations(R: h.Router) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for line in R.metrics().splitlines():
        if line.startswith("disagg_router_migrations_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1 : line.index("}")].replace('"', "").split(","))
            out[(labels["cause"], labels["outcome"])] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_decode_killed_with_streams_in_flight_cuts_none(log_dir, mode):
    P = h.launch_sim(log_dir, "prefill", mode)
    D1 = h.launch_sim(log_dir, "decode", mode, tpot_ms=TPOT_MS)
    D2 = h.launch_sim(log_dir, "decode", mode, tpot_ms=TPOT_MS)
    static = log_dir / f"{mode}.json"
    h.write_static(static, [P.static_entry(), D1.static_entry(), D2.static_entry()])
    R = h.launch_router(log_dir, static, mode, name=f"router-{mode}")
    requests = _requests()
    try:
        h.wait_ready(P, D1, D2, R)

        async def run(kill: bool) -> list[h.Reply]:
            rng = random.Random(7)

            async def one(body: dict) -> h.Reply:
                await asyncio.sleep(rng.uniform(0, 0.8))  # staggered: the kill finds streams at random positions
                return await h.post(R.url + ("/v1/chat/completions" if "messages" in body else "/v1/completions"), body)

            tasks = [asyncio.create_task(one(body)) for _, body in requests]
            if kill:
                before = len(D1.events("first_token"))
                await asyncio.to_thread(h.wait_until, lambda: len(D1.events("first_token")) >= before + 8, 30, 0.02, "8 streams on D1")
                D1.proc.signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

        uncrashed = asyncio.run(run(kill=False))
        crashed = asyncio.run(run(kill=True))
        for (kind, body), a, b in zip(requests, uncrashed, crashed):
            want, got = _answer(kind, a), _answer(kind, b)
            assert got["text"] == want["text"] == "".join(f" tok{i}" for i in range(MAX_TOKENS))
            assert got["usage"] == want["usage"]  # prompt tokens: the client's prompt; completion tokens: all it got
            assert len(got["ids"]) == 1 and got["done"] == want["done"] == body["stream"]
        migrations = _migrations(R)
        migrated = migrations.get(("decode_stream_broken", "migrated"), 0)
        assert migrated >= 1 and set(migrations) == {("decode_stream_broken", "migrated")}, migrations
        # every continuation went to the survivor, as a completions request on the token ids of what was sent
        continued = [e for e in D2.events("leg_received") if e["max_tokens"] < MAX_TOKENS]
        assert len(continued) == migrated and {e["endpoint"] for e in continued} == {"completions"}
    finally:
        h.stop_all(R, P, D1, D2)


def test_a_decode_group_that_loses_a_pod_fails_whole_and_its_streams_move_to_the_survivors(log_dir):
    """A two-pod decode engine (expert/data parallel over an LWS group): killing its worker pod's engine stops the
    leader's too (their collectives), and every stream on either pod is continued on the two one-pod decodes left,
    spread over both, token for token as an uncrashed run."""
    side = h.free_port_block(2)
    leader = h.launch_sim(log_dir, "decode", "push", name="g-decode-0", dp=2, group=("m-decode-r1", 0, 0), dp_local=1,
                          side_port=side, tpot_ms=TPOT_MS)  # fmt: skip
    worker = h.launch_sim(log_dir, "decode", "push", name="g-decode-0-1", dp=2, group=("m-decode-r1", 0, 1), dp_local=1,
                          side_port=side, group_leader=leader, tpot_ms=TPOT_MS)  # fmt: skip
    P = h.launch_sim(log_dir, "prefill", "push")
    survivors = [h.launch_sim(log_dir, "decode", "push", tpot_ms=TPOT_MS) for _ in range(2)]
    static = log_dir / "group.json"
    h.write_static(static, [P.static_entry(), leader.static_entry(), worker.static_entry(), *(s.static_entry() for s in survivors)])
    R = h.launch_router(log_dir, static, "push", name="router-group")
    requests = [(kind, {**body, "stream": True}) for kind, body in _requests()]
    try:
        h.wait_ready(leader, worker, P, *survivors, R)
        h.wait_until(lambda: leader.events("group_joined"), 30, what="the worker joined its leader")

        async def run() -> list[h.Reply]:
            async def one(kind: str, body: dict) -> h.Reply:
                return await h.post(R.url + ("/v1/chat/completions" if kind == "chat" else "/v1/completions"), body)

            tasks = [asyncio.create_task(one(kind, body)) for kind, body in requests]
            await asyncio.to_thread(
                h.wait_until, lambda: all(len(s.events("first_token")) >= 3 for s in (leader, worker)), 30, 0.02, "streams on both pods"
            )  # fmt: skip
            worker.proc.signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

        replies = asyncio.run(run())
        for (kind, _), reply in zip(requests, replies):
            got = _answer(kind, reply)
            assert got["text"] == "".join(f" tok{i}" for i in range(MAX_TOKENS)) and got["done"] == 1
        # the leader's engine died with its worker (then its API server exited, as vLLM's does)
        assert leader.proc.popen.wait(30) == 1 and "a collective of the engine's group failed" in leader.proc.log_text()
        continued = {s.name: [e for e in s.events("leg_received") if e["max_tokens"] < MAX_TOKENS] for s in survivors}
        migrated = _migrations(R).get(("decode_stream_broken", "migrated"), 0)
        assert sum(map(len, continued.values())) == migrated >= 6  # at least the 3 streams seen on each pod
        assert all(continued.values()), {k: len(v) for k, v in continued.items()}  # spread over both survivors
    finally:
        h.stop_all(R, P, leader, worker, *survivors)


def test_streams_whose_only_decode_died_wait_for_it_to_restart_and_go_on(log_dir):
    """The herd with nowhere to go: the model's only decode engine dies with every stream on it. The streams wait in
    the router (a keepalive comment to each client) instead of failing; when the engine's container restarts (same
    pod, a new engine: ejected, then admitted again) each goes on there, token for token."""
    P = h.launch_sim(log_dir, "prefill", "push")
    D = h.launch_sim(log_dir, "decode", "push", tpot_ms=TPOT_MS)
    static = log_dir / "only-decode.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", name="router-only-decode")
    streams = 8
    requests = [(kind, {**body, "stream": True}) for kind, body in _requests()[:streams]]
    try:
        h.wait_ready(P, D, R)

        async def run() -> list[h.Reply]:
            async def one(kind: str, body: dict) -> h.Reply:
                return await h.post(R.url + ("/v1/chat/completions" if kind == "chat" else "/v1/completions"), body)

            tasks = [asyncio.create_task(one(kind, body)) for kind, body in requests]
            await asyncio.to_thread(h.wait_until, lambda: len(D.events("first_token")) >= streams, 30, 0.02, "every stream's first token")
            D.proc.signal(signal.SIGKILL)
            waiting = lambda: R.metric("disagg_router_migrations_waiting")  # noqa: E731
            await asyncio.to_thread(h.wait_until, lambda: waiting() == streams, 30, 0.05, f"{streams} streams waiting in the router")
            assert not any(t.done() for t in tasks)  # none ended while its engine was gone
            await asyncio.to_thread(D.proc.popen.wait, 10)
            D.restart()
            return await asyncio.gather(*tasks)

        replies = asyncio.run(run())
        for (kind, _), reply in zip(requests, replies):
            got = _answer(kind, reply)
            assert got["text"] == "".join(f" tok{i}" for i in range(MAX_TOKENS)) and got["done"] == 1
            assert got["waited"] >= 1 and len(got["ids"]) == 1
        assert _migrations(R) == {("decode_stream_broken", "migrated"): streams}
        assert R.metric("disagg_router_migrations_waiting") == 0
        continued = [e for e in D.events("leg_received") if e["max_tokens"] < MAX_TOKENS]  # the restarted engine's
        assert len(continued) == streams
    finally:
        h.stop_all(R, P, D)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_prefill_that_dies_after_the_decodes_first_token_breaks_no_stream(log_dir, mode):
    """Prefill-side faults after the first token are not the stream's: its KV is the decode's by then (pull: read;
    push: written), so the stream goes on, whole, and nothing is migrated."""
    P = h.launch_sim(log_dir, "prefill", mode)
    D = h.launch_sim(log_dir, "decode", mode, tpot_ms=TPOT_MS)
    static = log_dir / f"prefill-dies-{mode}.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, mode, name=f"router-prefill-dies-{mode}")
    try:
        h.wait_ready(P, D, R)

        async def run() -> h.Reply:
            task = asyncio.create_task(h.post(R.url + "/v1/completions", h.completion(prompt_words=200, max_tokens=MAX_TOKENS, stream=True)))
            await asyncio.to_thread(h.wait_until, lambda: D.events("first_token"), 30, 0.02, "the decode's first token")
            P.proc.signal(signal.SIGKILL)
            return await task

        got = _answer("completions", asyncio.run(run()))
        assert got["text"] == "".join(f" tok{i}" for i in range(MAX_TOKENS)) and got["done"] == 1
        assert not _migrations(R).get(("decode_stream_broken", "migrated")), _migrations(R)
    finally:
        h.stop_all(R, P, D)
