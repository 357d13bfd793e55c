"""The SLO autoscaler's decision: how many prefill and decode engines a model should run next, decided together
from what its routers measured, inside the model's engine bounds and accelerator budget (issue 32).

Pure, like rollout.py and retirement.py: an :class:`Observation` of one interval and the :class:`Memory` of the
earlier ones in, a :class:`Decision` and the next memory out. The I/O (reading the routers, writing the
DisaggregatedRoles' scale) is not here.

**What it sees** (per interval, summed over the model's routers): the TTFT and TPOT percentile of the targets,
the prefill leg's percentile and mean (queue + compute on prefill, which is what every engine-side autoscaler
misses, ai-dynamo/dynamo#10528), the uncached prompt tokens sent to prefill, and the engines' own gauges:
requests waiting for room, KV tokens in use on decode. Engines younger than the warm-up, and engines that are not
scheduled, are not capacity (dynamo#12430, #14251).

**What it learns** (:class:`Capacity`), online, from warm engines only (an interval in which a younger engine
served teaches prefill nothing: the routers' tokens and legs are every serving engine's):
- prefill: uncached prompt tokens per second one engine computes, the higher of two lower bounds: from
  intervals where every engine had a queue at both ends, what they computed (the queue's growth taken off what
  the routers sent); and, with no queue, a prompt's tokens over the prefill legs' mean (a leg is at least its
  prompt's compute). An engine that never queues also says it can do at least what it was sent (for shrinking);
- decode: TPOT as a line in KV tokens per engine (least squares over the recent intervals), so the KV tokens one
  engine may hold at the TPOT target are (target - intercept) / slope, never above the KV it has;
- decode's residence: the KV tokens it holds per prompt token/s sent to prefill (Little's law, on a steady load).

**How it decides**, per role, the larger of:
- *model*: the demand (prefill tokens/s; decode KV tokens) over what one engine can do at the target, with
  headroom; the demand is the larger of now and the trend over the last minutes projected one warm-up ahead
  (predictive: a rise is met ahead, and a shrink goes no lower; prefill's trend is the higher of a line over the
  trend window and one over its last RECENT_TREND_S, so an accelerating ramp is followed; decode's KV trend is
  the window's line alone: a ramp of prompts reaches decode through P and D together, below, and the KV's own
  last seconds swing with the answers' lengths; either projected no higher than the highest it held before the
  trend window within PEAK_MEMORY_S, or now, until it is NEW_GROUND above that);
- *reactive*: a role whose own signal misses its target (prefill: TTFT over target while the prefill leg takes
  most of it, or requests waiting on prefill; decode: TPOT over target, KV nearly full, the TTFT of the
  prompts it prefills itself over target, or TTFT over target with requests waiting on decode and the prefill
  leg less than half of it) grows by a step
  proportional to the miss, whatever the model says.
P and D are decided together: decode's demand includes the prompts prefill takes in times decode's residence, so
a surge grows decode before its KV fills. A role shrinks only when its signal is well under target (decode's
TPOT: measured from an idle engine's step), to the fewest engines that run the demand below the headroom
(consolidation-aware, dynamo#9294), and no lower than any recommendation of the scale-down window (hysteresis: no
2<->1 flapping on a steady load; the window forgets decode's recommendations made before every decode engine
was first warm, the guesses of a cold start). Either way a role moves by at most `max_step` engines per interval.

**The budget**: bounds first, then, when the engines' accelerators exceed the budget, the role whose target is
less missed gives up engines first (its pressure: measured / target), down to its minimum; below the budget's
minimum, the role under more pressure gets the engines.

**Frozen**: during a rollout the sizes stay (scale after it); a role with unschedulable engines does not grow
(it is blocked, and says the scheduler's reason) but may shrink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping

from disagg_connector import contract
from disagg_connector.contract.health import BackendRouting

from .router_readings import Interval
from .state import Census, Obj, RouterView

if TYPE_CHECKING:
    from .api.models import ModelAutoscalingSpec

ROLES = tuple(contract.ENGINE_ROLES)  # ("prefill", "decode")

# Run engines at most this busy at the target: the rest absorbs the noise of arrivals.
HEADROOM = 0.8
# A role's signal must be this far under its target before the role may shrink.
SHRINK_BELOW = 0.7
# The prefill leg's share of TTFT above which a TTFT miss is prefill's (below it, the KV wait or the decode's
# first token dominate, which more prefill engines would not cure).
PREFILL_SHARE = 0.5
# KV in use on decode (of what the engines have) above which decode grows whatever TPOT says.
KV_FULL = 0.9
# Intervals of (KV tokens per engine, TPOT) kept for the decode line.
DECODE_POINTS = 32
# Weight of a new prefill capacity (or decode residence) reading.
LEARN_RATE = 0.3
# Seconds in which prefill should work off the prompts waiting on it, on top of the arrivals.
BACKLOG_DRAIN_S = 60.0
# The trend of the last this many seconds counts too: a ramp that accelerates (a sinusoid leaving its trough)
# outruns a line fitted over the whole trend window (bench/results/autoscale-sim.md).
RECENT_TREND_S = 45.0
# How long the demand (prefill's rate, decode's KV) is remembered. While it is below the highest it held before
# the trend window, its trend is projected no higher than that: a climb back to a level already held is not
# projected past it (a sinusoid's next ramp, projected in a line, asked for nearly twice its peak:
# bench/results/autoscale-sim.md). Well above it (NEW_GROUND) is new ground, projected in full.
PEAK_MEMORY_S = 3600.0
# A level is new ground once it is this much above the highest held; until then the forecast is no higher than
# the level held or now, whichever is higher. An interval's rate at the sine's peak swings by about 6 %: one
# interval 2.6 % above the 389k prompt tokens/s the first peak held, taken for new ground, was projected to 600k.
NEW_GROUND = 0.2


@dataclass(frozen=True)
class RoleBounds:
    min_engines: int
    max_engines: int
    accelerators: int  # per engine (all its pods)


@dataclass(frozen=True)
class Policy:
    """spec.autoscaling resolved: targets in seconds, bounds in engines, the budget in accelerators."""

    ttft_s: float
    tpot_s: float
    prefill: RoleBounds
    decode: RoleBounds
    min_accelerators: int = 0
    max_accelerators: int | None = None
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    trend_window_s: float = 120.0
    warmup_s: float = 120.0
    max_step: int = 4  # engines a role may grow or shrink by in one interval
    advisory: bool = False

    def bounds(self, role: str) -> RoleBounds:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class RoleObservation:
    """One role's engines as the operator and the routers saw them in the interval."""

    current: int  # the role's size now (its DisaggregatedRole's replicas)
    warm: int  # engines ready for longer than the warm-up: the capacity
    unschedulable: int = 0  # engines the scheduler cannot place
    unschedulable_reason: str = ""
    # requests waiting for room on the role's engines at the routers' last read, summed over engines (vLLM's reason
    # "capacity": not a decode waiting on its remote KV, which it does on every request until the KV lands)
    waiting: float = 0.0
    kv_tokens: float = 0.0  # KV tokens in use on the role's engines (decode)
    kv_capacity: float = 0.0  # KV tokens one engine holds (decode)
    # Engines serving, warm or not, seen two ways, each where it is the right count: `kv_engines` from the routers'
    # reads (the engines whose KV kv_tokens sums: a new pod the routers read before the census lists it counts),
    # `ready` from the census (the engines whose work the routers' tokens and legs include). 0: as many as are warm.
    kv_engines: int = 0
    ready: int = 0


