"""The SLO autoscaler against the alternatives a user has today, on a fleet model of engines (issue 32).

    python -m disagg_bench.autoscale_sim                  # 3 seeds x 3 traces x (autoscaler, HPA, static sweep)
    python -m disagg_bench.autoscale_sim --seeds 1 --trace burst     # quicker
    python -m disagg_bench.autoscale_sim --trace sine --trace-passes 0   # every pass of the autoscaler, and why

What decides is the product's own code: every interval the SLO autoscaler's pure decision
(operator/disagg_operator/autoscaler.py, `decide`, with the Policy that `policy_of` makes from a real
`spec.autoscaling`) gets an Observation built as the operator builds it (the routers' percentiles of the interval,
the prompt tokens sent to prefill, the engines' waiting and KV gauges, engines younger than the warm-up left out)
and its sizes are applied as the operator applies them (a new engine serves after its start-up, a retired one
takes no new request and goes when it is empty), at passes an interval apart and up to PASS_DRIFT_S later, as the
operator's passes come. What it decides on is a model of the fleet, not processes:
thousands of requests over half an hour of traffic do not fit the test bed's processes on 2 cores.

**The fleet** (one GPU per engine; the timing of calibration.json's ``h200-1gpu-fair``: vLLM 0.26.0 on one H200,
the Qwen3-0.6B shape; a new engine serves START_S after it is created):
- prefill: each engine computes one prompt at a time, FIFO, ``prefill_base_ms + prefill_us_per_token x
  uncached tokens``; the router sends each prompt to the engine with the least work queued;
- KV transfer: ``prompt tokens x kv_bytes_per_token`` over ``link_gbps``, then ``kv_pickup_ms`` before the
  decode's next step;
- decode: each engine holds KV_POOL bytes of KV; a request joins when its prompt fits (else it waits, first come
  first served), holds its prompt plus what it generated, and all running requests get one token per step. The
  step is ``tpot_ms`` on an empty engine and grows linearly with the KV in use, to twice that on a full engine
  (ASSUMED: the profile's TPOT was measured at light load; a decode step reads every running request's KV).
  The router sends each decode leg to the engine with the most free KV.

**The alternatives**: (a) the static P:D of fewest GPUs whose median attainment over the seeds reaches 95 %
(found by a sweep: per prefill size, the fewest decode engines, by bisection), or the best one if none does; (b) an HPA per role on ``vllm:num_requests_waiting`` averaged over the
role's ready engines, target HPA_WAITING, as autoscaling/v2 computes it (15 s period, 10 % tolerance, scale-up
by at most max(100 %, 4 pods) per period, the 300 s scale-down stabilisation), within the same bounds; (c) on the
burst, a bound (:class:`BurstBound`): the most a reaction to the step can attain from the fleet the SLO autoscaler
holds before it.

**The traces** (seeded; long prompts, short answers, scaled to the fleet so that a peak needs several engines of
each role): ``sine`` a sinusoidal rate between 1 and 24 requests/s like ai-dynamo/dynamo#10528's (period 10 min),
``burst`` 2 -> 20 -> 2 requests/s, ``multi-turn`` conversations resending their history (the prefill engines'
prefix cache assumed to hold it: only the new turn is computed; decode holds it all).

Reported per trace and policy, the median over the seeds: SLO attainment (share of requests that met both the
TTFT and the TPOT target), the same once warm (the requests sent after the first COLD_S: the autoscaled policies
start at 1:1 knowing nothing, the static P:D is sized from the start), goodput (such requests per second) and
GPU-hours.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import Callable

from disagg_bench.localrun.loadgen import thinned_arrivals
from disagg_bench.vllm_sim.as_vllm import profile
from disagg_operator import autoscaler
from disagg_operator.api.models import ModelAutoscalingSpec

TIMING = profile("h200-1gpu-fair")
KV_POOL = 30 * 2**30  # bytes of KV per decode engine (the profile's runs: 30 GiB each)
KV_TOKENS = KV_POOL // int(TIMING["kv_bytes_per_token"])
START_S = 60.0  # a new engine's pod start, image cached, weights loaded, until Ready
HPA_WAITING = 2.0  # requests waiting per ready engine: the HPA's target average value
HPA_PERIOD_S = 15.0
TICK_S = 0.05
TTFT_TARGET_MS, TPOT_TARGET_MS = 2000, 30
BOUNDS = {"prefill": (1, 8), "decode": (1, 16)}
ATTAINMENT_GOAL = 0.95
# A decider's pass comes up to this much after an interval: the operator's pass starts when its requeue fires and
# reads the routers before it decides, so passes are never exactly an interval apart (a decision that counted on
# exact intervals passed here and never shrank a role in the operator: bench/results/autoscale-sim.md).
PASS_DRIFT_S = 1.0


# --- traces ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    at: float
    prompt: int  # tokens the decode holds (the whole prompt)
    uncached: int  # tokens prefill computes
    output: int


def _one_shot(rng: random.Random, at: float) -> Request:
    prompt = rng.randint(8_000, 24_000)
    return Request(at, prompt, prompt, rng.randint(128, 384))


def sine_rate(t: float) -> float:
    return 1 + 23 * (1 - math.cos(2 * math.pi * t / 600)) / 2


BURST_STEP_S = 300.0  # the burst's rate steps up here, and back down 300 s later


def burst_rate(t: float) -> float:
    return 20.0 if BURST_STEP_S <= t < BURST_STEP_S + 300 else 2.0


def sine(rng: random.Random) -> list[Request]:
    return [_one_shot(rng, t) for t in thinned_arrivals(sine_rate, 1800, 24, rng)]


def burst(rng: random.Random) -> list[Request]:
    return [_one_shot(rng, t) for t in thinned_arrivals(burst_rate, 1200, 20, rng)]


def multi_turn(rng: random.Random) -> list[Request]:
    """Conversations (1.2 a second for 20 min): a 4k-token system prompt, 6 turns of 1-3k new tokens, answers of
    128-384 tokens, 5-20 s of thought between an answer's likely end and the next turn."""
    out = []
    for start in thinned_arrivals(lambda t: 1.2, 1200, 1.2, rng):
        history, at = 4_000, start
        for _ in range(6):
            new, answer = rng.randint(1_000, 3_000), rng.randint(128, 384)
            out.append(Request(at, history + new, new if history > 4_000 else history + new, answer))
            history += new + answer
            at += answer * TIMING["tpot_ms"] / 1000 + rng.uniform(5, 20)
    return sorted(out, key=lambda r: r.at)


