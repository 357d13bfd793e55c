"""The Events of a pass (events.py, pure): a rollout's story in order, and what went wrong, each once."""

from __future__ import annotations

from dataclasses import replace

from disagg_operator import events, planner
from disagg_operator.api import vocabulary
from disagg_operator.state import Desired, Observed

from tests.fixtures.planner import COSTED, IDLE, LEAVING, NEW_IMAGE, NOW, OLD_D, OLD_P, WORLD, refused, rolling
from tests.fixtures.world import desired, steady


def story(world: Desired, observed: Observed, previous: dict | None) -> list[tuple[str, str, str]]:
    world = replace(world, previous_status=previous)
    plan = planner.plan(world, observed, NOW)
    found = events.of_pass(world, observed, plan, len(plan.actions), None, plan.status)
    for e in found:
        assert e.reason in vocabulary.EVENT_REASONS or e.reason in vocabulary.BY_NAME, e.reason
    return [(e.type, e.reason, e.related["metadata"]["name"] if e.related else "") for e in found]


def status_of(world: Desired, observed: Observed) -> dict:
    return planner.plan(world, observed, NOW).status


def test_a_rollout_tells_its_story_in_order() -> None:
    steady_status = status_of(WORLD, steady(WORLD))
    started = story(NEW_IMAGE, steady(WORLD), steady_status)
    assert started[0][:2] == ("Normal", "RolloutStarted") and {r for _, r, _ in started[1:]} == {"RolloutStep"}, started
    rolling_status = status_of(NEW_IMAGE, rolling(new_ready=True))
    assert story(NEW_IMAGE, rolling(True), rolling_status) == [("Normal", "PodDraining", OLD_P), ("Normal", "PodDraining", OLD_D)]
    assert story(NEW_IMAGE, replace(rolling(True, LEAVING), routers=IDLE), rolling_status) == [
        ("Normal", "PodRetired", OLD_P), ("Normal", "PodRetired", OLD_D)]
    done = story(NEW_IMAGE, replace(rolling(True, COSTED), routers=IDLE), rolling_status)
    assert [r for _, r, _ in done] == ["RevisionRetired", "RevisionRetired", "RolloutComplete"], done


def test_a_steady_pass_records_nothing() -> None:
    status = status_of(WORLD, steady(WORLD))
    assert story(WORLD, steady(WORLD), status) == []


def test_only_actions_carried_out_make_events_and_a_failed_write_says_so() -> None:
    observed = rolling(True)
    world = replace(NEW_IMAGE, previous_status=status_of(NEW_IMAGE, observed))
    plan = planner.plan(world, observed, NOW)
    failure = planner.ChildProblem("Conflict", "Pod", OLD_D, "the object has been modified")
    found = events.of_pass(world, observed, plan, 1, failure, plan.status)
    assert [(e.type, e.reason) for e in found] == [("Normal", "PodDraining"), ("Warning", "Conflict")], found
    assert "1 of 2 changes made" in found[-1].note


def test_a_refused_child_is_a_warning_and_ready_lost_is_one_too() -> None:
    serving = status_of(WORLD, steady(WORLD))
    found = story(NEW_IMAGE, refused(NEW_IMAGE, steady(WORLD)), serving)
    assert ("Warning", "ChildRejected", "") in found and found.count(("Warning", "ChildRejected", "")) == 2, found
    # The same refusal on the next pass: Ready was already False for it, so only the refusal itself is told.
    again = story(NEW_IMAGE, refused(NEW_IMAGE, steady(WORLD)), status_of(NEW_IMAGE, refused(NEW_IMAGE, steady(WORLD))))
    assert again == [("Warning", "ChildRejected", "")], again


def test_pods_starting_at_create_are_no_warning() -> None:
    assert [r for t, r, _ in story(WORLD, Observed(), None) if t == "Warning"] == []
    assert [r for t, r, _ in story(desired(), Observed(), status_of(WORLD, Observed())) if t == "Warning"] == []


def test_the_autoscalers_recommendation_and_block_are_told_once_per_decision() -> None:
    def decided(at: str, prefill: tuple[int, int], blocked: str | None = None, mode: str = "Advisory") -> dict:
        role = lambda current, recommended: {"current": current, "recommended": recommended, "reason": "why"}  # noqa: E731
        return {"autoscaling": {"mode": mode, "decidedAt": at, "prefill": role(*prefill), "decode": role(1, 1),
                                **({"blocked": blocked} if blocked else {})}}  # fmt: skip

    first = events.of_status({}, decided("t1", (1, 3)))
    assert [(e.reason, e.type) for e in first] == [("AutoscalerRecommends", "Normal")] and "prefill 1 -> 3" in first[0].note
    assert events.of_status(decided("t1", (1, 3)), decided("t1", (1, 3))) == [], "the same decision again"
    assert events.of_status(decided("t1", (1, 3)), decided("t2", (1, 3))) == [], "the same recommendation again"
    assert events.of_status(decided("t2", (1, 3)), decided("t3", (1, 1))) == [], "on target: no news"
    blocked = events.of_status(decided("t3", (1, 1)), decided("t4", (3, 3), blocked="prefill: 1 engine(s) cannot be scheduled"))
    assert [(e.reason, e.type) for e in blocked] == [("AutoscalerBlocked", "Warning")]
    scaled = events.of_status(decided("t4", (1, 1), mode="Active"), decided("t5", (1, 2), mode="Active"))
    assert [(e.reason, e.type) for e in scaled] == [("AutoscalerScaled", "Normal")] and "prefill 1 -> 2" in scaled[0].note
