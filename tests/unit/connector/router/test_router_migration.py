"""Stream migration's pure part (router/migration.py): what a request allows, what the relay learns from the events it
passes on, the continuation's body, and the continuation's events as the client gets them."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg_connector.router.migration import REFUSALS, Trail, continuation_body, decode_leg_body, end_event, refusal
from disagg_connector.router.pairing import Comeback, Ejections

from tests.fixtures.router import sse, vllm_stream

PROMPT = [11, 12, 13]
TOKENS = [(" a", 101), (" b", 102), (" c", 103), (" d", 104)]


# One token event of vLLM 0.26.0's completions stream as its pydantic model writes it
# (CompletionStreamResponse(...).model_dump_json(exclude_unset=True)): compact JSON, UTF-8 as is.
VLLM_TOKEN_EVENT = (b'data: {"id":"cmpl-1","created":1,"model":"m","choices":[{"index":0,"text":" a\\"\xc3\xa9","logprobs":null,'
                    b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[5]}]}\n\n')  # fmt: skip
# Texts that look like the fields the relay reads on an event's bytes.
LOOKALIKES = ['","token_ids":[9]', '"token_ids":[1, 2]', '"finish_reason":null', '"finish_reason":"stop"', '"usage":{"x":1}',
              '"delta":{"content":"x"}', "\\", '\\"', "é€😀", ",", '"}']  # fmt: skip


def _events(data: bytes) -> list[object]:
    return [e[6:].decode() if e == b"data: [DONE]" else json.loads(e[6:]) for e in data.split(b"\n\n") if e]


@pytest.mark.parametrize(
    ("kind", "body", "why"),
    [
        ("completions", {"prompt": "x"}, None),
        ("chat", {"messages": [], "temperature": 0, "seed": 7}, None),  # greedy: the seed draws nothing
        ("completions", {"prompt": "x", "n": 2}, "n"),
        ("completions", {"prompt": "x", "best_of": 3}, "n"),
        ("completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
        ("chat", {"messages": [], "logprobs": True, "top_logprobs": 2}, "logprobs"),
        ("chat", {"messages": [], "response_format": {"type": "json_object"}}, "structured_output"),
        ("chat", {"messages": [], "response_format": {"type": "text"}}, None),
        ("completions", {"prompt": "x", "structured_outputs": {"regex": "a+"}}, "structured_output"),
        ("chat", {"messages": [], "tools": [{"type": "function"}]}, "tools"),
        ("chat", {"messages": [], "tools": [{"type": "function"}], "tool_choice": "none"}, None),
        ("completions", {"prompt": "x", "seed": 3}, "seed"),
        ("completions", {"prompt": ["one", "two"]}, "several_prompts"),
        ("completions", {"prompt": [1, 2, 3]}, None),
        ("completions", {"prompt": "x", "echo": True}, "echo"),
    ],
)
def test_refusal_names_what_a_continuation_could_not_carry(kind, body, why):
    assert refusal(kind, body) == why
    assert why is None or why in REFUSALS


def test_decode_leg_asks_for_token_ids_without_touching_the_clients_body():
    body = {"prompt": "x"}
    assert decode_leg_body(body) == {"prompt": "x", "return_token_ids": True} and body == {"prompt": "x"}
    own = {"prompt": "x", "return_token_ids": True}
    assert decode_leg_body(own) is own


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_trail_learns_the_ids_and_gives_the_client_the_events_without_them(kind):
    trail = Trail(kind, keep_ids=False)
    data = sse(*vllm_stream(kind, PROMPT, TOKENS, finish=False))
    out = b"".join(trail.feed(data[i : i + 7]) for i in range(0, len(data), 7))  # events split across reads
    assert trail.prompt_ids == PROMPT and trail.generated == [101, 102, 103, 104]
    assert trail.why_not() is None and not trail.finished and not trail.done
    expected = vllm_stream(kind, PROMPT, TOKENS, ids=False, finish=False)
    for e in expected:
        e.pop("prompt_token_ids", None)
        for c in e["choices"]:
            c.pop("prompt_token_ids", None), c.pop("token_ids", None)
    assert _events(out) == expected


def test_a_plain_token_event_reaches_the_client_as_vllm_wrote_it_less_the_ids():
    trail = Trail("completions", keep_ids=False)
    trail.feed(sse(*vllm_stream("completions", PROMPT, TOKENS[:1], finish=False)))
    assert trail.feed(VLLM_TOKEN_EVENT) == VLLM_TOKEN_EVENT.replace(b',"prompt_token_ids":null,"token_ids":[5]', b"")
    assert trail.generated == [101, 5] and not trail.finished


@given(texts=st.lists(st.one_of(st.text(), st.sampled_from(LOOKALIKES)), min_size=1, max_size=6),
       kind=st.sampled_from(["completions", "chat"]), keep_ids=st.booleans())  # fmt: skip
def test_trail_reads_every_event_alike_whatever_its_text(texts, kind, keep_ids):
    tokens = [(text, 200 + n) for n, text in enumerate(texts)]
    events = vllm_stream(kind, PROMPT, tokens, usage=True)
    trail = Trail(kind, keep_ids=keep_ids)
    out = trail.feed(sse(*events, "[DONE]"))
    assert (trail.prompt_ids, trail.generated) == (PROMPT, [tid for _, tid in tokens])
    assert trail.finished and trail.usage_sent and trail.done and trail.why_not() is None
    expected = copy.deepcopy(events)
    if not keep_ids:
        for e in expected:
            e.pop("prompt_token_ids", None)
            for c in e["choices"]:
                c.pop("prompt_token_ids", None), c.pop("token_ids", None)
    assert _events(out) == [*expected, "[DONE]"]


def test_trail_keeps_the_ids_a_client_asked_for():
    trail = Trail("completions", keep_ids=True)
    events = vllm_stream("completions", PROMPT, TOKENS, finish=False)
    assert _events(trail.feed(sse(*events))) == events


def test_trail_without_ids_cannot_be_continued():
    trail = Trail("completions", keep_ids=False)
    trail.feed(sse(*vllm_stream("completions", PROMPT, TOKENS[:2], ids=False, finish=False)))
    assert trail.why_not() == "no_token_ids"


def test_a_reasoning_delta_rules_a_chat_continuation_out():
    trail = Trail("chat", keep_ids=False)
    events = vllm_stream("chat", PROMPT, TOKENS[:2], finish=False)
    events[1]["choices"][0]["delta"] = {"reasoning_content": "hmm"}
    trail.feed(sse(*events))
    assert trail.why_not() == "parsed_delta"


def test_the_engines_error_and_its_done_are_held_back():
    trail = Trail("completions", keep_ids=False)
    out = trail.feed(sse(*vllm_stream("completions", PROMPT, TOKENS[:2], finish=False), {"error": {"message": "boom", "code": 500}}, "[DONE]"))
    assert b"error" not in out and b"[DONE]" not in out
    assert trail.error == {"error": {"message": "boom", "code": 500}} and not trail.done


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuation_body_is_the_prompt_and_every_token_sent_as_ids(kind):
    body = {"model": "m", "stream": True, "temperature": 0, "stream_options": {"include_usage": True}, "min_tokens": 3}
    body |= {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10, "tools": []} if kind == "chat" else {"prompt": "hi", "max_tokens": 10}
    trail = Trail(kind, keep_ids=False)
    trail.feed(sse(*vllm_stream(kind, PROMPT, TOKENS, finish=False)))
    cont = continuation_body(kind, body, trail)
    assert cont is not None
    assert cont["prompt"] == [*PROMPT, 101, 102, 103, 104] and cont["max_tokens"] == 6 and cont["min_tokens"] == 0
    assert cont["return_token_ids"] is True and cont["stream"] is True and cont["echo"] is False
    assert cont["temperature"] == 0 and cont["stream_options"] == {"include_usage": True}
    assert not {"messages", "max_completion_tokens", "tools"} & set(cont)


def test_nothing_is_left_to_continue_once_max_tokens_is_out():
    trail = Trail("completions", keep_ids=False)
    trail.feed(sse(*vllm_stream("completions", PROMPT, TOKENS, finish=False)))
    assert continuation_body("completions", {"prompt": "hi", "max_tokens": 4}, trail) is None


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuation_events_read_as_the_rest_of_the_clients_stream(kind):
    """The client sees one answer: the original's id and created, its kind's shape, usage as if nothing happened."""
    trail = Trail(kind, keep_ids=False)
    before = trail.feed(sse(*vllm_stream(kind, PROMPT, TOKENS[:2], resp_id="orig", created=5, finish=False)))
    trail.continue_here()
    rest = vllm_stream("completions", [*PROMPT, 101, 102], TOKENS[2:], usage=True, resp_id="cont", created=9)
    after = trail.feed(sse(*rest, "[DONE]"))
    uncrashed = vllm_stream(kind, PROMPT, TOKENS, ids=False, usage=True, resp_id="orig", created=5)
    for e in uncrashed:
        e.pop("prompt_token_ids", None)
        for c in e["choices"]:
            c.pop("prompt_token_ids", None), c.pop("token_ids", None)
    got = _events(before + after)
    assert got[-1] == "[DONE]" and trail.done
    assert got[:-1] == uncrashed
    assert trail.generated == [101, 102, 103, 104]


def test_a_stream_whose_every_token_was_out_closes_with_its_usage():
    trail = Trail("completions", keep_ids=False, usage=True)
    trail.feed(sse(*vllm_stream("completions", PROMPT, TOKENS, resp_id="orig")))
    assert trail.finished and not trail.usage_sent
    usage, done = _events(trail.closing())
    assert usage["usage"] == {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4} and usage["id"] == "orig"
    assert done == "[DONE]" and trail.done


def test_a_usage_event_that_came_is_not_sent_again():
    trail = Trail("chat", keep_ids=False, usage=True)
    trail.feed(sse(*vllm_stream("chat", PROMPT, TOKENS, usage=True)))
    assert trail.usage_sent and _events(trail.closing()) == ["[DONE]"]


def test_an_end_that_cannot_be_continued_is_an_error_without_done():
    data = end_event("decode_stream_broken", "stream migration is off")
    assert data.endswith(b"\n\n") and b"[DONE]" not in data
    [event] = _events(data)
    assert event["error"]["code"] == 502 and "incomplete" in event["error"]["message"]


def test_a_failed_engine_is_used_again_only_once_it_went_and_came_back():
    """A restarted container or a recreated group is a new engine; one that failed and never went (a hang) is not."""
    ejections = Ejections(clock=lambda: 0.0)
    comeback = Comeback({"d1", "d2"})
    assert comeback.observe({"d1", "d2", "d3"}, ejections) == set()  # both still there: both avoided
    ejections.eject("d1")
    assert comeback.observe({"d1", "d2", "d3"}, ejections) == set()  # d1 ejected: away
    ejections.probed("d1", ok=True)
    assert comeback.observe({"d1", "d2", "d3"}, ejections) == {"d1"}  # admitted again: back
    assert comeback.observe({"d3"}, ejections) == set()  # d2 out of the table (its pod not ready)
    assert comeback.observe({"d2", "d3"}, ejections) == {"d2"}
    assert comeback.failed == set() and comeback.away == set()