TRACES: dict[str, Callable[[random.Random], list[Request]]] = {"sine": sine, "burst": burst, "multi-turn": multi_turn}


# --- the fleet -------------------------------------------------------------------------------------------------


@dataclass
class Flight:
    request: Request
    prefilled: float = 0.0  # when prefill finished
    first: float = 0.0  # first token
    done: float = 0.0


@dataclass(eq=False)
class Prefill:
    ready_at: float
    created: float
    free_at: float = 0.0  # when the prompt it computes now (or the last one queued) finishes
    queue: deque = field(default_factory=deque)  # (finish time, Flight), FIFO
    retiring: bool = False
    gone: float | None = None

    def waiting(self, now: float) -> int:
        return sum(1 for finish, f in self.queue if finish - _prefill_s(f.request) > now)


@dataclass(eq=False)
class Decode:
    ready_at: float
    created: float
    clock: float = 0.0  # tokens each running request got since this engine started
    running: list = field(default_factory=list)  # heap of (clock at which it finishes, id, Flight, clock it joined)
    held: float = 0.0  # KV tokens of running prompts
    joined_sum: float = 0.0  # the sum of the running requests' join clocks
    pending: deque = field(default_factory=deque)  # (KV ready at, Flight) waiting to join
    retiring: bool = False
    gone: float | None = None

    def kv(self) -> float:
        return self.held + len(self.running) * self.clock - self.joined_sum

    def step_s(self) -> float:
        return TIMING["tpot_ms"] / 1000 * (1 + self.kv() / KV_TOKENS)


def _prefill_s(r: Request) -> float:
    return (TIMING["prefill_base_ms"] + TIMING["prefill_us_per_token"] * r.uncached / 1000) / 1000


def _transfer_s(r: Request) -> float:
    return r.prompt * TIMING["kv_bytes_per_token"] * 8 / (TIMING["link_gbps"] * 1e9) + TIMING["kv_pickup_ms"] / 1000


