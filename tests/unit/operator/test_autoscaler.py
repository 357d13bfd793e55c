"""The SLO autoscaler's decision over scripted measurements: each role on its own signal, the budget, hysteresis,
the rollout freeze and unschedulable engines; and, over any input, bounds and budget always hold."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_operator.api.models import ModelAutoscalingSpec
from disagg_operator.autoscaler import ROLES, Capacity, Memory, Observation, RoleBounds, decide, learn, policy_of

from tests.fixtures.autoscaling import (INTERVAL, KV_CAPACITY, PREFILL_ENGINE_TOKENS_PER_S, TPOT_AT_EMPTY, TPOT_PER_KV_TOKEN,
                                        observation, observations, plant, policies, policy, role, run)  # fmt: skip


def sizes_over(history) -> list[tuple[int, int]]:
    return [(d.sizes["prefill"], d.sizes["decode"]) for _, d in history]


def test_prefill_queueing_grows_prefill_only() -> None:
    """Prompts outgrow two prefill engines; decode holds little KV: prefill grows until TTFT meets the target."""
    history = run(policy(), [plant(lambda at: 45_000.0, lambda at: 250_000.0)] * 12, {"prefill": 2, "decode": 2})
    first = history[0][1]
    assert first.sizes["prefill"] > 2 and first.sizes["decode"] == 2, first
    assert "TTFT" in first.reasons["prefill"]
    obs, last = history[-1]
    assert last.sizes["prefill"] >= math.ceil(45_000 / PREFILL_ENGINE_TOKENS_PER_S) and obs.ttft_s < policy().ttft_s
    assert {d.sizes["decode"] for _, d in history} == {2}


def test_decode_kv_pressure_grows_decode_only() -> None:
    """Long answers fill decode's KV; prefill is idle enough: decode grows, prefill stays."""
    kv = 0.95 * KV_CAPACITY * 2
    history = run(policy(tpot_s=1.0), [plant(lambda at: 5_000.0, lambda at: kv)] * 6, {"prefill": 2, "decode": 2})
    first = history[0][1]
    assert first.sizes["decode"] > 2 and first.reasons["decode"] == "KV nearly full" and first.sizes["prefill"] == 2
    assert history[-1][1].sizes["decode"] >= math.ceil(kv / (0.9 * KV_CAPACITY * 0.8)) - 1


def test_kv_on_engines_still_warming_counts_against_their_own_room() -> None:
    """Four decode engines serve, one of them warm: the KV of all four (1.5 engines' worth) is not a full warm one.
    Held by the one warm engine alone, it is."""
    pol, kv = policy(tpot_s=1.0), 1.5 * KV_CAPACITY
    decided = {holders: decide(pol, observation(0.0, role(2), role(4, warm=1, kv_tokens=kv, kv_engines=holders),
                                                requests=30, ttft_s=0.3, prefill_leg_s=0.2, tpot_s=0.03), Memory())[0]
               for holders in (4, 1)}  # fmt: skip
    assert decided[4].reasons["decode"] != "KV nearly full" and decided[4].sizes["decode"] == 4, decided[4]
    assert decided[1].reasons["decode"] == "KV nearly full" and decided[1].sizes["decode"] > 4, decided[1]


