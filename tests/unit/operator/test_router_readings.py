"""The autoscaler's reading of the routers' /metrics: the text the router's own RouterMetrics writes, parsed;
an interval cut from two reads, summed over routers, restarts included; percentiles as histogram_quantile."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from disagg_connector.contract.health import RouterHealth
from disagg_connector.router.metrics import RouterMetrics
from disagg_operator.router_readings import Histogram, Interval, ReadingError, interval, parse_router_metrics


def router() -> RouterMetrics:
    return RouterMetrics(lambda: RouterHealth("ok", True, "Push", 60.0, (), {}))


def text(metrics: RouterMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def serve(metrics: RouterMetrics, revision: str, ttfts: list[float], backend: str = "p0", prompt: int = 0, hit: int = 0) -> None:
    for t in ttfts:
        metrics.child(metrics.ttft, revision, "Push").observe(t)
        metrics.child(metrics.prefill, revision, "Push").observe(t * 0.8)
        metrics.child(metrics.tpot, revision, "Push").observe(0.02)
    metrics.child(metrics.prompt_tokens, backend).inc(prompt)
    metrics.child(metrics.expected_hit_tokens, backend).inc(hit)


def test_an_interval_is_what_happened_between_two_reads_of_one_revision() -> None:
    m = router()
    serve(m, "r1", [0.3] * 50, prompt=10_000, hit=4_000)
    serve(m, "r0", [9.0] * 5)  # the old revision's: not this revision's measurements
    first = parse_router_metrics(text(m))
    serve(m, "r1", [0.3] * 90 + [6.0] * 10, prompt=30_000, hit=5_000)
    got = interval(first, parse_router_metrics(text(m)), "r1", ["p0"])
    assert got.requests == 100 and got.tpot.count == 100
    assert got.uncached_prompt_tokens == 25_000
    assert got.ttft.quantile(0.5) == pytest.approx(0.29, abs=0.05)  # in the (0.2, 0.35] bucket
    assert got.prefill_leg.mean == pytest.approx((90 * 0.24 + 10 * 4.8) / 100), "the mean from the series' sums"
    assert 5.0 < got.ttft.quantile(0.95) <= 7.5  # the slow tenth: p95 falls in (5, 7.5]
    assert interval(None, first, "r1", ["p0"]) == Interval(), "a router's first read only starts its interval"


def test_a_router_that_restarted_counts_from_zero() -> None:
    before = router()
    serve(before, "r1", [0.3] * 500, prompt=90_000)
    restarted = router()
    serve(restarted, "r1", [1.2] * 20, prompt=2_000)
    got = interval(parse_router_metrics(text(before)), parse_router_metrics(text(restarted)), "r1", ["p0"])
    assert got.requests == 20 and got.uncached_prompt_tokens == 2_000
    assert got.prefill_leg.mean == pytest.approx(1.2 * 0.8)


def test_routers_add_up() -> None:
    a, b = router(), router()
    empty = parse_router_metrics(text(router()))
    serve(a, "r1", [0.3] * 30, prompt=3_000)
    serve(b, "r1", [3.0] * 10, backend="p1", prompt=1_000)
    total = interval(empty, parse_router_metrics(text(a)), "r1", ["p0", "p1"]).plus(
        interval(empty, parse_router_metrics(text(b)), "r1", ["p0", "p1"]))  # fmt: skip
    assert total.requests == 40 and total.uncached_prompt_tokens == 4_000
    assert 2.0 < total.ttft.quantile(0.9) <= 3.0
    assert total.prefill_leg.mean == pytest.approx((30 * 0.24 + 10 * 2.4) / 40)
    assert Histogram().mean is None


def test_quantile_like_histogram_quantile() -> None:
    h = Histogram(((0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (float("inf"), 21.0)))
    assert h.quantile(0.25) == pytest.approx(0.1 + 0.4 * (5.25 / 10))
    assert h.quantile(0.99) == 1.0, "a rank in +Inf reads the highest finite bound"
    assert Histogram().quantile(0.9) is None


def test_text_that_is_not_prometheus_is_refused() -> None:
    with pytest.raises(ReadingError):
        parse_router_metrics("disagg_router_time_to_first_token_seconds_bucket{le=\"x\"} one\n")


def test_the_ttft_of_prompts_decode_prefilled_itself_is_apart_and_in_the_whole() -> None:
    m = router()
    first = parse_router_metrics(text(m))
    serve(m, "r1", [0.3] * 40)
    for _ in range(10):  # below the disaggregation threshold: decode prefilled these, slowly
        m.child(m.ttft, "r1", "local").observe(4.0)
    got = interval(first, parse_router_metrics(text(m)), "r1", ["p0"])
    assert got.requests == 50 and got.local_ttft.count == 10 and 2.5 < got.local_ttft.quantile(0.9) <= 5.0
    assert got.prefill_leg.count == 40 and got.ttft.quantile(0.5) < 0.5
