"""Rollout arithmetic: each step as a table, and whole rollouts simulated with pods turning ready in any
order, the invariants checked after every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_operator.rollout import Budget, Count, budget, next_step

P, D = "prefill", "decode"


def budgets(tp: int, td: int, surge: int | str = 1, unavailable: int | str = 0) -> dict[str, Budget]:
    return {P: budget(tp, surge, unavailable), D: budget(td, surge, unavailable)}


@pytest.mark.parametrize(("value", "target", "up", "pods"), [
    (1, 4, True, 1), ("25%", 4, True, 1), ("25%", 5, True, 2), ("25%", 5, False, 1), ("100%", 3, True, 3), (0, 4, False, 0),
])  # fmt: skip
def test_percentages_become_pods_as_a_deployment_rounds_them(value: int | str, target: int, up: bool, pods: int) -> None:
    b = budget(target, value, 0) if up else budget(target, 1, value)
    assert (b.surge if up else b.unavailable) == pods


def test_no_budget_at_all_still_moves() -> None:
    assert budget(4, 0, 0) == Budget(4, 1, 0)


# (id, targets, budgets, new (desired, ready) per role, old (desired, ready) per role, expected new, expected old)
STEPS = [
    ("first-create", (4, 4), (1, 0), {P: (0, 0), D: (0, 0)}, None, {P: 4, D: 4}, {}),
    ("rollout-starts-with-one-surge-pod-each", (4, 4), (1, 0), {P: (0, 0), D: (0, 0)}, {P: (4, 4), D: (4, 4)},
     {P: 1, D: 1}, {P: 4, D: 4}),
    ("a-new-prefill-alone-retires-nothing", (4, 4), (1, 0), {P: (1, 1), D: (1, 0)}, {P: (4, 4), D: (4, 4)},
     {P: 1, D: 1}, {P: 4, D: 4}),
    ("a-new-ready-pair-retires-an-old-pair", (4, 4), (1, 0), {P: (1, 1), D: (1, 1)}, {P: (4, 4), D: (4, 4)},
     {P: 1, D: 1}, {P: 3, D: 3}),
    ("room-freed-is-filled", (4, 4), (1, 0), {P: (1, 1), D: (1, 1)}, {P: (3, 3), D: (3, 3)},
     {P: 2, D: 2}, {P: 3, D: 3}),
    ("last-old-pair-goes-when-all-new-are-ready", (4, 4), (1, 0), {P: (4, 4), D: (4, 4)}, {P: (1, 1), D: (1, 1)},
     {P: 4, D: 4}, {P: 0, D: 0}),
    ("unavailability-lets-the-old-shrink-first", (4, 4), (0, 1), {P: (0, 0), D: (0, 0)}, {P: (4, 4), D: (4, 4)},
     {P: 0, D: 0}, {P: 3, D: 3}),
    ("unavailability-never-takes-the-last-pair", (1, 1), (1, 1), {P: (1, 0), D: (1, 1)}, {P: (1, 1), D: (1, 1)},
     {P: 1, D: 1}, {P: 1, D: 1}),
    ("scale-out-during-a-rollout-retargets-it", (4, 6), (1, 0), {P: (2, 2), D: (2, 2)}, {P: (3, 3), D: (3, 3)},
     {P: 2, D: 4}, {P: 3, D: 3}),
    ("scale-in-without-rollout", (2, 2), (1, 0), {P: (4, 4), D: (4, 4)}, None, {P: 2, D: 2}, {}),
]


@pytest.mark.parametrize("case", STEPS, ids=[c[0] for c in STEPS])
def test_step(case) -> None:
    _, (tp, td), (surge, unavailable), new, old, want_new, want_old = case
    b = budgets(tp, td, surge, unavailable)
    old_revs = {"old": {r: Count(*old[r]) for r in (P, D)}} if old else {}
    step = next_step(b, {r: Count(*new[r]) for r in (P, D)}, old_revs, tuple(old_revs))
    assert dict(step.new) == want_new
    assert dict(step.old.get("old", {})) == want_old


def simulate(tp: int, td: int, surge: int, unavailable: int, seed: int, max_ticks: int = 400) -> list[dict]:
    """A rollout from a full old revision, pods of the new revision turning ready at random, old pods
    leaving as soon as the step lets them (retirement done). Returns the state after every tick."""
    rng = random.Random(seed)
    b = budgets(tp, td, surge, unavailable)
    new = {r: Count(0, 0) for r in (P, D)}
    old = {r: Count(b[r].target, b[r].target) for r in (P, D)}
    states = []
    for _ in range(max_ticks):
        step = next_step(b, new, {"old": old}, ("old",))
        # Old pods go (ready ones last, as retirement drains ready pods only when it must).
        old = {r: Count(step.old["old"][r], min(old[r].ready, step.old["old"][r])) for r in (P, D)}
        # New pods appear; some of those not ready yet turn ready.
        new = {r: Count(step.new[r], min(step.new[r], new[r].ready + rng.randint(0, step.new[r] - new[r].ready)))
               for r in (P, D)}
        states.append({"new": new, "old": old, "budgets": b})
        if all(new[r].ready == b[r].target for r in (P, D)) and not any(old[r].desired for r in (P, D)):
            break
    return states


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 3), st.integers(0, 2), st.integers(0, 2**31))
def test_any_rollout_keeps_the_invariants_and_finishes(tp: int, td: int, surge: int, unavailable: int, seed: int) -> None:
    states = simulate(tp, td, surge, unavailable, seed)
    last = states[-1]
    assert all(last["new"][r].ready == last["budgets"][r].target for r in (P, D)), "the rollout finishes"
    for s in states:
        b = s["budgets"]
        for r in (P, D):
            assert s["new"][r].desired + s["old"][r].desired <= b[r].target + b[r].surge, s
            assert s["new"][r].ready + s["old"][r].ready >= b[r].target - b[r].unavailable, s
        new_pair = s["new"][P].ready and s["new"][D].ready
        old_pair = s["old"][P].ready and s["old"][D].ready
        assert new_pair or old_pair, f"no revision with a ready pair: {s}"


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(0, 2**31))
def test_default_budgets_keep_the_ready_ratio_within_one_pod(tp: int, td: int, seed: int) -> None:
    for s in simulate(tp, td, 1, 0, seed):
        ready_p = s["new"][P].ready + s["old"][P].ready
        ready_d = s["new"][D].ready + s["old"][D].ready
        assert abs(ready_p - ready_d * tp / td) <= 1 or abs(ready_d - ready_p * td / tp) <= 1, s