def test_the_observation_counts_the_engines_that_serve_and_the_decode_engines_whose_kv_it_sums() -> None:
    """Three decode engines in the routers' reads (two of them new, not in the census yet): their KV is summed and
    they are its holders, however many the census counts warm. The census's serving engines are `ready`; the
    prefill legs' mean is their histogram's sum over its count."""
    from disagg_connector.contract.health import BackendHealth, BackendRouting, RouterHealth

    from disagg_operator.autoscaler import Seen, observe
    from disagg_operator.router_readings import Histogram, Interval
    from disagg_operator.state import RouterView

    from tests.fixtures.world import desired, steady

    world = desired()
    revision = world.revision
    backends = tuple(BackendHealth(f"d-{i}", f"d-{i}", "decode", revision, "Push", 0, False, False,
                                   BackendRouting(1.0, 0.5, kv_usage=0.5, kv_capacity_tokens=200_000)) for i in range(3))  # fmt: skip
    seen = Seen(revision, steady(world).census, {"prefill": 1, "decode": 3}, RouterView((RouterHealth("ok", True, "Push", 60.0, backends, {}),), ("r-0",)),
                {}, False, 1.8e9)  # fmt: skip
    legs = Interval(prefill_leg=Histogram(((0.5, 1.0), (1.0, 3.0), (float("inf"), 4.0)), total=2.6))
    obs = observe(policy(warmup_s=0.0), seen, legs, 15.0, 90)
    assert obs.decode.kv_engines == 3 and obs.decode.kv_tokens == 300_000 and obs.decode.kv_capacity == 200_000
    assert obs.decode.current == 3 and obs.decode.warm <= 1, "the census has one decode pod"
    assert (obs.prefill.ready, obs.decode.ready) == (1, 1), "the census's serving engines, warm or not"
    assert obs.prefill_leg_mean_s == 0.65 and obs.prefill_leg_s == 1.0 and obs.prefill_legs == 4


def test_tpot_over_target_grows_decode_to_what_the_learned_line_says() -> None:
    """TPOT grows with the KV each decode engine holds; the load ramps, so the line is learned from the spread."""
    target = 0.05
    per_engine_at_target = (target - TPOT_AT_EMPTY) / TPOT_PER_KV_TOKEN  # 150k KV tokens
    history = run(policy(tpot_s=target), [plant(lambda at: 5_000.0, lambda at: 100_000.0 + 4_000.0 * at)] * 16,
                  {"prefill": 2, "decode": 2})  # fmt: skip
    obs, last = history[-1]
    assert last.sizes["decode"] >= math.ceil(obs.decode.kv_tokens / per_engine_at_target)
    assert all(o.tpot_s <= target * 1.3 for o, _ in history[4:]), [o.tpot_s for o, _ in history]
    assert "decode_engine_kv_tokens_at_target" in last.estimates


def test_decode_shrinks_where_an_idle_engines_step_is_most_of_the_tpot_target() -> None:
    """A 28 ms TPOT target on engines whose idle step is 20 ms: TPOT never falls under 70 % of the target (19.6 ms),
    yet eight engines holding 100k KV tokens are twice what the target needs. Once the line is learned (the KV
    ramps first), decode shrinks to the engines that hold the KV within the target, and TPOT stays under it."""
    target = 0.028
    kv = lambda at: 50_000.0 + 5_000.0 * min(at, 150.0) / INTERVAL  # noqa: E731  (100k from 150 s on)
    history = run(policy(tpot_s=target), [plant(lambda at: 5_000.0, kv)] * 30, {"prefill": 1, "decode": 8})
    assert all(o.tpot_s > 0.7 * target for o, _ in history), "the idle step alone is over 70 % of the target"
    per_engine = (target - TPOT_AT_EMPTY) / TPOT_PER_KV_TOKEN * 0.8  # at the headroom: 32k
    last = history[-1][1]
    assert last.sizes["decode"] == math.ceil(100_000.0 / per_engine) and "TPOT well under target" not in last.reasons["decode"]
    assert any("TPOT well under target" in d.reasons["decode"] for _, d in history), [d.reasons["decode"] for _, d in history]
    assert all(o.tpot_s <= target for o, _ in history), [o.tpot_s for o, _ in history]


