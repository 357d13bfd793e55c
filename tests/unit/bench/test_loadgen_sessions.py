"""The load generator's multi-turn workload: seeded sessions whose prompts share one system prompt and grow
turn by turn, Poisson session arrivals and exponential think times, and the client that plays them (each turn
after the previous answer; a chat resending the answers it got), against a small in-process HTTP server that
records what it was sent."""

from __future__ import annotations

import asyncio
import json
import statistics
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from disagg_bench.localrun import loadgen
from disagg_bench.localrun.loadgen import MultiTurnWorkload, multi_turn_sessions

SHAPE = MultiTurnWorkload(session_rate=4.0, sessions=12, turns=5, system_tokens=64, user_tokens=16, answer_tokens=8, think_time=1.5)


def test_same_seeds_same_sessions() -> None:
    assert multi_turn_sessions(SHAPE, 1, 2) == multi_turn_sessions(SHAPE, 1, 2)
    assert multi_turn_sessions(SHAPE, 1, 2) != multi_turn_sessions(SHAPE, 3, 2)


def test_the_timing_seed_fixes_arrivals_and_think_times_and_the_content_seed_the_words() -> None:
    # every mode of a cell gets the same timing and its own words (engines shared by the modes keep caches)
    a, b = multi_turn_sessions(SHAPE, 7, 1), multi_turn_sessions(SHAPE, 7, 2)
    assert [s.arrival for s in a] == [s.arrival for s in b]
    assert [[t.think_before for t in s.turns] for s in a] == [[t.think_before for t in s.turns] for s in b]
    assert [[t.prompt_tokens for t in s.turns] for s in a] == [[t.prompt_tokens for t in s.turns] for s in b]
    assert a[0].turns[0].prompt.split()[:64] != b[0].turns[0].prompt.split()[:64]  # another system prompt
    assert all(x.turns[-1].prompt != y.turns[-1].prompt for x, y in zip(a, b))


def test_a_session_does_not_depend_on_how_many_sessions_there_are() -> None:
    short = multi_turn_sessions(SHAPE, 5, 6)
    longer = multi_turn_sessions(MultiTurnWorkload(**{**SHAPE.__dict__, "sessions": 30}), 5, 6)
    assert longer[: len(short)] == short


def test_every_turn_extends_the_previous_turn_of_its_session() -> None:
    for s in multi_turn_sessions(SHAPE, 0, 0):
        for prev, turn in zip(s.turns, s.turns[1:]):
            assert turn.prompt.startswith(prev.prompt + " ")
            added = turn.prompt[len(prev.prompt) + 1 :].split()
            assert len(added) == SHAPE.answer_tokens + SHAPE.user_tokens  # the answer's filler, then the new message
        assert [t.turn for t in s.turns] == list(range(SHAPE.turns))


def test_prompt_tokens_are_the_words_sent_and_follow_the_shape() -> None:
    for s in multi_turn_sessions(SHAPE, 0, 0):
        for t in s.turns:
            words = t.prompt.split()
            assert t.prompt_tokens == len(words) == SHAPE.prompt_tokens(t.turn)
            assert all(w[0] == "w" and 1 <= int(w[1:]) <= 151642 for w in words)  # the test tokenizer: a word is a token
    assert SHAPE.prompt_tokens(0) == 64 + 16 and SHAPE.prompt_tokens(3) == 64 + 3 * 24 + 16


def test_all_sessions_share_one_system_prompt_and_nothing_after_it() -> None:
    sessions = multi_turn_sessions(SHAPE, 0, 0)
    firsts = [s.turns[0].prompt.split() for s in sessions]
    assert len({tuple(f[: SHAPE.system_tokens]) for f in firsts}) == 1
    assert len({tuple(f[SHAPE.system_tokens :]) for f in firsts}) == len(sessions)  # each its own user message