@dataclass(frozen=True)
class Observation:
    at: float  # seconds (monotonic or epoch: only differences count)
    seconds: float  # the interval's length
    prefill: RoleObservation
    decode: RoleObservation
    requests: int = 0  # requests that got their first token in the interval
    ttft_s: float | None = None  # the targets' percentile; None: no request
    tpot_s: float | None = None
    prefill_leg_s: float | None = None  # the same percentile of the prefill leg (queue + compute)
    prefill_leg_mean_s: float | None = None  # the prefill legs' mean
    prefill_legs: int = 0  # prefill legs that ended in the interval (a prompt decode prefilled itself has none)
    prefill_tokens: float = 0.0  # uncached prompt tokens sent to prefill in the interval
    rolling_out: bool = False
    local_ttft_s: float | None = None  # the percentile of TTFT of prompts decode prefilled itself (below the
    # router's disaggregation threshold): decode's work, which more prefill engines would not speed up

    def role(self, role: str) -> RoleObservation:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class Capacity:
    """What one warm engine of each role does, learned."""

    prefill_tokens_per_s: float | None = None  # None: never seen prefill queue
    prefill_floor: float = 0.0  # the most one engine was seen doing without queueing: capacity is at least this
    # A prompt's uncached tokens over its prefill leg, averaged while prefill had no queue: the leg is the prompt's
    # compute and its hand-off, so this is at most what an engine computes, and it is read at any load.
    prefill_leg_tokens_per_s: float | None = None
    decode_points: tuple[tuple[float, float], ...] = ()  # (KV tokens per engine, TPOT s), newest last
    # KV tokens decode holds per prompt token/s sent to prefill (Little's law: how long a prompt's KV stays on
    # decode, history included): what the prompts prefill takes in now will hold on decode a moment later.
    decode_residence_s: float | None = None

    @property
    def prefill_engine_tokens_per_s(self) -> float | None:
        """What one prefill engine computes, as far as known: the queue's throughput and the prompts' legs are both
        at most that, so the higher of them (None: neither seen)."""
        return max((c for c in (self.prefill_tokens_per_s, self.prefill_leg_tokens_per_s) if c is not None), default=None)

    def decode_line(self) -> tuple[float, float] | None:
        """(intercept, slope) of TPOT against KV tokens per engine, or None until the points spread."""
        pts = self.decode_points
        if len(pts) < 3:
            return None
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        if sxx <= (0.05 * mx) ** 2 * n:  # the load never moved: no slope to read
            return None
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        if slope <= 0:
            return None
        return my - slope * mx, slope