def test_what_decode_was_asked_before_its_engines_were_all_warm_does_not_hold_it() -> None:
    """A cold start's guesses: decode was asked for 8 engines (first tokens waiting on one decode engine while the
    others started), sized on engines starting and warming. Once every engine is warm (the third interval), four
    hold the KV: decode shrinks at once rather than holding the guesses through the 300 s scale-down window. The
    same recommendations made after the cold start hold decode at 8."""
    pile_up = tuple((at, 1, 8) for at in range(-285, 0, 15))
    kv = lambda at: 450_000.0  # noqa: E731  (four engines of 120k each: the headroom of the 150k below)
    per_engine = (0.05 - TPOT_AT_EMPTY) / TPOT_PER_KV_TOKEN  # 150k at the TPOT target
    known_line = Capacity(decode_points=tuple((k, TPOT_AT_EMPTY + TPOT_PER_KV_TOKEN * k) for k in (0.5 * per_engine, per_engine, 0.75 * per_engine)))
    planted = plant(lambda at: 5_000.0, kv)

    def warming(at: float, sizes: dict[str, int]) -> Observation:
        obs = planted(at, sizes)
        return obs if at >= 2 * INTERVAL else replace(obs, decode=replace(obs.decode, warm=obs.decode.current - 3))

    cold = run(policy(scale_down_window_s=300.0), [warming] * 6, {"prefill": 1, "decode": 8},
               Memory(capacity=known_line, recommendations=pile_up))  # fmt: skip
    assert [d for _, d in sizes_over(cold)][:2] == [8, 8], "engines still warming: the window holds"
    assert [d for _, d in sizes_over(cold)][2:] == [4] * 4, [d.reasons["decode"] for _, d in cold]
    assert all(o.tpot_s <= 0.05 for o, _ in cold)
    held = run(policy(scale_down_window_s=300.0), [planted] * 6, {"prefill": 1, "decode": 8},
               Memory(capacity=known_line, recommendations=pile_up, decode_warmed=True))  # fmt: skip
    assert [d for _, d in sizes_over(held)] == [8] * 6, [d.reasons["decode"] for _, d in held]
    assert "waiting out the scale-down window" in held[-1][1].reasons["decode"]


def test_a_ttft_miss_that_is_not_prefills_does_not_grow_prefill() -> None:
    """TTFT over target, but the prefill leg is a small part of it (the KV wait or the decode's first token):
    more prefill engines would not help."""
    obs = observation(0.0, role(2), role(2, kv_tokens=10_000.0), requests=100, ttft_s=5.0, prefill_leg_s=0.3, tpot_s=0.03,
                      prefill_tokens=1_000.0)  # fmt: skip
    decision, _ = decide(policy(), obs, Memory())
    assert decision.sizes["prefill"] == 2


def test_first_tokens_late_with_requests_waiting_on_decode_grow_decode() -> None:
    """TTFT 5x its target, the prefill leg short, TPOT on target, and requests queued on decode: decode admits too
    slowly (its KV is taken), so decode grows by a step in proportion, prefill stays. The same miss with nothing
    waiting on decode (the KV wait, say) grows neither."""
    queued = observation(0.0, role(2), role(2, kv_tokens=10_000.0, waiting=12.0), requests=100, ttft_s=10.0,
                         prefill_leg_s=0.3, tpot_s=0.03, prefill_tokens=1_000.0)  # fmt: skip
    decision, _ = decide(policy(), queued, Memory())
    assert decision.sizes == {"prefill": 2, "decode": 4} and "12 requests waiting on decode" in decision.reasons["decode"], decision
    unqueued = replace(queued, decode=role(2, kv_tokens=10_000.0))
    assert dict(decide(policy(), unqueued, Memory())[0].sizes) == {"prefill": 2, "decode": 2}
    prefills = replace(queued, prefill_leg_s=6.0)  # the prefill leg is most of it: prefill's miss, not decode's
    assert decide(policy(), prefills, Memory())[0].sizes["decode"] == 2


