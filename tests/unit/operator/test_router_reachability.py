"""KVTransferHealthy when no ready router pod answers /health: starting while its pods became Ready moments ago,
unreachable (check the network policies) only after that."""

from __future__ import annotations

import pytest

from disagg_operator.api import vocabulary
from disagg_operator.state import Observed, RouterView
from disagg_operator.status import ROUTER_START_GRACE_S, kv_transfer, router_ready_ages, silent_routers

NOW = "2026-05-09T10:00:00Z"


def _router_pod(name: str, ready_since: str | None, ready: str = "True") -> dict:
    conditions = [] if ready_since is None else [{"type": "Ready", "status": ready, "lastTransitionTime": ready_since}]
    return {"kind": "Pod", "metadata": {"name": name, "labels": {"disagg.dev/role": "router"}},
            "status": {"phase": "Running", "podIP": "127.0.0.9", "conditions": conditions}}  # fmt: skip


def test_ready_ages_come_from_the_ready_condition() -> None:
    observed = Observed(pods=(_router_pod("r-0", "2026-05-09T09:59:30Z"), _router_pod("r-1", "2026-05-09T09:50:00Z"),
                              _router_pod("r-2", None), _router_pod("r-3", "2026-05-09T09:59:00Z", ready="False")))  # fmt: skip
    assert router_ready_ages(observed, ("r-0", "r-1", "r-2", "r-3", "gone"), NOW) == (30.0, 600.0, None, None, None)
    assert router_ready_ages(observed, ("r-0",), "not a time") == (None,)


@pytest.mark.parametrize(("ages", "reason"), [
    ((5.0,), "RouterStarting"),
    ((5.0, ROUTER_START_GRACE_S - 1), "RouterStarting"),
    ((float(ROUTER_START_GRACE_S),), "RouterUnreachable"),
    ((5.0, 600.0), "RouterUnreachable"),  # one has been ready long enough to answer
    ((5.0, None), "RouterUnreachable"),  # not known since when: as before
    ((), "RouterUnreachable"),
])  # fmt: skip
def test_a_silent_router_is_starting_only_just_after_it_became_ready(ages: tuple, reason: str) -> None:
    got, message = silent_routers(ages)
    assert got == reason
    assert reason in vocabulary.BY_NAME
    assert ("network policies" in message) == (reason == "RouterUnreachable"), message
    if reason == "RouterStarting":
        assert "starting" in message


def test_kv_transfer_words_for_silent_routers() -> None:
    silent = RouterView((None,), ("r-0",))
    assert kv_transfer(silent, {}, (10.0,))[:2] == (None, "RouterStarting")
    assert kv_transfer(silent, {}, (3600.0,))[:2] == (None, "RouterUnreachable")
    none_ready = kv_transfer(RouterView(), {}, ())
    assert none_ready[:2] == (None, "NoRouterReady") and "not up yet" in none_ready[2]