@dataclass(frozen=True)
class Memory:
    """What the decision keeps between intervals."""

    capacity: Capacity = field(default_factory=Capacity)
    # (at, prefill, decode) within the longer window; None: a role's recommendation forgotten (see `decide`)
    recommendations: tuple[tuple[float, int | None, int | None], ...] = ()
    demand: tuple[tuple[float, float, float], ...] = ()  # (at, prefill tokens/s, decode KV tokens) within the trend window
    prefill_waiting: float = 0.0  # requests waiting on prefill at the last interval's end
    decode_warmed: bool = False  # every decode engine has been warm at once (once is enough: the cold start is over)
    held: tuple[tuple[float, float, float], ...] = ()  # (at, prefill tokens/s, decode KV tokens) within PEAK_MEMORY_S


@dataclass(frozen=True)
class Decision:
    sizes: Mapping[str, int]  # role -> engines
    reasons: Mapping[str, str]  # role -> why, in words
    blocked: str | None = None  # a role that cannot grow, and why (AutoscalerBlocked)
    estimates: Mapping[str, float] = field(default_factory=dict)  # for status and metrics

    def changes(self, obs: Observation) -> bool:
        return any(self.sizes[r] != obs.role(r).current for r in ROLES)


# --- learning -----------------------------------------------------------------------------------------


def _tokens_per_request(obs: Observation) -> float:
    """Uncached prompt tokens of a request, as this interval's prompts averaged (0 without requests)."""
    return obs.prefill_tokens / obs.requests if obs.requests else 0.0


def learn(capacity: Capacity, obs: Observation, waiting_before: float | None = None, rate_before: float | None = None) -> Capacity:
    """The capacity after this interval: only warm engines' work counts. `waiting_before`: the requests waiting
    on prefill at the previous interval's end (None: as many as now); `rate_before`: the prompt tokens/s of the
    previous interval (None: unknown, and decode's residence is not learned).

    The routers count prompt tokens when they send them, so while a queue grows the engines computed less than
    was sent: the growth of the queue (in requests, at this interval's tokens per request) is taken off."""
    p, d = obs.prefill, obs.decode
    out = capacity
    before = p.waiting if waiting_before is None else waiting_before
    grew = max(p.waiting - before, 0.0)
    computed = obs.prefill_tokens - grew * _tokens_per_request(obs)
    # The tokens and the legs are every serving engine's: while engines younger than the warm-up serve too, what a
    # warm one did is unknown (the tokens over the warm ones alone read twice an engine's in a sine's ramp).
    only_warm = p.warm > 0 and (p.ready or p.warm) <= p.warm
    if only_warm and obs.seconds > 0 and computed > 0:
        per_engine = computed / obs.seconds / p.warm
        # Every engine had a queue at both ends of the interval: what they did is what they can do. (One end is
        # chance: a prompt that arrived just before the gauge was read says nothing of the engine's limit.)
        if min(p.waiting, before) >= p.warm:
            known = out.prefill_tokens_per_s
            out = replace(out, prefill_tokens_per_s=per_engine if known is None else known + LEARN_RATE * (per_engine - known))
        else:
            out = replace(out, prefill_floor=max(out.prefill_floor, per_engine))
    # A leg is its prompt's queue, compute and hand-off: read where prefill had no queue at either end.
    unqueued = max(p.waiting, before) < max(p.warm, 1)
    if only_warm and unqueued and obs.prefill_leg_mean_s and obs.prefill_legs and obs.prefill_tokens > 0:
        leg_rate = obs.prefill_tokens / obs.prefill_legs / obs.prefill_leg_mean_s
        known = out.prefill_leg_tokens_per_s
        out = replace(out, prefill_leg_tokens_per_s=leg_rate if known is None else known + LEARN_RATE * (leg_rate - known))
    if d.warm and d.current == d.warm and obs.tpot_s is not None and d.kv_tokens > 0:
        out = replace(out, decode_points=(*out.decode_points, (d.kv_tokens / d.warm, obs.tpot_s))[-DECODE_POINTS:])
    # Little's law holds on a steady load only: nothing queued on either role, the prompts' rate as before (while
    # it moves, decode's KV lags it)
    rate = obs.prefill_tokens / obs.seconds if obs.seconds > 0 else 0.0
    steady = p.waiting < max(p.warm, 1) and d.waiting < 1 and grew == 0 and rate_before is not None and abs(rate - rate_before) <= 0.2 * rate
    if steady and d.warm and rate > 0 and d.kv_tokens > 0:
        residence = d.kv_tokens / rate
        known = out.decode_residence_s
        out = replace(out, decode_residence_s=residence if known is None else known + LEARN_RATE * (residence - known))
    return out