def test_slow_prompts_that_decode_prefills_itself_grow_decode_not_prefill() -> None:
    """Short prompts under the disaggregation threshold are prefilled on decode: their TTFT miss is decode's (its
    compute and queue), while the disaggregated ones meet the target; once they meet it too decode may shrink."""
    missing = observation(0.0, role(2), role(2, kv_tokens=10_000.0), requests=100, ttft_s=3.0, prefill_leg_s=0.2,
                          tpot_s=0.02, prefill_tokens=1_000.0, local_ttft_s=4.0)  # fmt: skip
    decision, _ = decide(policy(), missing, Memory())
    assert decision.sizes == {"prefill": 2, "decode": 4} and "decode prefills itself" in decision.reasons["decode"], decision
    calm = replace(missing, ttft_s=0.3, local_ttft_s=0.5, decode=role(2, kv_tokens=0.0), requests=0, prefill_tokens=0.0)
    assert decide(policy(scale_down_window_s=0.0), calm, Memory())[0].sizes["decode"] == 1
    near = replace(calm, local_ttft_s=0.9 * policy().ttft_s)
    assert decide(policy(scale_down_window_s=0.0), near, Memory())[0].sizes["decode"] == 2, "near its target: no shrink"


def test_when_the_budget_binds_the_role_further_off_its_target_gets_the_accelerators() -> None:
    pol = policy(max_accelerators=8, prefill=RoleBounds(1, 8, 2), decode=RoleBounds(1, 8, 1))
    prefill_worse = observation(0.0, role(2, waiting=20.0), role(3, kv_tokens=0.95 * KV_CAPACITY * 3), requests=500,
                                ttft_s=8.0, prefill_leg_s=7.5, tpot_s=0.06, prefill_tokens=300_000.0)  # fmt: skip
    decision, _ = decide(pol, prefill_worse, Memory())
    assert sum(decision.sizes[r] * pol.bounds(r).accelerators for r in ROLES) <= 8
    assert decision.sizes["prefill"] == 3 and decision.sizes["decode"] == 2, decision
    assert "budget" in decision.reasons["decode"]


def test_a_steady_noisy_load_does_not_flap() -> None:
    """Prompts at 24k tokens/s +-15 %, at the edge where three prefill engines would do half the time and fall
    behind the other half; every latency +-15 % too; the engines' capacity already learned. With the default
    scale-down window the sizes never move; without hysteresis they would go 4 -> 3 -> 4 ..."""
    jitter = lambda at: 1.0 + 0.15 * math.sin(at * 0.7) * math.cos(at * 0.13)  # noqa: E731
    learned = Memory(capacity=Capacity(prefill_tokens_per_s=PREFILL_ENGINE_TOKENS_PER_S))
    history = run(policy(scale_down_window_s=300.0), [plant(lambda at: 24_000.0 * jitter(at + 3.0), lambda at: 300_000.0, jitter)] * 80,
                  {"prefill": 4, "decode": 3}, learned)  # fmt: skip
    assert set(sizes_over(history)) == {(4, 3)}, sizes_over(history)


def test_idle_shrinks_to_the_minimum_once_the_scale_down_window_passed_by_a_bounded_step() -> None:
    history = run(policy(scale_down_window_s=60.0), [plant(lambda at: 0.0, lambda at: 0.0)] * 8, {"prefill": 4, "decode": 4})
    sizes = sizes_over(history)
    assert sizes[:4] == [(4, 4)] * 4, "the window has not passed"
    assert sizes[4:] == [(1, 1)] * 4, sizes
    stepped = sizes_over(run(policy(scale_down_window_s=60.0, max_step=1), [plant(lambda at: 0.0, lambda at: 0.0)] * 8, {"prefill": 4, "decode": 4}))
    assert stepped[3:] == [(4, 4), (3, 3), (2, 2), (1, 1), (1, 1)], stepped


def test_a_shrink_waits_one_window_also_when_the_intervals_drift() -> None:
    """The operator's passes are not exactly an interval apart (a pass takes its time): an idle model shrinks once
    the scale-down window has passed all the same, not never (the window counts as covered by a recommendation at
    least a window old)."""
    idle = plant(lambda at: 0.0, lambda at: 0.0)
    memory, sizes, seen = Memory(), {"prefill": 4, "decode": 4}, []
    for i in range(10):
        decision, memory = decide(policy(scale_down_window_s=60.0), idle(i * (INTERVAL + 0.37), sizes), memory)
        sizes = dict(decision.sizes)
        seen.append((sizes["prefill"], sizes["decode"]))
    assert seen[:4] == [(4, 4)] * 4 and seen[-1] == (1, 1), seen