def test_arrivals_are_poisson_and_think_times_exponential_with_the_given_means() -> None:
    w = MultiTurnWorkload(session_rate=5.0, sessions=4000, turns=3, system_tokens=1, user_tokens=1, answer_tokens=1, think_time=2.0)
    sessions = multi_turn_sessions(w, 11, 0)
    gaps = [b.arrival - a.arrival for a, b in zip(sessions, sessions[1:])]
    assert sessions[0].arrival == 0.0
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.07)  # exponential: CV 1
    thinks = [t.think_before for s in sessions for t in s.turns[1:]]
    assert all(t.think_before == 0.0 for s in sessions for t in s.turns[:1])  # the first turn follows the arrival
    assert statistics.mean(thinks) == pytest.approx(2.0, rel=0.05)
    assert statistics.stdev(thinks) / statistics.mean(thinks) == pytest.approx(1.0, rel=0.07)


def test_zero_think_time_sends_each_turn_right_after_the_answer() -> None:
    w = MultiTurnWorkload(**{**SHAPE.__dict__, "think_time": 0.0})
    assert {t.think_before for s in multi_turn_sessions(w, 0, 0) for t in s.turns} == {0.0}


@pytest.mark.parametrize("bad", [{"turns": 0}, {"sessions": 0}, {"user_tokens": -1}, {"think_time": -1.0}])
def test_shapes_that_cannot_run_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MultiTurnWorkload(**{**SHAPE.__dict__, **bad})


def test_the_ideal_hit_ratio_counts_what_one_engine_holding_everything_would_reuse() -> None:
    w = MultiTurnWorkload(1.0, sessions=2, turns=2, system_tokens=10, user_tokens=4, answer_tokens=2, think_time=0)
    # prompts 14 and 20 per session; session 0 reuses nothing at turn 0, 14 at turn 1; session 1 reuses 10 then 14
    assert w.ideal_hit_ratio() == pytest.approx((0 + 14 + 10 + 14) / (2 * (14 + 20)))
    # in blocks of 4 tokens: 0, 12, 8, 12
    assert w.ideal_hit_ratio(block_size=4) == pytest.approx((0 + 12 + 8 + 12) / 68)
    one = MultiTurnWorkload(1.0, sessions=1, turns=1, system_tokens=8, user_tokens=1, answer_tokens=1, think_time=0)
    assert one.ideal_hit_ratio() == 0.0


def test_records_and_deadline_follow_the_sessions() -> None:
    sessions = multi_turn_sessions(SHAPE, 0, 0)
    records = loadgen.session_records(sessions, "m", 64, 4.0)
    flat = [r for recs in records for r in recs]
    assert [r.index for r in flat] == list(range(SHAPE.sessions * SHAPE.turns))
    assert [(r.session, r.turn) for r in records[3]] == [(3, k) for k in range(SHAPE.turns)]
    assert [r.sent_prompt_tokens for r in records[3]] == [SHAPE.prompt_tokens(k) for k in range(SHAPE.turns)]
    s = sessions[3]
    assert records[3][-1].scheduled == pytest.approx(s.arrival + sum(t.think_before for t in s.turns))
    assert loadgen.session_deadline(sessions, 10.0) == pytest.approx(max(r.scheduled for r in flat) + 10.0)