def _forecast(points: tuple[tuple[float, float], ...], ahead: float) -> float | None:
    """The larger of the trend over all POINTS and over the last RECENT_TREND_S of them, `ahead` past the last."""
    recent = tuple(p for p in points if points[-1][0] - p[0] <= RECENT_TREND_S)
    found = [f for f in (_trend(points, ahead), _trend(recent, ahead)) if f is not None]
    return max(found) if found else None


def _within_held(forecast: float | None, now: float, earlier: list[float]) -> float | None:
    """FORECAST no higher than the highest of EARLIER (the values held before the trend window), or NOW where that
    is higher, until NOW is NEW_GROUND above it: a climb back to a level already held is not projected past it."""
    held = max(earlier, default=0.0)
    return min(forecast, max(held, now)) if forecast is not None and now < held * (1 + NEW_GROUND) else forecast


def _trend(points: tuple[tuple[float, float], ...], ahead: float) -> float | None:
    """The least-squares line through (at, value) projected `ahead` past the last point; None with < 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mt, mv = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    stt = sum((t - mt) ** 2 for t, _ in points)
    if stt == 0:
        return None
    slope = sum((t - mt) * (v - mv) for t, v in points) / stt
    return mv + slope * (points[-1][0] + ahead - mt)


# --- the decision ---------------------------------------------------------------------------------------


def _engines_for(demand: float, per_engine: float | None) -> int:
    """Engines that serve `demand` at HEADROOM of `per_engine` each (0 without a capacity; a bound far above any
    role's maximum where a tiny learned capacity would make it infinite)."""
    if not per_engine or per_engine <= 0 or demand <= 0:
        return 0
    return math.ceil(min(demand / (per_engine * HEADROOM), 1e6))


def _prefill_bound(obs: Observation) -> bool:
    """Whether the prefill leg is most of TTFT (PREFILL_SHARE): a miss more prefill engines would cure."""
    return obs.prefill_leg_s is not None and bool(obs.ttft_s) and obs.prefill_leg_s >= PREFILL_SHARE * obs.ttft_s  # type: ignore[operator]


def _prefill_need(policy: Policy, obs: Observation, cap: Capacity, demand: float) -> tuple[int, str]:
    """Engines prefill needs, and why. Growth trusts only a capacity seen under a queue or read from the prompts'
    legs; shrinking may also use the most an engine was seen doing (a lower bound, so it errs on keeping engines)."""
    p = obs.prefill
    known = cap.prefill_engine_tokens_per_s
    model = _engines_for(demand, known)
    ttft_miss = obs.ttft_s is not None and obs.ttft_s > policy.ttft_s
    if ttft_miss and (_prefill_bound(obs) or p.waiting >= max(p.warm, 1)):
        miss = obs.ttft_s / policy.ttft_s  # type: ignore[operator]
        grown = p.current + min(policy.max_step, max(1, math.ceil(p.current * min(miss - 1, 1.0))))
        return max(grown, model), f"TTFT p {obs.ttft_s:.2f}s over the {policy.ttft_s:.2f}s target, the prefill leg {obs.prefill_leg_s or 0:.2f}s of it"
    if model > p.current:
        return model, f"{demand:.0f} prompt tokens/s need {model} engines at {known:.0f} tokens/s each"
    at_least = max(known or 0.0, cap.prefill_floor)
    if (obs.ttft_s is None or obs.ttft_s < SHRINK_BELOW * policy.ttft_s) and p.current > 1 and p.waiting < 1:
        # consolidation-aware: the engines kept would still run under the headroom
        if at_least and (fewer := max(_engines_for(demand, at_least), 1)) < p.current:
            return fewer, f"TTFT well under target and {fewer} engines hold {demand:.0f} prompt tokens/s"
        if demand == 0 and obs.requests == 0:
            return 1, "no requests"
    return p.current, "on target"


def _calm_tpot(policy: Policy, line: tuple[float, float] | None) -> float:
    """TPOT under which decode may shrink: SHRINK_BELOW of the way from an idle engine's step (the decode line's
    intercept) to the target. Load adds only the part above the idle step: where that step is most of the
    target (a small model's 19 ms of 30), TPOT never falls under SHRINK_BELOW of the target itself."""
    idle = line[0] if line and 0 < line[0] < policy.tpot_s else 0.0
    return idle + SHRINK_BELOW * (policy.tpot_s - idle)


def _decode_need(policy: Policy, obs: Observation, cap: Capacity, demand: float) -> tuple[int, str]:
    d = obs.decode
    line = cap.decode_line()
    ceiling = KV_FULL * d.kv_capacity if d.kv_capacity else math.inf
    per_engine = min((policy.tpot_s - line[0]) / line[1], ceiling) if line else (ceiling if ceiling < math.inf else None)
    model = _engines_for(demand, per_engine)
    tpot_miss = obs.tpot_s is not None and obs.tpot_s > policy.tpot_s
    # Full against the engines that hold the KV: new engines serve (and fill) before they are warm.
    holders = d.kv_engines or d.warm
    kv_full = d.kv_capacity > 0 and holders > 0 and d.kv_tokens >= KV_FULL * d.kv_capacity * holders
    local_miss = obs.local_ttft_s is not None and obs.local_ttft_s > policy.ttft_s
    # TTFT missed while requests wait on decode and the prefill leg is not most of it: decode admits too slowly
    queued = obs.ttft_s is not None and obs.ttft_s > policy.ttft_s and d.waiting >= max(d.warm, 1) and not _prefill_bound(obs)
    if tpot_miss or kv_full or local_miss or queued:
        misses = []  # (how far off, why)
        if queued:
            misses.append((obs.ttft_s / policy.ttft_s, f"TTFT p {obs.ttft_s:.2f}s over the {policy.ttft_s:.2f}s target with "  # type: ignore[operator]
                           f"{d.waiting:.0f} requests waiting on decode"))  # fmt: skip
        if tpot_miss:
            misses.append((obs.tpot_s / policy.tpot_s, f"TPOT p {obs.tpot_s:.3f}s over the {policy.tpot_s:.3f}s target"))  # type: ignore[operator]
        if kv_full:
            misses.append((d.kv_tokens / (KV_FULL * d.kv_capacity * holders), "KV nearly full"))
        if local_miss:
            misses.append((obs.local_ttft_s / policy.ttft_s, f"TTFT p {obs.local_ttft_s:.2f}s of the prompts decode "  # type: ignore[operator]
                           f"prefills itself over the {policy.ttft_s:.2f}s target"))  # fmt: skip
        miss, why = max(misses)
        grown = d.current + min(policy.max_step, max(1, math.ceil(d.current * min(miss - 1, 1.0))))
        return max(grown, model), why
    if model > d.current:
        return model, f"{demand:.0f} KV tokens need {model} engines at {per_engine:.0f} each within the TPOT target"
    local_calm = obs.local_ttft_s is None or obs.local_ttft_s < SHRINK_BELOW * policy.ttft_s
    if (obs.tpot_s is None or obs.tpot_s < _calm_tpot(policy, line)) and local_calm and d.current > 1:
        if per_engine and (fewer := max(model, 1)) < d.current:
            return fewer, f"TPOT well under target and {fewer} engines hold {demand:.0f} KV tokens"
        if not per_engine and obs.requests == 0 and demand == 0:
            return 1, "no requests"
    return d.current, "on target"


def _pressure(policy: Policy, obs: Observation, role: str) -> float:
    """How far the role misses its own target (measured / target; 0 without a reading)."""
    if role == "prefill":
        return (obs.ttft_s or 0.0) / policy.ttft_s
    return max((obs.tpot_s or 0.0) / policy.tpot_s, (obs.local_ttft_s or 0.0) / policy.ttft_s)


def within_budget(policy: Policy, obs: Observation, sizes: dict[str, int]) -> tuple[dict[str, int], str | None]:
    """The sizes clamped to the bounds and the budget; what the budget changed, in words.

    When the wanted sizes exceed the budget, engines are handed out one at a time from the bounds' minimums,
    each to the role further off its target that still wants one and fits (a role's pressure: measured /
    target), then to the other."""
    out = {r: min(max(sizes[r], policy.bounds(r).min_engines), policy.bounds(r).max_engines) for r in ROLES}
    cost = {r: policy.bounds(r).accelerators for r in ROLES}

    def used(s: Mapping[str, int]) -> int:
        return sum(s[r] * cost[r] for r in ROLES)

    most = policy.max_accelerators
    pressed_first = sorted(ROLES, key=lambda r: -_pressure(policy, obs, r))
    note = None
    if most is not None and used(out) > most:
        note = f"the budget of {most} accelerators binds"
        wanted, out = out, {r: policy.bounds(r).min_engines for r in ROLES}
        while True:
            role = next((r for r in pressed_first if out[r] < wanted[r] and used(out) + cost[r] <= most), None)
            if role is None:
                break
            out[role] += 1
    if used(out) < policy.min_accelerators:
        note = f"the budget's minimum of {policy.min_accelerators} accelerators"
        while used(out) < policy.min_accelerators:
            role = next((r for r in pressed_first if out[r] < policy.bounds(r).max_engines
                         and (most is None or used(out) + cost[r] <= most)), None)  # fmt: skip
            if role is None:
                break
            out[role] += 1
    return out, note


def _stabilised(policy: Policy, recommendations: tuple[tuple[float, int | None, int | None], ...], now: float,
                current: Mapping[str, int], wanted: Mapping[str, int]) -> dict[str, int]:  # fmt: skip
    """HPA's rule: grow to the least of the scale-up window's recommendations, shrink to the most of the
    scale-down window's; a move only once the memory covers its whole window and the window agrees."""

    def window(seconds: float, i: int) -> list[int] | None:
        if seconds > 0 and not any(now - rec[0] >= seconds for rec in recommendations):
            return None  # the window is not covered yet (a new operator, a new model)
        return [n for rec in recommendations if now - rec[0] <= seconds and (n := rec[i]) is not None]

    out = {}
    for i, role in enumerate(ROLES, start=1):
        up, down = window(policy.scale_up_window_s, i), window(policy.scale_down_window_s, i)
        if wanted[role] > current[role]:
            out[role] = current[role] if up is None else max(min([*up, wanted[role]]), current[role])
        elif wanted[role] < current[role]:
            out[role] = current[role] if down is None else min(max([*down, wanted[role]]), current[role])
        else:
            out[role] = current[role]
    return out


def decide(policy: Policy, obs: Observation, memory: Memory) -> tuple[Decision, Memory]:
    """The sizes for the next interval, why, and the memory to pass to the next call."""
    capacity = learn(memory.capacity, obs, memory.prefill_waiting, memory.demand[-1][1] if memory.demand else None)
    rate = obs.prefill_tokens / obs.seconds if obs.seconds > 0 else 0.0
    longest = max(policy.scale_up_window_s, policy.scale_down_window_s)
    demand_pts = tuple(p for p in memory.demand if obs.at - p[0] <= policy.trend_window_s) + ((obs.at, rate, obs.decode.kv_tokens),)
    current = {r: obs.role(r).current for r in ROLES}
    forecast_p = _forecast(tuple((t, p) for t, p, _ in demand_pts), policy.warmup_s)
    held = tuple(p for p in memory.held if obs.at - p[0] <= PEAK_MEMORY_S) + ((obs.at, rate, obs.decode.kv_tokens),)
    earlier = tuple(p for p in held if obs.at - p[0] > policy.trend_window_s)
    forecast_p = _within_held(forecast_p, rate, [r for _, r, _ in earlier])
    # Decode's own KV by the trend window's line only: an accelerating ramp of prompts reaches decode through the
    # coupled term below, and the KV's last RECENT_TREND_S swing with the answers' lengths (a chance swing of
    # multi-turn's conversations projected a warm-up ahead asked for 1-3 engines more, held by the scale-down window).
    forecast_d = _within_held(_trend(tuple((t, d) for t, _, d in demand_pts), policy.warmup_s), obs.decode.kv_tokens,
                              [d for _, _, d in earlier])  # fmt: skip
    backlog = obs.prefill.waiting * _tokens_per_request(obs) / BACKLOG_DRAIN_S
    # P and D together: the prompts prefill takes in now are decode's KV one residence later.
    coupled = max(rate, forecast_p or 0.0) * capacity.decode_residence_s if capacity.decode_residence_s else 0.0
    demand = {"prefill": max(rate, forecast_p or 0.0) + backlog, "decode": max(obs.decode.kv_tokens, forecast_d or 0.0, coupled)}
    estimates = {"prefill_tokens_per_s": rate, "prefill_tokens_per_s_forecast": forecast_p or rate,
                 "decode_kv_tokens": obs.decode.kv_tokens, "decode_kv_tokens_forecast": max(forecast_d or obs.decode.kv_tokens, coupled),
                 "prefill_engine_tokens_per_s": capacity.prefill_engine_tokens_per_s or capacity.prefill_floor}  # fmt: skip
    line = capacity.decode_line()
    if line:
        estimates["decode_engine_kv_tokens_at_target"] = (policy.tpot_s - line[0]) / line[1]

    if obs.rolling_out:
        frozen = Decision(current, {r: "frozen: a rollout is in progress (scaling waits for it)" for r in ROLES}, None, estimates)
        return frozen, replace(memory, capacity=capacity, demand=demand_pts, prefill_waiting=obs.prefill.waiting, held=held)

    needs = {"prefill": _prefill_need(policy, obs, capacity, demand["prefill"]),
             "decode": _decode_need(policy, obs, capacity, demand["decode"])}  # fmt: skip
    wanted, budget_note = within_budget(policy, obs, {r: needs[r][0] for r in ROLES})
    # The window is read from the memory as the last interval left it: it still holds a recommendation a window
    # old, which says the window is covered (passes are never exactly an interval apart).
    past = memory.recommendations
    all_warm = 0 < obs.decode.current == obs.decode.warm
    if all_warm and not memory.decode_warmed:
        # Every decode engine is warm for the first time: what decode was recommended before was sized on engines
        # starting or warming (a cold start's steps while its first engines start: 16 engines asked for where 4
        # hold the KV), and the scale-down window would hold that guess for its whole length. Not the first TPOT
        # line: engines that many hold too little KV for their points to spread into one (the fleet model's
        # multi-turn: 16 warm at 292 s, a line at 417 s). It keeps what is sized from now on.
        past = tuple((at, p, None) for at, p, _ in past)
    recs = tuple(r for r in past if obs.at - r[0] <= longest) + ((obs.at, wanted["prefill"], wanted["decode"]),)
    sizes = _stabilised(policy, past, obs.at, current, wanted)
    # a bounded step per interval, both ways
    sizes = {r: min(max(sizes[r], current[r] - policy.max_step), current[r] + policy.max_step) for r in ROLES}
    blocked = None
    reasons = {}
    for role in ROLES:
        o = obs.role(role)
        reason = needs[role][1]
        if sizes[role] > current[role] and o.unschedulable:
            sizes[role] = current[role]
            blocked = f"{role}: {o.unschedulable} engine(s) cannot be scheduled ({o.unschedulable_reason or 'no reason given'}); not growing"
            reason = f"blocked: {reason}"
        elif wanted[role] != needs[role][0] and budget_note:
            reason = f"{reason}; {budget_note}"
        elif sizes[role] == current[role] and wanted[role] != current[role]:
            reason = f"{reason}; waiting out the {'scale-down' if wanted[role] < current[role] else 'scale-up'} window"
        reasons[role] = reason
    final, _ = within_budget(policy, obs, sizes)  # the blocked hold kept within the bounds too
    warmed = memory.decode_warmed or all_warm
    return Decision(final, reasons, blocked, estimates), Memory(capacity, recs, demand_pts, obs.prefill.waiting, warmed, held)


# --- from the model and what a pass saw (still pure) ------------------------------------------------------------


def policy_of(spec: "ModelAutoscalingSpec", accelerators: Mapping[str, int]) -> Policy:
    """spec.autoscaling as the decision takes it; `accelerators`: of one engine per role (its shape)."""
    bounds = {r: RoleBounds(getattr(spec, r).min_engines, getattr(spec, r).max_engines, accelerators[r]) for r in ROLES}
    return Policy(
        ttft_s=spec.ttft_milliseconds / 1000, tpot_s=spec.tpot_milliseconds / 1000,
        prefill=bounds["prefill"], decode=bounds["decode"],
        min_accelerators=spec.accelerators.min, max_accelerators=spec.accelerators.max,
        scale_up_window_s=spec.scale_up_stabilization_seconds, scale_down_window_s=spec.scale_down_stabilization_seconds,
        warmup_s=spec.warmup_seconds, max_step=spec.max_step_engines, advisory=spec.mode == "Advisory",
    )  # fmt: skip


def _epoch(timestamp: str | None) -> float | None:
    try:
        return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp() if timestamp else None
    except ValueError:
        return None


def _ready_since(pod: Obj) -> float | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") == "True":
            return _epoch(c.get("lastTransitionTime"))
    return None


@dataclass(frozen=True)
class Seen:
    """What one pass knows that the observation is made of, besides the routers' interval."""

    revision: str
    census: Census
    targets: Mapping[str, int]  # the roles' sizes now (sizing.targets)
    routers: RouterView | None
    unschedulable: Mapping[str, tuple[int, str]]  # role -> (engines that cannot be scheduled, the scheduler's words)
    rolling_out: bool
    now: float  # epoch seconds


def observe(policy: Policy, seen: Seen, measured: Interval, seconds: float, percentile: int) -> Observation:
    """The decision's observation of one interval: the routers' interval of the current revision, the engines'
    gauges the routers read, and the engines the census counts (warm: every pod Ready for the warm-up)."""
    q = percentile / 100

    def ready_and_warm(role: str) -> tuple[int, int]:
        engines = seen.census.engines(role, seen.revision, ready=True)
        since = [[_ready_since(p.obj) for p in e.pods] for e in engines]
        return len(engines), sum(1 for s in since if all(t is not None and seen.now - t >= policy.warmup_s for t in s))

    gauges: dict[str, BackendRouting] = {}
    for report in (seen.routers.reports if seen.routers is not None else ()):
        for b in (report.backends if report is not None else ()):
            if b.revision == seen.revision and b.routing is not None and b.routing.read_age_seconds is not None:
                known = gauges.get(b.backend)
                if known is None or (known.read_age_seconds or 0) > b.routing.read_age_seconds:
                    gauges[b.backend] = b.routing  # the freshest read of each engine over the routers
    roles = {b.backend: b.role for r in (seen.routers.reports if seen.routers is not None else ()) if r for b in r.backends}
    waiting = {r: sum(g.waiting or 0.0 for k, g in gauges.items() if roles.get(k) == r) for r in ROLES}
    decode = [g for k, g in gauges.items() if roles.get(k) == "decode" and g.kv_capacity_tokens]
    kv_tokens = sum((g.kv_usage or 0.0) * (g.kv_capacity_tokens or 0) for g in decode)
    kv_capacity = sum(g.kv_capacity_tokens or 0 for g in decode) / len(decode) if decode else 0.0

    def role(name: str) -> RoleObservation:
        count, reason = seen.unschedulable.get(name, (0, ""))
        ready, warm = ready_and_warm(name)
        return RoleObservation(current=seen.targets[name], warm=warm, ready=ready, unschedulable=count, unschedulable_reason=reason,
                               waiting=waiting[name], kv_tokens=kv_tokens if name == "decode" else 0.0,
                               kv_capacity=kv_capacity if name == "decode" else 0.0,
                               kv_engines=len(decode) if name == "decode" else 0)  # fmt: skip

    return Observation(at=seen.now, seconds=seconds, prefill=role("prefill"), decode=role("decode"), requests=measured.requests,
                       ttft_s=measured.ttft.quantile(q), tpot_s=measured.tpot.quantile(q), prefill_leg_s=measured.prefill_leg.quantile(q),
                       prefill_leg_mean_s=measured.prefill_leg.mean, prefill_legs=int(measured.prefill_leg.count),
                       prefill_tokens=measured.uncached_prompt_tokens, rolling_out=seen.rolling_out,
                       local_ttft_s=measured.local_ttft.quantile(q))  # fmt: skip


def status_of(decision: Decision, obs: Observation, policy: Policy, at: str) -> dict[str, Any]:
    """status.autoscaling: what it decided at `at` and why, with what it measured and estimates."""
    measured = {"requests": obs.requests, "ttftSeconds": obs.ttft_s, "tpotSeconds": obs.tpot_s,
                "prefillLegSeconds": obs.prefill_leg_s, "localTtftSeconds": obs.local_ttft_s}  # fmt: skip
    return {
        "mode": "Advisory" if policy.advisory else "Active",
        "decidedAt": at,
        **{r: {"current": obs.role(r).current, "recommended": decision.sizes[r], "reason": decision.reasons[r]} for r in ROLES},
        **({"blocked": decision.blocked} if decision.blocked else {}),
        "measured": {k: round(v, 4) if isinstance(v, float) else v for k, v in measured.items() if v is not None},
        "estimates": {k: round(v, 1) for k, v in decision.estimates.items()},
    }