def test_the_specs_max_step_bounds_how_far_a_role_grows_in_one_decision() -> None:
    """80k prompt tokens/s on one prefill engine (still warming: it teaches nothing) of a learned 10k: ten engines
    are needed; it grows by the spec's step."""
    spec = {"ttftMilliseconds": 2000, "tpotMilliseconds": 50, "prefill": {"maxEngines": 16}, "decode": {"maxEngines": 16}}
    memory = Memory(capacity=Capacity(prefill_tokens_per_s=PREFILL_ENGINE_TOKENS_PER_S))
    obs = observation(0.0, role(1, warm=0, waiting=50.0), role(4), requests=600, ttft_s=9.0, prefill_leg_s=8.5, tpot_s=0.03,
                      prefill_tokens=80_000.0 * INTERVAL)  # fmt: skip
    grown = {}
    for step in (None, 8):
        pol = policy_of(ModelAutoscalingSpec.model_validate(spec | ({"maxStepEngines": step} if step else {})), {"prefill": 1, "decode": 1})
        grown[step] = decide(pol, obs, memory)[0].sizes["prefill"]
    assert grown == {None: 1 + 4, 8: 1 + 8}


def test_a_rollout_freezes_the_sizes() -> None:
    obs = observation(0.0, role(2, waiting=40.0), role(2), ttft_s=9.0, prefill_leg_s=8.0, rolling_out=True)
    decision, memory = decide(policy(), obs, Memory())
    assert dict(decision.sizes) == {"prefill": 2, "decode": 2} and "rollout" in decision.reasons["prefill"]
    assert memory.recommendations == (), "what a rollout saw recommends nothing for later"
    assert decide(policy(), replace(obs, rolling_out=False), Memory())[0].sizes["prefill"] > 2


def test_unschedulable_engines_block_growth_and_say_why_but_not_shrinking() -> None:
    starved = observation(0.0, role(3, warm=2, unschedulable=1, unschedulable_reason="0/8 nodes: Insufficient nvidia.com/gpu",
                                    waiting=30.0), role(2), requests=300, ttft_s=9.0, prefill_leg_s=8.5, prefill_tokens=300_000.0)  # fmt: skip
    decision, _ = decide(policy(), starved, Memory())
    assert decision.sizes["prefill"] == 3 and decision.blocked and "Insufficient nvidia.com/gpu" in decision.blocked
    idle = observation(0.0, role(3, warm=2, unschedulable=1, unschedulable_reason="no GPU"), role(2))
    decision, _ = decide(policy(scale_down_window_s=0.0), idle, Memory())
    assert decision.sizes["prefill"] == 1, "a starved role still gives back what it does not need (dynamo#14251)"


def test_warming_engines_teach_nothing() -> None:
    """New engines' first passes are slow (dynamo#12430): an interval where none is warm leaves capacity as it was."""
    cold = observation(0.0, role(4, warm=0, waiting=40.0), role(4, warm=0, kv_tokens=50_000.0), ttft_s=3.0, tpot_s=0.2,
                       prefill_tokens=10_000.0)  # fmt: skip
    assert learn(Capacity(), cold) == Capacity()


def test_a_growing_queue_is_not_taken_for_capacity() -> None:
    """The routers count prompt tokens as they send them: while the queue grows by 30 requests of 2k tokens, two
    engines that sent 900k tokens in 15 s computed 840k of them, 28k tokens/s each, not 30k."""
    queued = observation(0.0, role(2, waiting=40.0), role(2), requests=450, ttft_s=6.0, prefill_leg_s=5.5, prefill_tokens=900_000.0)
    assert learn(Capacity(), queued, waiting_before=10.0).prefill_tokens_per_s == 28_000.0
    assert learn(Capacity(), queued).prefill_tokens_per_s == 30_000.0, "a queue that did not grow: what was sent was computed"


