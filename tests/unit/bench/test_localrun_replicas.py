"""Router replicas in disagg-localrun: the plan starts N routers per mode on ports of their own, the client spreads
requests over them by session or by request, prompts can go as token ids, and each replica's own counters are
read back per cell."""

from __future__ import annotations

import pytest

from disagg_bench.localrun import loadgen
from disagg_bench.localrun.plan import LocalOptions, local_plan
from disagg_bench.localrun.report import router_replicas

from tests.fixtures.models import dm


def test_the_plan_runs_every_router_mode_as_its_replicas_on_ports_of_their_own() -> None:
    modes = ("push:least-outstanding", "push:prefix-and-load")
    plan = local_plan(dm(), LocalOptions(gpus=("0", "1"), router_modes=modes, router_replicas=2))
    assert [(r.mode, r.replica, r.label) for r in plan.routers] == [
        (modes[0], 0, modes[0]), (modes[0], 1, modes[0] + "#1"), (modes[1], 0, modes[1]), (modes[1], 1, modes[1] + "#1")]
    assert len({r.port for r in plan.routers} | {e.http_port for e in plan.engines}) == 4 + len(plan.engines)
    assert [r.replica for r in plan.router_replicas(modes[1])] == [0, 1] and plan.router(modes[1]).replica == 0
    first, second = plan.routers[0].argv, plan.routers[1].argv
    differ = {i for i, (a, b) in enumerate(zip(first, second)) if a != b}
    assert len(first) == len(second) and [(first[i - 1], first[i], second[i]) for i in differ] == [
        ("--port", str(plan.routers[0].port), str(plan.routers[1].port))]  # the same router but its port
    assert any(o.target == "router replicas" and o.value == "2" for o in plan.overrides)


def test_one_replica_plans_as_before() -> None:
    plan = local_plan(dm(), LocalOptions(gpus=("0", "1"), router_modes=("push",)))
    assert [(r.mode, r.replica, r.label) for r in plan.routers] == [("push", 0, "push")]
    assert not any(o.target == "router replicas" for o in plan.overrides)


def test_replicas_spread_sessions_or_requests_round_robin() -> None:
    targets = (loadgen.RouterTarget("http://a"), loadgen.RouterTarget("http://b"))
    by_session = loadgen.Replicas(targets, "session")
    assert [by_session.pick(i, session=i // 3)[0] for i in range(9)] == [0, 0, 0, 1, 1, 1, 0, 0, 0]  # a session stays
    assert [by_session.pick(i)[0] for i in range(4)] == [0, 1, 0, 1]  # no session: by request
    by_request = loadgen.Replicas(targets, "request")
    assert [by_request.pick(i, session=0)[0] for i in range(4)] == [0, 1, 0, 1]  # a session's turns alternate
    assert by_request.pick(3)[1] is targets[1]
    with pytest.raises(ValueError):
        loadgen.Replicas(targets, "connection")
    with pytest.raises(ValueError):
        loadgen.Replicas((), "session")


def test_token_id_prompts_are_the_test_tokenizers_ids_of_the_words() -> None:
    assert loadgen.as_prompt("w5 w151642 w1") == "w5 w151642 w1"
    assert loadgen.as_prompt("w5 w151642 w1", "token-ids") == [5, 151642, 1]
    with pytest.raises(ValueError):
        loadgen.as_prompt("w1", "bytes")


def test_each_replicas_counts_come_from_its_own_series() -> None:
    cell = {"router_series": {
        "push": {'disagg_router_requests_total{code="200",endpoint="completions",mode="push",revision="r"}': 7.0,
                 'disagg_router_requests_total{code="499",endpoint="completions",mode="push",revision="r"}': 1.0,
                 'disagg_router_picks_total{policy="prefix-and-load",reason="cache_hit",role="prefill"}': 6.0,
                 'disagg_router_picks_total{policy="prefix-and-load",reason="load",role="prefill"}': 2.0,
                 'disagg_router_picks_total{policy="least-loaded",reason="load",role="decode"}': 8.0,
                 'disagg_router_failures_total{cause="client_disconnect",mode="push",revision="r"}': 1.0},
        "push#1": {'disagg_router_requests_total{code="200",endpoint="completions",mode="push",revision="r"}': 0.0},
    }}  # fmt: skip
    counts = router_replicas(cell)
    assert (counts["push"].ok, counts["push"].not_ok) == (7.0, 1.0)
    assert counts["push"].prefill_picks == {"cache_hit": 6.0, "load": 2.0}  # the decode's picks are not the prefill's
    assert counts["push"].failures == {"client_disconnect": 1.0}
    assert (counts["push#1"].ok, counts["push#1"].requests) == (0.0, {})
    assert router_replicas({}) == {}