class Fleet:
    def __init__(self, prefill: int, decode: int):
        self.now = 0.0
        self.prefills = [Prefill(0.0, 0.0) for _ in range(prefill)]
        self.decodes = [Decode(0.0, 0.0) for _ in range(decode)]
        # What the routers see, in the order it happens: arrivals, prefill legs done, first tokens, ends.
        self.arrived: list[Flight] = []
        self.prefilled: list[Flight] = []
        self.started: list[Flight] = []
        self.finished: list[Flight] = []
        self.in_decode: list[tuple[float, int, Flight]] = []  # (KV ready, id, Flight): prefill done, not yet placed
        self._ids = 0

    def serving(self, engines: list) -> list:
        return [e for e in engines if e.ready_at <= self.now and not e.retiring and e.gone is None]

    def arrive(self, r: Request) -> None:
        live = self.serving(self.prefills) or [e for e in self.prefills if e.gone is None and not e.retiring]
        engine = min(live, key=lambda e: max(e.free_at, e.ready_at, self.now))
        start = max(engine.free_at, engine.ready_at, self.now)
        engine.free_at = start + _prefill_s(r)
        flight = Flight(r, prefilled=engine.free_at)
        engine.queue.append((engine.free_at, flight))
        self.arrived.append(flight)

    def advance(self, until: float) -> None:
        while self.now < until:
            dt = min(TICK_S, until - self.now)
            self.now += dt
            for p in self.prefills:
                while p.queue and p.queue[0][0] <= self.now:
                    _, flight = p.queue.popleft()
                    self.prefilled.append(flight)
                    self._ids += 1
                    heapq.heappush(self.in_decode, (flight.prefilled + _transfer_s(flight.request), self._ids, flight))
                if p.retiring and not p.queue and p.gone is None:
                    p.gone = self.now
            while self.in_decode and self.in_decode[0][0] <= self.now:
                ready, _, flight = heapq.heappop(self.in_decode)
                live = self.serving(self.decodes) or [d for d in self.decodes if d.gone is None]
                target = max(live, key=lambda d: KV_TOKENS - d.kv() - sum(f.request.prompt for _, f in d.pending))
                target.pending.append((ready, flight))
            for d in self.decodes:
                self._step(d, dt)

    def _step(self, d: Decode, dt: float) -> None:
        if d.ready_at > self.now:
            return
        tokens = dt / d.step_s()
        while d.pending and d.kv() + d.pending[0][1].request.prompt <= KV_TOKENS:
            ready, flight = d.pending.popleft()
            flight.first = max(ready, self.now) + d.step_s()
            self.started.append(flight)
            d.held += flight.request.prompt
            d.joined_sum += d.clock
            self._ids += 1
            heapq.heappush(d.running, (d.clock + flight.request.output, self._ids, flight, d.clock))
        d.clock += tokens
        while d.running and d.running[0][0] <= d.clock:
            _, _, flight, joined = heapq.heappop(d.running)
            d.held -= flight.request.prompt
            d.joined_sum -= joined
            flight.done = self.now
            self.finished.append(flight)
        if d.retiring and not d.running and not d.pending and d.gone is None:
            d.gone = self.now

    def size(self, role: str) -> int:
        return sum(1 for e in self._role(role) if e.gone is None and not e.retiring)

    def _role(self, role: str) -> list:
        return self.prefills if role == "prefill" else self.decodes

    def resize(self, role: str, size: int) -> None:
        engines = self._role(role)
        for _ in range(size - self.size(role)):
            engines.append((Prefill if role == "prefill" else Decode)(self.now + START_S, self.now))
        for _ in range(self.size(role) - size):  # the least busy goes, as retirement picks
            live = [e for e in engines if e.gone is None and not e.retiring]
            least = min(live, key=lambda e: (len(e.queue) if role == "prefill" else e.kv() + len(e.pending)))
            least.retiring = True

    def gpu_hours(self) -> float:
        return sum(((e.gone if e.gone is not None else self.now) - e.created) for e in self.prefills + self.decodes) / 3600


def _tpot(f: Flight) -> float:
    return (f.done - f.first) / max(f.request.output - 1, 1)


def _p(values: list[float], percentile: int) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(percentile / 100 * len(values)) - 1)]


# --- the deciders ----------------------------------------------------------------------------------------------


def slo_spec() -> ModelAutoscalingSpec:
    """spec.autoscaling as a user would write it for this fleet: the targets and the bounds, the rest defaults."""
    return ModelAutoscalingSpec.model_validate({
        "mode": "Active", "ttftMilliseconds": TTFT_TARGET_MS, "tpotMilliseconds": TPOT_TARGET_MS,
        "prefill": {"minEngines": BOUNDS["prefill"][0], "maxEngines": BOUNDS["prefill"][1]},
        "decode": {"minEngines": BOUNDS["decode"][0], "maxEngines": BOUNDS["decode"][1]},
    })  # fmt: skip