def test_a_queue_at_one_end_of_the_interval_is_chance_not_the_engines_limit() -> None:
    """A prompt waiting as the gauge is read, after an interval that began with none: what the engine did is what
    it was sent (a floor), not what it can do. Queued at both ends, it is."""
    light = observation(0.0, role(1, waiting=1.0), role(2), requests=30, ttft_s=0.3, prefill_leg_s=0.2, prefill_tokens=60_000.0)
    chance = learn(Capacity(), light, waiting_before=0.0)
    assert chance.prefill_tokens_per_s is None and chance.prefill_floor == 58_000.0 / 15, "the queue's growth taken off"
    assert learn(Capacity(), light, waiting_before=1.0).prefill_tokens_per_s == 4_000.0


def test_while_young_engines_serve_the_prompts_sent_are_not_a_warm_engines_capacity() -> None:
    """Two warm engines of eight serving, every one queued: the 1.2M tokens sent were eight engines' work, not
    two's (read as two's, it was four times an engine's). Once only warm engines serve, it is theirs."""
    ramp = observation(0.0, role(8, warm=2, ready=8, waiting=40.0), role(2), requests=600, ttft_s=6.0, prefill_leg_s=5.5,
                       prefill_leg_mean_s=4.0, prefill_tokens=1_200_000.0)  # fmt: skip
    assert learn(Capacity(), ramp, waiting_before=40.0) == Capacity()
    asked = replace(ramp, prefill=replace(ramp.prefill, ready=2))  # six asked for, none serving yet
    assert learn(Capacity(), asked, waiting_before=40.0).prefill_tokens_per_s == 40_000.0


def test_a_prompts_leg_bounds_what_an_engine_computes_at_any_load() -> None:
    """At light load no queue shows an engine's limit, but each leg is at least its prompt's compute: 2k tokens
    in a 0.25 s leg on average (30 legs: the other 10 requests' prompts decode prefilled itself), so an engine
    computes at least 8k tokens/s. Growth sizes on it: 60k tokens/s sent to one engine need 10 (at 80 % each)."""
    light = observation(0.0, role(1), role(2), requests=40, ttft_s=0.4, prefill_leg_s=0.3, prefill_leg_mean_s=0.25,
                        prefill_legs=30, prefill_tokens=60_000.0)  # fmt: skip
    learned = learn(Capacity(), light, waiting_before=0.0)
    assert learned.prefill_leg_tokens_per_s == 8_000.0 and learned.prefill_tokens_per_s is None
    assert learned.prefill_engine_tokens_per_s == 8_000.0
    queued = replace(light, prefill=role(1, waiting=3.0))
    assert learn(Capacity(), queued, waiting_before=3.0).prefill_leg_tokens_per_s is None, "a queue lengthens the leg"
    busy = observation(0.0, role(1), role(2), requests=450, ttft_s=0.4, prefill_leg_s=0.3, prefill_leg_mean_s=0.25,
                       prefill_legs=450, prefill_tokens=900_000.0)  # fmt: skip
    decision, _ = decide(policy(max_step=16, prefill=RoleBounds(1, 16, 1)), busy, Memory(capacity=learned))
    assert decision.sizes["prefill"] == 10, decision


