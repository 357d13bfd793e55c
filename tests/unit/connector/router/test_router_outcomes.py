"""One outcome written into both ledgers, /metrics and /health (router/outcomes.py); and the benchmark's
push-sequential dispatch, which the production router's command line cannot select."""

from __future__ import annotations

import pytest

from disagg_bench.localrun.baseline_router import router_argv
from disagg_connector.contract.health import RouterHealth
from disagg_connector.router.config import parse_args
from disagg_connector.router.legs import Timeline
from disagg_connector.router.metrics import RouterMetrics
from disagg_connector.router.outcomes import OutcomeRecorder
from disagg_connector.router.stats import RouterStats


def _recorder() -> tuple[OutcomeRecorder, RouterMetrics, RouterStats]:
    stats = RouterStats(clock=lambda: 100.0)
    metrics = RouterMetrics(lambda: RouterHealth("ok", True, "Push", 60.0, (), {}))
    return OutcomeRecorder(metrics, stats), metrics, stats


def _sample(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_one_outcome_feeds_both_ledgers():
    outcomes, metrics, stats = _recorder()
    outcomes.attempt("r1", "push", retry=False)
    outcomes.failed("r1", "push", "prefill_timeout")
    outcomes.attempt("r1", "push", retry=True)
    outcomes.answered("r1", "push", Timeline(start=1.0, prefill_done=1.2, decode_sent=1.0, first_token=1.3), None)
    assert _sample(metrics, "disagg_router_failures_total", revision="r1", mode="push", cause="prefill_timeout") == 1
    assert _sample(metrics, "disagg_router_retries_total", revision="r1") == 1
    assert _sample(metrics, "disagg_router_kv_wait_seconds_count", revision="r1", mode="push") == 1
    totals = stats.totals("r1")
    assert (totals.requests, totals.succeeded, totals.failures) == (2, 1, {"prefill_timeout": 1})


def test_a_push_answer_whose_prefill_leg_failed_counts_against_the_transfer():
    outcomes, metrics, stats = _recorder()
    outcomes.attempt("r1", "push", retry=False)
    outcomes.answered("r1", "push", Timeline(start=1.0, decode_sent=1.0, first_token=1.3), "prefill_error")
    totals = stats.totals("r1")
    assert (totals.succeeded, totals.failures) == (0, {"prefill_error": 1})


def test_local_requests_and_requests_without_a_revision_stay_out_of_the_health_counts():
    outcomes, metrics, stats = _recorder()
    outcomes.request_started()
    outcomes.attempt("r1", "local", retry=False)
    outcomes.failed("r1", "local", "decode_failed")
    outcomes.answered("r1", "local", Timeline(start=1.0, decode_sent=1.0, first_token=1.1), None)
    outcomes.failed("", "", "client_disconnect")
    outcomes.request_ended("r1", "local", "chat", 200, 0.5)
    assert stats.revisions["r1"].local == 1
    totals = stats.totals("r1")
    assert (totals.requests, totals.succeeded, totals.failures) == (0, 0, {})
    assert _sample(metrics, "disagg_router_failures_total", revision="r1", mode="local", cause="decode_failed") == 1
    assert _sample(metrics, "disagg_router_failures_total", revision="", mode="", cause="client_disconnect") == 1
    assert _sample(metrics, "disagg_router_requests_total", revision="r1", mode="local", endpoint="chat", code="200") == 1
    assert _sample(metrics, "disagg_router_requests_in_flight") == 0


def test_push_sequential_is_the_benchmarks_dispatcher_not_a_router_mode():
    with pytest.raises(SystemExit):
        parse_args(["--served-model-name", "q", "--static-endpoints", "f", "--mode", "push-sequential"])
    argv = router_argv(["--served-model-name", "q", "--mode", "push-sequential", "--static-endpoints", "f"])
    assert parse_args(argv).mode == "push"
    assert parse_args(router_argv(["--served-model-name", "q", "--mode=push-sequential", "--static-endpoints", "f"])).mode == "push"


def test_routing_despite_ejections_is_counted_from_zero_and_logged_once_per_spell(caplog):
    now = [0.0]
    stats = RouterStats(clock=lambda: 100.0)
    metrics = RouterMetrics(lambda: RouterHealth("ok", True, "Push", 60.0, (), {}))
    outcomes = OutcomeRecorder(metrics, stats, clock=lambda: now[0])
    outcomes.attempt("r1", "push", retry=False)
    assert _sample(metrics, "disagg_router_routed_despite_ejections_total", revision="r1") == 0  # a series before any
    with caplog.at_level("WARNING", logger="disagg_router.dispatch"):
        for t in (0.0, 1.0, 9.9, 10.0):
            now[0] = t
            outcomes.despite_ejections("r1", 4)
    assert _sample(metrics, "disagg_router_routed_despite_ejections_total", revision="r1") == 4
    logged = [r.getMessage() for r in caplog.records if "routing to ejected backends" in r.getMessage()]
    assert len(logged) == 2 and "(4 ejected)" in logged[0]  # at 0 and at 10 s: a storm is one line per spell