class SloAutoscaler:
    def __init__(self, changes: dict[str, float] | None = None, show: Callable[[str], None] | None = None) -> None:
        """CHANGES: fields of the Policy set over what the spec makes (a variant: `--set max_step=8`); SHOW: given
        a line for each pass (what it saw, what it decided and why)."""
        spec = slo_spec()
        self.interval = float(spec.interval_seconds)
        self.percentile = spec.percentile
        self.policy = replace(autoscaler.policy_of(spec, {"prefill": 1, "decode": 1}), **(changes or {}))
        self.memory = autoscaler.Memory()
        self.show = show

    def __call__(self, fleet: Fleet, since: float) -> dict[str, int]:
        now = fleet.now

        def within(log: list[Flight], at: Callable[[Flight], float]) -> list[Flight]:
            return [f for f in reversed(log[-5000:]) if since < at(f) <= now]

        firsts = within(fleet.started, lambda f: f.first)
        done = within(fleet.finished, lambda f: f.done)
        prefilled = within(fleet.prefilled, lambda f: f.prefilled)
        sent = [f.request for f in within(fleet.arrived, lambda f: f.request.at)]

        def role(name: str) -> autoscaler.RoleObservation:
            engines = [e for e in fleet._role(name) if e.gone is None and not e.retiring]
            warm = sum(1 for e in engines if now - e.ready_at >= self.policy.warmup_s)
            serving = [e for e in engines if e.ready_at <= now]
            if name == "prefill":
                return autoscaler.RoleObservation(len(engines), warm, waiting=float(sum(e.waiting(now) for e in engines)), ready=len(serving))
            # the routers read every serving engine's KV: the census's serving engines and the KV's holders are one
            return autoscaler.RoleObservation(len(engines), warm, waiting=float(sum(len(e.pending) for e in engines)), ready=len(serving),
                                              kv_tokens=sum(e.kv() for e in serving), kv_capacity=float(KV_TOKENS),
                                              kv_engines=len(serving))  # fmt: skip

        obs = autoscaler.Observation(
            at=now, seconds=now - since, prefill=role("prefill"), decode=role("decode"), requests=len(firsts),
            ttft_s=_p([f.first - f.request.at for f in firsts], self.percentile),
            tpot_s=_p([_tpot(f) for f in done], self.percentile),
            prefill_leg_s=_p([f.prefilled - f.request.at for f in prefilled], self.percentile),
            prefill_leg_mean_s=statistics.fmean(f.prefilled - f.request.at for f in prefilled) if prefilled else None,
            prefill_legs=len(prefilled),
            prefill_tokens=float(sum(r.uncached for r in sent)),
        )  # fmt: skip
        decision, self.memory = autoscaler.decide(self.policy, obs, self.memory)
        if self.show is not None:
            self.show(_pass_line(obs, decision, self.policy))
        return dict(decision.sizes)


def _pass_line(obs: autoscaler.Observation, decision: autoscaler.Decision, policy: autoscaler.Policy) -> str:
    """One pass in the words the operator writes to status.autoscaling (`status_of`), with the warm engines and
    decode's KV it saw besides."""
    status = autoscaler.status_of(decision, obs, policy, f"{obs.at:.1f}")

    def ms(key: str) -> str:
        return f"{status['measured'][key] * 1000:.0f}" if key in status["measured"] else "-"

    roles = " ".join(f"{r} {status[r]['current']}->{status[r]['recommended']} ({obs.role(r).warm} warm)" for r in autoscaler.ROLES)
    return (f"{obs.at:7.1f} s  {roles}  TTFT {ms('ttftSeconds')} ms TPOT {ms('tpotSeconds')} ms KV {obs.decode.kv_tokens:.0f}"
            + "".join(f" | {r}: {status[r]['reason']}" for r in autoscaler.ROLES))


class Hpa:
    """autoscaling/v2's algorithm on one metric per role: average requests waiting per ready engine."""

    interval = HPA_PERIOD_S

    def __init__(self) -> None:
        self.history: dict[str, list[tuple[float, int]]] = {"prefill": [], "decode": []}

    def __call__(self, fleet: Fleet, since: float) -> dict[str, int]:
        out = {}
        for role in ("prefill", "decode"):
            current = fleet.size(role)
            ready = [e for e in fleet.serving(fleet._role(role))]
            waiting = [e.waiting(fleet.now) if role == "prefill" else len(e.pending) for e in ready]
            ratio = (sum(waiting) / len(ready)) / HPA_WAITING if ready else 1.0
            desired = current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)
            desired = min(desired, max(2 * current, current + 4))
            low, high = BOUNDS[role]
            desired = min(max(desired, low), high)
            self.history[role] = [(t, d) for t, d in self.history[role] if fleet.now - t < 300] + [(fleet.now, desired)]
            out[role] = desired if desired >= current else max(d for _, d in self.history[role])
        return out