def test_decode_grows_with_the_prompts_prefill_takes_in_before_its_kv_fills() -> None:
    """P and D decided together: decode has held 10 s of the prompts (Little's law, learned on a steady load); the
    prompts triple and decode is sized for the KV they will hold while its KV and TPOT still look calm."""
    pol = policy(tpot_s=1.0)
    steady = observation(0.0, role(2), role(2, kv_tokens=100_000.0), requests=75, ttft_s=0.3, prefill_leg_s=0.2, tpot_s=0.03,
                         prefill_tokens=10_000.0 * INTERVAL)  # fmt: skip
    memory = Memory()
    for i in range(2):
        decision, memory = decide(pol, replace(steady, at=i * INTERVAL), memory)
    assert memory.capacity.decode_residence_s == 10.0 and decision.sizes["decode"] == 2
    surge = replace(steady, at=2 * INTERVAL, prefill=role(6), prefill_tokens=30_000.0 * INTERVAL, requests=225)
    decision, memory = decide(pol, surge, memory)
    assert decision.sizes["decode"] >= math.ceil(300_000 / (0.9 * KV_CAPACITY * 0.8)) > 2, decision
    assert decision.estimates["decode_kv_tokens_forecast"] >= 300_000
    assert memory.capacity.decode_residence_s == 10.0, "while the rate moves, decode's KV lags it: nothing learned"


def test_a_rising_load_is_met_ahead_of_the_miss() -> None:
    """Prompts grow by 500 tokens/s every interval: the trend, projected a warm-up ahead, sizes prefill above
    what the current rate alone needs, while TTFT still meets the target."""
    pol = policy(warmup_s=120.0)
    memory = Memory(capacity=Capacity(prefill_tokens_per_s=PREFILL_ENGINE_TOKENS_PER_S))
    decision = None
    for i in range(8):
        rate = 10_000.0 + 500.0 * i
        obs = observation(i * INTERVAL, role(4), role(2), requests=100, ttft_s=0.5, prefill_leg_s=0.4, tpot_s=0.03,
                          prefill_tokens=rate * INTERVAL)  # fmt: skip
        decision, memory = decide(pol, obs, memory)
    assert decision is not None
    now_needs = math.ceil(rate / (PREFILL_ENGINE_TOKENS_PER_S * 0.8))
    assert decision.estimates["prefill_tokens_per_s_forecast"] > rate
    assert decision.sizes["prefill"] >= now_needs


def test_an_accelerating_ramp_is_followed_by_its_recent_trend() -> None:
    """Prompts grow ever faster (10k + 100 i^2 tokens/s at interval i), as a sinusoid leaving its trough: a line
    over the whole trend window lags it (19.8k a warm-up ahead), the last RECENT_TREND_S's line does not."""
    pol = policy(warmup_s=120.0)
    memory = Memory(capacity=Capacity(prefill_tokens_per_s=PREFILL_ENGINE_TOKENS_PER_S))
    decision = None
    for i in range(8):
        rate = 10_000.0 + 100.0 * i * i
        obs = observation(i * INTERVAL, role(4), role(2), requests=100, ttft_s=0.5, prefill_leg_s=0.4, tpot_s=0.03,
                          prefill_tokens=rate * INTERVAL)  # fmt: skip
        decision, memory = decide(pol, obs, memory)
    assert decision is not None
    assert decision.estimates["prefill_tokens_per_s_forecast"] >= 22_000
    assert decision.sizes["prefill"] >= math.ceil(22_000 / (PREFILL_ENGINE_TOKENS_PER_S * 0.8))


