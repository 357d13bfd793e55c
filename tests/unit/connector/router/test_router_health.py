"""The /health document (model, parser, verdicts), the outcome counters behind it, and the pure helpers of dispatch."""

from __future__ import annotations

import copy

import pytest

from disagg_connector.contract.vllm_pd import estimate_prompt_tokens, prefill_body
from disagg_connector.router.legs import Timeline
from disagg_connector.contract.health import CAUSES, HealthDocumentError, Outcomes, parse_health
from disagg_connector.router.stats import RouterStats
from tests.fixtures.router import DOC, revision


def test_document_round_trips_through_json_and_the_parser():
    doc = DOC.to_json()
    assert doc["backends"][0] == {
        "pod": "m-prefill-abc-0", "backend": "m-prefill-abc-0", "role": "prefill", "revision": "abc", "mode": "Push",
        "inflight": 2, "draining": False, "ejected": False,
    }  # fmt: skip
    rev = doc["revisions"]["abc"]
    assert (rev["mode"], rev["readyPairs"], rev["weight"], rev["requests"], rev["failures"]) == ("Push", 1, 1.0, 9, {"kv_wait_timeout": 2})
    assert parse_health(doc) == DOC


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.pop("backends"), "health.backends: missing"),
        (lambda d: d.update(status="up"), "health.status: expected 'ok' or 'draining'"),
        (lambda d: d["backends"][0].update(inflight="2"), "health.backends[0].inflight: expected"),
        (lambda d: d["backends"][1].update(role="router"), "health.backends[1].role"),
        (lambda d: d["backends"][0].update(draining=1), "health.backends[0].draining"),
        (lambda d: d["revisions"]["abc"].update(mode="push"), "health.revisions.abc.mode"),
        (lambda d: d["revisions"]["abc"]["recent"]["failures"].update(x=True), "health.revisions.abc.recent.failures.x"),
        (lambda d: d["revisions"]["abc"].update(readyPairs=True), "health.revisions.abc.readyPairs: expected"),
    ],
)
def test_a_malformed_document_names_the_field(mutate, message):
    doc = copy.deepcopy(DOC.to_json())
    mutate(doc)
    with pytest.raises(HealthDocumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_health(doc)
    with pytest.raises(HealthDocumentError):
        parse_health([])


@pytest.mark.parametrize(
    "rev,healthy,reason",
    [
        (revision(Outcomes(0, 0, {}), Outcomes(0, 0, {})), None, "NoTrafficYet"),
        (revision(Outcomes(4, 4, {})), True, "TransfersSucceeding"),
        (revision(Outcomes(4, 3, {"decode_failed": 1})), True, "TransfersSucceeding"),  # the successes outweigh it
        (revision(Outcomes(4, 1, {"decode_failed": 3})), False, "TransfersFailing"),
        (revision(Outcomes(4, 2, {"kv_wait_timeout": 1, "prefill_timeout": 1})), False, "DeadlinesHit"),
        (revision(Outcomes(2, 1, {"protocol_mismatch": 1})), False, "ProtocolMismatch"),
        (revision(Outcomes(3, 0, {"decode_connection": 3})), None, "NoTransferCompleted"),  # engines down: not the KV's fault
        (revision(Outcomes(0, 0, {}), Outcomes(5, 5, {}), last_success_age_seconds=300.0), True, "TransfersSucceeding"),
        (revision(Outcomes(0, 0, {}), mode=None, mode_conflict="pods disagree"), False, "ProtocolMismatch"),
        (revision(Outcomes(2, 0, {"client_disconnect": 2})), None, "NoTransferCompleted"),
    ],
)
def test_verdicts(rev, healthy, reason):
    v = rev.verdict("abc", 60.0)
    assert (v.healthy, v.reason) == (healthy, reason)
    assert "revision abc" in v.message


def test_every_cause_has_a_category():
    assert set(CAUSES.values()) == {"transfer", "deadline", "protocol", "engine", "client"}


def test_stats_window_forgets_and_totals_remember():
    now = [100.0]
    s = RouterStats(window_seconds=60.0, clock=lambda: now[0])
    for _ in range(3):
        s.dispatched("a")
    s.failed("a", "decode_failed")
    s.succeeded("a")
    s.local("a")
    assert s.recent("a") == Outcomes(3, 1, {"decode_failed": 1})
    now[0] += 30
    s.dispatched("a")
    s.succeeded("a")
    assert s.recent("a") == Outcomes(4, 2, {"decode_failed": 1})
    now[0] += 35  # the first burst left the window, the second did not
    assert s.recent("a") == Outcomes(1, 1, {})
    assert s.totals("a") == Outcomes(4, 2, {"decode_failed": 1}) and s.revisions["a"].local == 1
    assert s.last_success_age("a") == 35.0 and s.last_success_age("b") is None


def test_prompt_length_estimate():
    assert estimate_prompt_tokens("completions", {"prompt": "x" * 400}) == 100  # 4 bytes per token, as llm-d
    assert estimate_prompt_tokens("completions", {"prompt": list(range(37))}) == 37  # token ids: exact
    assert estimate_prompt_tokens("completions", {"prompt": ["abcd", "abcdefgh"]}) == 3
    chat = {"messages": [{"role": "user", "content": "y" * 40}, {"role": "user", "content": [{"type": "text", "text": "z" * 8}]}]}
    assert estimate_prompt_tokens("chat", chat) == 12
    assert estimate_prompt_tokens("chat", {"messages": "nope"}) == 0


def test_prefill_leg_body():
    body = {"model": "m", "prompt": "p", "max_tokens": 50, "stream": True, "min_tokens": 3, "stream_options": {}, "kv_transfer_params": {"evil": 1}}
    leg = prefill_body("completions", body, "xfer-1")
    assert leg["max_tokens"] == 1 and leg["stream"] is False and "min_tokens" not in leg and "stream_options" not in leg
    assert leg["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None, "transfer_id": "xfer-1",
    }  # fmt: skip
    assert prefill_body("chat", body, "x")["max_completion_tokens"] == 1


def test_timeline_splits_the_first_token():
    push = Timeline(start=10.0, prefill_done=10.4, decode_sent=10.0, first_token=10.5)  # concurrent legs
    assert push.prefill == pytest.approx(0.4) and push.kv_wait == pytest.approx(0.1)
    pull = Timeline(start=10.0, prefill_done=10.4, decode_sent=10.41, first_token=10.6)  # sequential legs
    assert pull.kv_wait == pytest.approx(0.19)
    assert Timeline(start=1.0, decode_sent=1.0, first_token=1.2).kv_wait is None  # local: no prefill leg
    assert push.server_timing(9.9) == "prefill;dur=400.0, kv_wait;dur=100.0, first_token;dur=600.0"


def test_a_router_reports_before_its_first_load_read_and_stays_shutting_down_after_one() -> None:
    """The router's own state is set once: its load reader, which re-lists the backends every second, once
    reset it (a /health before the first read failed; a router shutting down answered "ok" again a second
    later, and took new requests on open connections)."""
    from disagg_connector.router.config import RouterConfig
    from disagg_connector.router.server import Router

    router = Router(RouterConfig("q"))
    assert router.summary().status == "ok"
    router.draining = True
    router.current_backends(set())  # what the load reader calls after each read
    assert router.summary().status == "draining"