class BurstBound:
    """A bound on the burst, not a policy: the SLO autoscaler until the step, then, from the instant the rate steps
    up (no measuring, no step limit), the bounds' maximum until it steps down. Its engines still serve START_S
    after it asks. Starting from the fleet the autoscaler holds before the step, no reaction to the step attains
    more: it could ask no sooner and for no more. Run on the autoscaler's own drifting passes plus one at the step's
    instant (`run`'s also_at=(BURST_STEP_S,)): until the step, its fleet is the autoscaler row's."""

    def __init__(self, changes: dict[str, float] | None = None) -> None:
        self.inner = SloAutoscaler(changes)
        self.interval = self.inner.interval

    def __call__(self, fleet: Fleet, since: float) -> dict[str, int]:
        sizes = self.inner(fleet, since)
        return {role: BOUNDS[role][1] for role in sizes} if burst_rate(fleet.now) > burst_rate(0.0) else sizes


# --- a run ------------------------------------------------------------------------------------------------------


COLD_S = 240.0  # a policy's first minutes, left out of the attainment once warm


@dataclass(frozen=True)
class Outcome:
    attainment: float
    warm_attainment: float  # of the requests sent after COLD_S
    goodput: float
    gpu_hours: float
    requests: int


def run(trace: list[Request], prefill: int, decode: int, decider: Callable[[Fleet, float], dict[str, int]] | None = None,
        interval: float = 15.0, drift_s: float = PASS_DRIFT_S, also_at: tuple[float, ...] = ()) -> Outcome:  # fmt: skip
    """TRACE played on a fleet of PREFILL:DECODE engines, resized by DECIDER's passes (each INTERVAL plus up to
    DRIFT_S later; None: static), and by a pass at each instant of ALSO_AT besides (the others stay where they were;
    an instant that is a regular pass's is that one pass)."""
    fleet = Fleet(prefill, decode)
    end = trace[-1].at
    drift = random.Random(len(trace))  # the same passes for every policy run on one trace
    last, due = 0.0, interval + drift.uniform(0, drift_s)
    extra = sorted(also_at)
    for r in trace:
        if decider is not None:
            while (at := min([due, *extra[:1]])) <= r.at:
                if extra and extra[0] == at:
                    extra.pop(0)
                fleet.advance(at)
                for role, size in decider(fleet, last).items():
                    fleet.resize(role, size)
                if at == due:
                    due = due + interval + drift.uniform(0, drift_s)
                last = at
        fleet.advance(r.at)
        fleet.arrive(r)
    while len(fleet.finished) < len(trace):
        fleet.advance(fleet.now + 1.0)
    ok = [f for f in fleet.finished if f.first - f.request.at <= TTFT_TARGET_MS / 1000 and _tpot(f) <= TPOT_TARGET_MS / 1000]
    warm = sum(1 for r in trace if r.at >= COLD_S)
    warm_ok = sum(1 for f in ok if f.request.at >= COLD_S)
    return Outcome(len(ok) / len(trace), warm_ok / warm if warm else 1.0, len(ok) / end, fleet.gpu_hours(), len(trace))


def cheapest_static(traces: list[list[Request]]) -> tuple[int, int]:
    """The static P:D of fewest GPUs whose median attainment over TRACES reaches ATTAINMENT_GOAL (per prefill size,
    the fewest decode engines that do, by bisection: attainment grows with engines), else the one of best
    median attainment."""
    seen: dict[tuple[int, int], float] = {}

    def attains(p: int, d: int) -> float:
        if (p, d) not in seen:
            seen[p, d] = statistics.median(run(t, p, d).attainment for t in traces)
        return seen[p, d]

    for p in range(BOUNDS["prefill"][0], BOUNDS["prefill"][1] + 1):
        low, high = BOUNDS["decode"]
        if attains(p, high) < ATTAINMENT_GOAL:
            continue
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if attains(p, mid) >= ATTAINMENT_GOAL else (mid + 1, high)
    reaching = [(sum(k), k) for k, a in seen.items() if a >= ATTAINMENT_GOAL]
    return min(reaching)[1] if reaching else max(seen, key=lambda k: seen[k])