# --- the client, against a server that records what it receives -----------------------------------------------
async def _recording_server(received: list[dict[str, Any]], fail_turn_of: set[int]) -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append({"prompt": body["prompt"], "at": asyncio.get_running_loop().time()})
        if len(body["prompt"].split()) in fail_turn_of:
            return web.json_response({"error": {"message": "no"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": f"x{len(received)}"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await resp.write(b"data: " + json.dumps({"choices": [{"text": f" t{i}"}]}).encode() + b"\n\n")
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": body["max_tokens"]}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        received[-1]["done"] = asyncio.get_running_loop().time()
        return resp

    return await _serving("/v1/completions", completions)


async def _serving(path: str, handler: Any) -> tuple[web.AppRunner, str]:
    """HANDLER serving POST PATH on a free local port: its runner (to clean up) and base URL."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_run_sessions_plays_each_session_in_order_after_each_answer() -> None:
    w = MultiTurnWorkload(session_rate=200.0, sessions=6, turns=3, system_tokens=20, user_tokens=5, answer_tokens=3, think_time=0.0)
    sessions = multi_turn_sessions(w, 1, 1)
    received: list[dict[str, Any]] = []

    async def main() -> list[loadgen.RequestRecord]:
        runner, url = await _recording_server(received, fail_turn_of={w.prompt_tokens(1)})
        try:
            async with aiohttp.ClientSession() as s:
                return await loadgen.run_sessions(s, loadgen.RouterTarget(url), sessions, mode="m", model="x", cell_tokens=20,
                                                  rate=200.0, max_tokens=3, drain_timeout=30)  # fmt: skip
        finally:
            await runner.cleanup()

    records = asyncio.run(main())
    assert len(records) == len(received) == 6 * 3  # a failed turn does not end its session
    by_prompt = {r["prompt"]: r for r in received}
    for s in sessions:
        turns = [by_prompt[t.prompt] for t in s.turns]
        for prev, nxt in zip(turns, turns[1:]):  # sent after the previous turn's answer (or its failure) came back
            assert nxt["at"] >= prev.get("done", prev["at"])
    ok = [r for r in records if r.ok]
    assert {(r.turn, r.ok) for r in records} == {(0, True), (1, False), (2, True)}
    assert all(r.usage_prompt_tokens == r.sent_prompt_tokens and r.output_tokens == 3 for r in ok)
    assert all(r.request_id and r.request_id.startswith("x") for r in ok)
    summary = loadgen.summarize(records, "multi-turn")
    assert (summary.workload, summary.sessions, summary.ok, summary.failed) == ("multi-turn", 6, 12, 6)


def test_a_chat_resends_the_answers_it_got_and_ends_at_a_failed_turn() -> None:
    w = MultiTurnWorkload(session_rate=200.0, sessions=4, turns=3, system_tokens=6, user_tokens=4, answer_tokens=2, think_time=0.0)
    sessions = multi_turn_sessions(w, 2, 3)
    failing = sessions[1].turns[1].message
    received: list[list[dict[str, str]]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body["messages"])
        if body["messages"][-1]["content"] == failing:
            return web.json_response({"error": {"message": "no"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": f"x{len(received)}"})
        await resp.prepare(request)
        for piece in (f"answer{len(received)}", " to", f" {body['messages'][-1]['content'].split()[0]}"):
            await resp.write(b"data: " + json.dumps({"choices": [{"delta": {"content": piece}}]}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> list[loadgen.RequestRecord]:
        runner, url = await _serving("/v1/chat/completions", chat)
        try:
            async with aiohttp.ClientSession() as s:
                return await loadgen.run_sessions(s, loadgen.RouterTarget(url), sessions, mode="chat", model="x", cell_tokens=0,
                                                  rate=200.0, max_tokens=3, drain_timeout=30, api="chat")  # fmt: skip
        finally:
            await runner.cleanup()

    records = asyncio.run(main())
    by_turn = {(r.session, r.turn): r for r in records}
    for s in sessions:
        for t in s.turns[1:]:
            if not by_turn[(s.index, t.turn - 1)].ok:
                continue
            sent = next(m for m in received if m[-1]["content"] == t.message)
            # the system prompt, then each earlier message with the very answer streamed back for it
            expected = [{"role": "system", "content": s.system}]
            for before in s.turns[: t.turn]:
                expected += [{"role": "user", "content": before.message}, {"role": "assistant", "content": by_turn[(s.index, before.turn)].answer}]
            assert sent == expected + [{"role": "user", "content": t.message}]
    assert all(r.ok and r.answer and r.answer.startswith("answer") for r in records if r.session != 1)
    assert [(r.turn, r.error) for r in records if r.session == 1] == [(0, None), (1, "HTTP 500: " + json.dumps({"error": {"message": "no"}})), (2, "unfinished")]
    assert len(received) == 4 * 3 - 1  # the failed turn ended its chat: nothing left to resend


def test_a_chat_of_token_ids_is_refused() -> None:
    sessions = multi_turn_sessions(SHAPE, 1, 1)
    with pytest.raises(ValueError, match="prompt_format must be 'text'"):
        asyncio.run(loadgen.run_sessions(None, loadgen.RouterTarget("http://127.0.0.1:9"), sessions, mode="m", model="x",  # type: ignore[arg-type]
                                         cell_tokens=0, rate=1.0, max_tokens=1, drain_timeout=1, prompt_format="token-ids", api="chat"))  # fmt: skip