def test_a_ramp_back_to_a_rate_already_met_is_not_projected_past_it_and_new_ground_is() -> None:
    """Prompts held 30k tokens/s for a minute, fell to 10k for four, and now climb 2k an interval, as a sinusoid's
    next ramp (decode's KV ten times the rate, in step): the trend a warm-up ahead says 40k (400k KV tokens), what
    was held says 30k (300k). A model that never held 30k projects the same ramp in full. A little above what was
    held (31k) is a swing of the load, projected no higher than itself; well above it (37k), the trend stands."""
    pol = policy(warmup_s=120.0)
    learned = Memory(capacity=Capacity(prefill_tokens_per_s=PREFILL_ENGINE_TOKENS_PER_S))

    def fed(memory: Memory, rates: list[float], start: int = 0) -> tuple[dict[str, float], Memory]:
        decision = None
        for i, rate in enumerate(rates, start):
            obs = observation(i * INTERVAL, role(4), role(2, kv_tokens=10 * rate), requests=100, ttft_s=0.5,
                              prefill_leg_s=0.4, tpot_s=0.03, prefill_tokens=rate * INTERVAL)  # fmt: skip
            decision, memory = decide(pol, obs, memory)
        assert decision is not None
        return dict(decision.estimates), memory

    earlier = [30_000.0] * 4 + [10_000.0] * 16
    ramp = [10_000.0 + 2_000.0 * i for i in range(1, 8)]  # to 24k
    seen, memory = fed(learned, earlier + ramp)
    assert seen["prefill_tokens_per_s_forecast"] == 30_000.0 and seen["decode_kv_tokens_forecast"] == 300_000.0, seen
    unseen, _ = fed(learned, ramp, start=len(earlier))
    assert unseen["prefill_tokens_per_s_forecast"] >= 38_000.0 and unseen["decode_kv_tokens_forecast"] >= 380_000.0, unseen
    swing, _ = fed(memory, [31_000.0], start=len(earlier + ramp))
    assert swing["prefill_tokens_per_s_forecast"] == 31_000.0 and swing["decode_kv_tokens_forecast"] == 310_000.0, swing
    beyond, _ = fed(memory, [31_000.0, 34_000.0, 37_000.0], start=len(earlier + ramp))
    assert beyond["prefill_tokens_per_s_forecast"] >= 40_000.0 and beyond["decode_kv_tokens_forecast"] >= 400_000.0, beyond


def test_a_swing_of_decodes_kv_with_the_prompts_flat_is_not_projected_a_warm_up_ahead() -> None:
    """The prompts flat, decode's KV swings around 300k for two minutes and rises 260k -> 400k in the last 45 s
    (longer answers by chance): three engines hold it. Projected a warm-up ahead, that rise alone would ask for
    786k (six engines); decode's forecast is the trend window's line, which a sustained rise still moves."""
    pol = policy(tpot_s=1.0, warmup_s=120.0, scale_down_window_s=300.0)
    memory, decision = Memory(), None
    for i, kv in enumerate((300, 340, 280, 320, 300, 260, 300, 360, 400)):
        obs = observation(i * INTERVAL, role(2), role(3, kv_tokens=kv * 1_000.0), requests=75, ttft_s=0.3, prefill_leg_s=0.2,
                          tpot_s=0.03, prefill_tokens=10_000.0 * INTERVAL)  # fmt: skip
        decision, memory = decide(pol, obs, memory)
    assert decision is not None
    assert 400_000 <= decision.estimates["decode_kv_tokens_forecast"] < 0.9 * KV_CAPACITY * 0.8 * 3, decision.estimates
    assert decision.sizes["decode"] == 3, decision


@settings(max_examples=300, deadline=None)
@given(policies(), st.lists(st.integers(0, 100), min_size=1, max_size=6).flatmap(
    lambda gaps: st.tuples(*[observations(at=15.0 * sum(gaps[: i + 1])) for i in range(len(gaps))])))
def test_never_outside_the_bounds_or_the_budget(pol, intervals) -> None:
    memory = Memory()
    for obs in intervals:
        decision, memory = decide(pol, obs, memory)
        if obs.rolling_out:
            assert dict(decision.sizes) == {r: obs.role(r).current for r in ROLES}
            continue
        for r in ROLES:
            b = pol.bounds(r)
            assert b.min_engines <= decision.sizes[r] <= b.max_engines, (r, decision)
            grew = decision.sizes[r] - obs.role(r).current
            assert grew <= max(pol.max_step, b.min_engines - obs.role(r).current) or pol.min_accelerators, (r, decision)
        used = sum(decision.sizes[r] * pol.bounds(r).accelerators for r in ROLES)
        if pol.max_accelerators is not None:
            assert used <= pol.max_accelerators, decision