def _policy_changes(parser: argparse.ArgumentParser, pairs: list[str]) -> dict[str, float]:
    known = {f.name for f in fields(autoscaler.Policy) if f.type in ("int", "float", "int | None")}
    changes: dict[str, float] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in known or not value:
            parser.error(f"--set {pair}: say FIELD=VALUE with FIELD one of the Policy's: {', '.join(sorted(known))}")
        try:
            changes[name] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            parser.error(f"--set {pair}: the value must be a number")
    return changes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m disagg_bench.autoscale_sim", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trace", choices=sorted(TRACES), action="append", help="default: every trace")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a field of the autoscaler's Policy, e.g. max_step=8 (the results page's variants)")
    parser.add_argument("--autoscaler-only", action="store_true", help="skip the static sweep and the HPA")
    parser.add_argument("--per-seed", action="store_true", help="a last column: each seed's attainment and GPU-hours")
    parser.add_argument("--exact-passes", action="store_true",
                        help=f"every decider's passes exactly an interval apart (default: up to {PASS_DRIFT_S:.0f} s later, as the "
                        "operator's; the results page's sections before 'The passes drift' were measured so)")  # fmt: skip
    parser.add_argument("--trace-passes", type=int, metavar="SEED",
                        help="instead of the table: every pass of the SLO autoscaler on this seed of each trace (what it "
                        "saw, what it decided and why), then its outcome")  # fmt: skip
    args = parser.parse_args(argv)
    changes = _policy_changes(parser, args.set)
    drift_s = 0.0 if args.exact_passes else PASS_DRIFT_S
    if args.trace_passes is not None:
        for name in args.trace or list(TRACES):
            print(f"# {name}, seed {args.trace_passes}", flush=True)
            a = SloAutoscaler(changes, show=lambda line: print(line, flush=True))
            o = run(TRACES[name](random.Random(args.trace_passes)), 1, 1, a, a.interval, drift_s)
            print(f"# {name}: attainment {o.attainment:.1%} (after {COLD_S:.0f} s {o.warm_attainment:.1%}), {o.gpu_hours:.2f} GPU-hours")
        return
    print(f"targets: TTFT {TTFT_TARGET_MS} ms and TPOT {TPOT_TARGET_MS} ms (p90 for the autoscaler; attainment: both, per "
          f"request); bounds {BOUNDS}; an engine starts in {START_S:.0f} s; {args.seeds} seeds, medians")  # fmt: skip
    print(f"| trace | policy | P:D (start; static) | attainment | after {COLD_S:.0f} s | goodput req/s | GPU-hours |"
          + (" per seed: attainment GPU-hours |" if args.per_seed else ""))
    print("|---|---|---|---:|---:|---:|---:|" + ("---|" if args.per_seed else ""))
    for name in args.trace or list(TRACES):
        traces = [TRACES[name](random.Random(seed)) for seed in range(args.seeds)]
        rows = {}
        if not args.autoscaler_only:
            p, d = cheapest_static(traces)
            rows[f"static, the cheapest at >= {ATTAINMENT_GOAL:.0%} (sweep)"] = (f"{p}:{d}", [run(t, p, d) for t in traces])
            rows["HPA on requests waiting"] = ("1:1", [run(t, 1, 1, Hpa(), HPA_PERIOD_S, drift_s) for t in traces])
        label = "SLO autoscaler (Active)" + "".join(f", {c}" for c in args.set)
        rows[label] = ("1:1", [run(t, 1, 1, (a := SloAutoscaler(changes)), a.interval, drift_s) for t in traces])
        if name == "burst":
            rows["bound: the maximum asked at the step's instant"] = (
                "1:1", [run(t, 1, 1, (b := BurstBound(changes)), b.interval, drift_s, (BURST_STEP_S,)) for t in traces])
        for policy, (shape, outcomes) in rows.items():
            med = {k: statistics.median(getattr(o, k) for o in outcomes) for k in ("attainment", "warm_attainment", "goodput", "gpu_hours")}
            seeds = " " + ", ".join(f"{o.attainment:.1%} {o.gpu_hours:.2f}" for o in outcomes) + " |" if args.per_seed else ""
            print(f"| {name} | {policy} | {shape} | {med['attainment']:.1%} | {med['warm_attainment']:.1%} | {med['goodput']:.2f} "
                  f"| {med['gpu_hours']:.2f} |{seeds}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
