"""The SLO autoscaler on the real API server: simulated engines on the pods' IPs whose prefill is slow (5 ms per
prompt token), the router on its pod's IP, traffic through it (every prompt disaggregated: the client's prompts
are short, which the router would otherwise prefill on decode). The operator reads the router's /metrics and
/health itself and decides every interval. Advisory: status.autoscaling and an Event say that prefill should grow
because TTFT misses its target on the prefill leg, and no size is written. Active: prefill grows, the new engine
joins the router's table with every request answered, and once the load stops prefill shrinks back (the leaving
engine drained, its pod gone); with decode's step over the TPOT target too, both roles grow on their own signals
and come back. Blocked: on a pool of two whole nodes the second prefill engine cannot be placed;
the autoscaler holds prefill where it is, says the scheduler's reason in status and an AutoscalerBlocked Event,
and does not count the pending engine as capacity. Frozen: while a rollout is in progress the sizes stay, and
scaling resumes once it completes. Replayed traces (compressed, open loop): a burst, against a static pair; a
sinusoid, which prefill follows up and down and up again with every request answered; multi-turn conversations,
every turn answered and most later turns finding their history in their prefill engine's prefix cache while
prefill scales."""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg_connector import contract
from disagg_bench.localrun.loadgen import MultiTurnWorkload, RequestRecord, multi_turn_sessions, thinned_arrivals
from disagg_bench.vllm_sim.harness import FAST
from disagg_operator.api.models import EngineSpec
from disagg_bench.vllm_sim.pods import PodEngines

from tests.fixtures.e2e.models import get_model, model_manifest, rolled_out, wait_ready, whole_node_pair
from tests.fixtures.e2e.nodes import Pool
from tests.fixtures.e2e.serving import Serving
from tests.fixtures.e2e.traffic import replay, replay_chats, wait_for
from tests.fixtures.e2e.waiting import condition

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
SLO = {"ttftMilliseconds": 50, "tpotMilliseconds": 1000, "prefill": {"maxEngines": 3}, "decode": {"maxEngines": 3},
       "intervalSeconds": 5, "warmupSeconds": 0}  # fmt: skip
# Every prompt disaggregated (the client's are short), and retries: kwok makes a pod Ready the moment it is bound,
# so the router can try a new engine before its simulator listens (a real engine turns Ready only once it serves).
ROUTER = {"disaggregationThresholdTokens": 0, "maxRetries": 3}
SLOW_PREFILL = {**FAST, "prefill_us_per_token": 5000.0}  # the simulated engines' timing: TTFT misses on the prefill leg


def _role_sizes(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, int]:
    roles = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, contract.ROLE_PLURAL)["items"]
    return {r["metadata"]["name"]: r["spec"]["replicas"] for r in roles if r["metadata"]["name"].startswith(f"{name}-")}


def _events(core: client.CoreV1Api, namespace: str, name: str, reason: str) -> list[str]:
    found = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name},involvedObject.kind={contract.KIND}")
    return [e.message for e in found.items if e.reason == reason]


def _active_on_pool(custom: client.CustomObjectsApi, namespace: str, name: str, pool_label: str, prefill_max: int) -> tuple[str, str]:
    """A whole-node pair (prefill and decode 8 GPUs each) on POOL_LABEL's nodes, the SLO autoscaler Active on it
    (prefill up to PREFILL_MAX engines, decode 1) and every prompt disaggregated; once Ready: (served name, revision)."""
    manifest = whole_node_pair(name, pool_label)
    manifest["spec"]["autoscaling"] = {**SLO, "mode": "Active", "prefill": {"maxEngines": prefill_max}, "decode": {"maxEngines": 1}}
    manifest["spec"]["router"] = {**manifest["spec"].get("router", {}), **ROUTER}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    ready = wait_ready(custom, namespace, name, 180)
    return ready["spec"]["model"]["name"], ready["status"]["revision"]


@contextlib.contextmanager
def _model_deleted(custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str, name: str) -> Iterator[None]:
    """On the way out, the model NAME deleted (if it was made) and its pods gone: before its pool's nodes go."""
    try:
        yield
    finally:
        with contextlib.suppress(ApiException):
            custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        selector = f"{contract.LABEL_MODEL}={contract.model_label_value(name)}"
        wait_for("the model's pods gone", lambda: not core.list_namespaced_pod(namespace, label_selector=selector).items, 120)


def test_advisory_autoscaling_reports_a_slow_prefill_and_scales_nothing(operator, cluster, api_client, namespace,
                                                                       tmp_path: Path) -> None:  # fmt: skip
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "slo"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name, {"autoscaling": SLO, "router": ROUTER}))
    ready = wait_ready(custom, namespace, name, 180)
    served, revision = ready["spec"]["model"]["name"], ready["status"]["revision"]
    with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 1), timing=SLOW_PREFILL) as serving:
        wait_for("the router's table 1P1D", lambda: serving.router.table() == {revision: (1, 1)}, 60)
        serving.start_client(workers=4)

        seen: list[dict] = [{}]

        def prefill_recommended() -> dict | None:
            seen[0] = scaling = get_model(custom, namespace, name)["status"].get("autoscaling") or {}
            return scaling if scaling.get("prefill", {}).get("recommended", 1) > 1 else None

        try:
            scaling = wait_for("a decision that prefill should grow", prefill_recommended, 90)
        except AssertionError as error:
            raise AssertionError(f"{error}; status.autoscaling: {seen[0]}") from None
        assert scaling["mode"] == "Advisory" and scaling["prefill"]["current"] == 1 and "TTFT" in scaling["prefill"]["reason"]
        assert scaling["measured"]["requests"] > 0 and scaling["measured"]["ttftSeconds"] > 0.05, scaling
        assert scaling["measured"]["prefillLegSeconds"] >= 0.5 * scaling["measured"]["ttftSeconds"], scaling
        told = wait_for("an AutoscalerRecommends Event", lambda: _events(core, namespace, name, "AutoscalerRecommends") or None, 30)
        assert any("prefill 1 -> " in note for note in told), told
        results = serving.stop_client()
        assert results and not [r for r in results if not r.ok], "requests failed while the autoscaler read the router"
    assert _role_sizes(custom, namespace, name) == {f"{name}-prefill": 1, f"{name}-decode": 1}, "Advisory writes no size"


def test_active_autoscaling_grows_prefill_under_load_and_shrinks_it_when_idle(operator, cluster, api_client, namespace,
                                                                             tmp_path: Path) -> None:  # fmt: skip
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "slo-active"
    slo = {**SLO, "mode": "Active", "prefill": {"maxEngines": 2}, "decode": {"maxEngines": 1}, "scaleDownStabilizationSeconds": 0}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name, {"autoscaling": slo, "router": ROUTER}))
    ready = wait_ready(custom, namespace, name, 180)
    served, revision = ready["spec"]["model"]["name"], ready["status"]["revision"]
    prefill_pods = lambda: [p.metadata.name for p in core.list_namespaced_pod(  # noqa: E731
        namespace, label_selector=f"{contract.LABEL_MODEL}={contract.model_label_value(name)},{contract.LABEL_ROLE}=prefill").items]
    with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 1), timing=SLOW_PREFILL) as serving:
        wait_for("the router's table 1P1D", lambda: serving.router.table() == {revision: (1, 1)}, 60)
        serving.start_client(workers=4)
        wait_for("prefill grown to 2 engines", lambda: _role_sizes(custom, namespace, name)[f"{name}-prefill"] == 2 or None, 90)
        wait_for("the new prefill engine in the router's table", lambda: serving.router.table() == {revision: (2, 1)}, 90)
        scaling = get_model(custom, namespace, name)["status"]["autoscaling"]
        assert scaling["mode"] == "Active" and scaling["decode"]["recommended"] == 1, scaling
        told = wait_for("an AutoscalerScaled Event", lambda: _events(core, namespace, name, "AutoscalerScaled") or None, 30)
        assert any("prefill 1 -> 2" in note for note in told), told
        results = serving.stop_client()
        assert results and not [r for r in results if not r.ok], "a request failed while prefill grew"

        wait_for("prefill back to 1 engine once idle", lambda: _role_sizes(custom, namespace, name)[f"{name}-prefill"] == 1 or None, 90)
        wait_for("the leaving prefill pod gone", lambda: len(prefill_pods()) == 1 or None, 120)
        wait_for("the router's table 1P1D again", lambda: serving.router.table() == {revision: (1, 1)}, 60)
    status = get_model(custom, namespace, name)["status"]
    assert status["prefill"]["targetReplicas"] == 1 and status["autoscaling"]["prefill"]["recommended"] == 1, status


def test_active_autoscaling_grows_both_roles_on_their_own_signals_and_shrinks_them_back(operator, cluster, api_client,
                                                                                        namespace, tmp_path: Path) -> None:  # fmt: skip
    """Prefill slow (the TTFT target missed on the prefill leg) and decode slow (a 5 ms step against a 3 ms TPOT
    target): each role grows on its own signal, the new engines join the router's table with every request
    answered, and both come back to one engine once idle."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "slo-both"
    slo = {**SLO, "mode": "Active", "tpotMilliseconds": 3, "prefill": {"maxEngines": 2}, "decode": {"maxEngines": 2},
           "scaleDownStabilizationSeconds": 0}  # fmt: skip
    with _model_deleted(custom, core, namespace, name):
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name, {
            "autoscaling": slo, "router": ROUTER}))  # fmt: skip
        ready = wait_ready(custom, namespace, name, 180)
        served, revision = ready["spec"]["model"]["name"], ready["status"]["revision"]
        slow_both = {**SLOW_PREFILL, "tpot_ms": 5.0, "step_ms": 5.0}
        both = {f"{name}-prefill": 2, f"{name}-decode": 2}
        with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 1), timing=slow_both) as serving:
            wait_for("the router's table 1P1D", lambda: serving.router.table() == {revision: (1, 1)}, 60)
            serving.start_client(workers=4)
            wait_for("both roles grown to 2 engines", lambda: _role_sizes(custom, namespace, name) == both or None, 120)
            wait_for("the new engines in the router's table", lambda: serving.router.table() == {revision: (2, 2)}, 90)
            grew = lambda: (t := _events(core, namespace, name, "AutoscalerScaled")) and all(  # noqa: E731
                any(f"{role} 1 -> 2" in note for note in t) for role in ("prefill", "decode")) and t
            told = wait_for("AutoscalerScaled Events of both roles growing", grew, 30)
            assert any("prefill 1 -> 2: TTFT" in n for n in told) and any("decode 1 -> 2: TPOT" in n for n in told), told
            results = serving.stop_client()
            assert results and not [r for r in results if not r.ok], "a request failed while the roles grew"
            one_each = {f"{name}-prefill": 1, f"{name}-decode": 1}
            wait_for("both roles back to 1 engine once idle", lambda: _role_sizes(custom, namespace, name) == one_each or None, 90)
            wait_for("the router's table 1P1D again", lambda: serving.router.table() == {revision: (1, 1)}, 120)


def test_active_autoscaling_blocked_by_a_full_pool_holds_the_size_and_says_why(operator, cluster, api_client, namespace,
                                                                              tmp_path: Path) -> None:  # fmt: skip
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "slo-blocked"
    with Pool.of(api_client, f"{namespace}-slo", 2) as pool, _model_deleted(custom, core, namespace, name):
        served, revision = _active_on_pool(custom, namespace, name, pool.label, prefill_max=3)
        with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 1), timing=SLOW_PREFILL) as serving:
            wait_for("the router's table 1P1D", lambda: serving.router.table() == {revision: (1, 1)}, 60)
            serving.start_client(workers=4)
            seen: list[dict] = [{}]

            def blocked() -> dict | None:
                seen[0] = scaling = get_model(custom, namespace, name)["status"].get("autoscaling") or {}
                return scaling if scaling.get("blocked") else None

            try:
                scaling = wait_for("a decision blocked on the unschedulable prefill engine", blocked, 120)
            except AssertionError as error:
                raise AssertionError(f"{error}; status.autoscaling: {seen[0]}") from None
            assert scaling["blocked"].startswith("prefill: 1 engine(s) cannot be scheduled") and "nvidia.com/gpu" in scaling["blocked"], scaling
            assert scaling["prefill"]["recommended"] == scaling["prefill"]["current"] and scaling["prefill"]["reason"].startswith("blocked: ")
            told = wait_for("an AutoscalerBlocked Event", lambda: _events(core, namespace, name, "AutoscalerBlocked") or None, 30)
            assert "cannot be scheduled" in told[0], told
            sizes = _role_sizes(custom, namespace, name)
            assert sizes[f"{name}-prefill"] == scaling["prefill"]["current"] >= 2, (sizes, scaling)
            assert serving.router.table() == {revision: (1, 1)}, "the pending engine serves nothing"
            results = serving.stop_client()
            assert results and not [r for r in results if not r.ok], "a request failed while the autoscaler was blocked"


def test_active_autoscaling_waits_out_a_rollout_then_scales(operator, cluster, api_client, namespace, tmp_path: Path) -> None:
    """A release change on a pool with no room for its surge pod: the rollout stays in progress, and the autoscaler,
    its prefill missing the TTFT target, holds both sizes and says it is frozen, decision after decision. Nodes
    come, the rollout completes, and then prefill grows; every request answered."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "slo-frozen"
    with Pool.of(api_client, f"{namespace}-frz", 2) as pool, _model_deleted(custom, core, namespace, name):
        served, first = _active_on_pool(custom, namespace, name, pool.label, prefill_max=2)
        with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 1), timing=SLOW_PREFILL) as serving:
            wait_for("the router's table 1P1D", lambda: serving.router.table() == {first: (1, 1)}, 60)
            serving.start_client(workers=4)
            custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"engine": {
                "image": "registry.example/vllm-runtime:0.34.0-efa", "vllmVersion": "0.34.0"}}})  # fmt: skip

            frozen_at: set[str] = set()

            def frozen_twice() -> bool:
                scaling = get_model(custom, namespace, name)["status"].get("autoscaling") or {}
                if scaling.get("prefill", {}).get("reason", "").startswith("frozen"):
                    assert scaling["prefill"]["recommended"] == 1 and scaling["decode"]["recommended"] == 1, scaling
                    frozen_at.add(scaling["decidedAt"])
                return len(frozen_at) >= 2

            wait_for("two decisions frozen by the rollout", frozen_twice, 60)
            assert _role_sizes(custom, namespace, name) == {f"{name}-prefill": 1, f"{name}-decode": 1}
            assert condition(get_model(custom, namespace, name), "Progressing").get("reason") != "Complete", "the rollout is still going"

            results = serving.stop_client()
            assert results and not [r for r in results if not r.ok], "a request failed while the rollout was held"

            # The client pauses while the new revision comes: its one pair would be its only one, and kwok makes a
            # pod Ready before its simulator listens (retries need another pair of the revision).
            pool.add(3)  # room for the surge pods, then for a second prefill engine
            second = wait_for("the rollout complete", lambda: rolled_out(custom, namespace, name, first), 180)["status"]["revision"]
            wait_for("the router's table 1P1D of the new revision", lambda: serving.router.table() == {second: (1, 1)}, 60)
            serving.start_client(workers=4)
            wait_for("prefill grown to 2 engines after the rollout", lambda: _role_sizes(custom, namespace, name)[f"{name}-prefill"] == 2 or None, 90)
            results = serving.stop_client()
            assert results and not [r for r in results if not r.ok], "a request failed while prefill grew after the rollout"


# A burst replayed open loop (issue 32's trace replay, compressed to the simulator): 2 requests/s, then 8 for 100 s,
# then 2 again. One prefill engine computes a prompt in 150 ms (6.7 a second): the burst overloads one, not two.
BURST_S, BURST = 200.0, (lambda t: 8.0 if 40.0 <= t < 140.0 else 2.0)
BURST_TIMING = {**FAST, "prefill_base_ms": 150.0}
REPLAY_TARGETS_S = (1.0, 1.0)  # TTFT and TPOT a request must meet to count as attained
# Production-like request bounds: a queued prompt may wait past FAST_DRAIN's 2 s, and its KV must outlive that.
REPLAY_ROUTER = {**ROUTER, "requestDeadlineSeconds": 60}
REPLAY_KV = {"leaseSeconds": 120}


R = TypeVar("R")


class EngineSeconds:
    """Samples, every second until stopped, how many engine pods of a model exist (a draining one still costs
    its GPUs), per role: every sample's count and the engine-seconds they add up to."""

    def __init__(self, core: client.CoreV1Api, namespace: str, model: str) -> None:
        self.core, self.namespace, self.model = core, namespace, model
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.counts: dict[str, list[int]] = {"prefill": [], "decode": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-seconds", daemon=True)

    def most(self, role: str) -> int:
        return max(self.counts[role], default=0)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(1.0):
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{contract.LABEL_MODEL}={contract.model_label_value(self.model)}").items
            now = time.monotonic()
            for role in self.seconds:
                n = sum(1 for p in pods if (p.metadata.labels or {}).get(contract.LABEL_ROLE) == role)
                self.seconds[role] += n * (now - last)
                self.counts[role].append(n)
            last = now

    def __enter__(self) -> "EngineSeconds":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _replayed(cluster: Any, custom: client.CustomObjectsApi, core: client.CoreV1Api, namespace: str, name: str,
              patch: dict[str, Any], send: Callable[[str, str], R], logs: Path,
              timing: dict[str, float] = BURST_TIMING, listening: tuple[int, int] = (1, 1)) -> tuple[R, EngineSeconds, PodEngines]:  # fmt: skip
    """Traffic sent by ``send(router URL, served model name)`` through the router of a new model ``name`` (the
    example's 1P1D with ``patch`` on it, production-like request bounds) once its router's table holds
    ``listening`` (prefill, decode) engines: what ``send`` returned, the engines the model held, and its simulated
    engines (stopped by the Serving's exit, each keeping its events and stats). The model is deleted after."""
    with _model_deleted(custom, core, namespace, name):
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name, {
            "router": REPLAY_ROUTER, "kvTransfer": REPLAY_KV, **patch}))  # fmt: skip
        ready = wait_ready(custom, namespace, name, 180)
        served, revision = ready["spec"]["model"]["name"], ready["status"]["revision"]
        logs.mkdir()
        with Serving(cluster, namespace, name, served, logs, listening=listening, timing=timing) as serving:
            wait_for(f"the router's table {listening}", lambda: serving.router.table() == {revision: listening}, 60)
            with EngineSeconds(core, namespace, name) as engines:
                sent = send(serving.router.url, served)
            return sent, engines, serving.engines


def _attained(results: list[RequestRecord]) -> float:
    return sum(r.meets(*REPLAY_TARGETS_S) for r in results) / len(results)


def test_a_replayed_burst_through_the_router_and_the_operator_against_a_static_pair(operator, cluster, api_client, namespace,
                                                                                      tmp_path: Path) -> None:  # fmt: skip
    """The same seeded burst, sent open loop through the real router, to a static 1P1D and to the SLO autoscaler
    (Active, from 1P1D): the autoscaler grows prefill during the burst and meets both targets on more requests;
    every request of both is answered. The figures are printed (attainment, engine-seconds), not asserted."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    times = list(thinned_arrivals(BURST, BURST_S, 8.0, random.Random(7)))
    slo = {**SLO, "mode": "Active", "ttftMilliseconds": 1000, "prefill": {"maxEngines": 3}, "decode": {"maxEngines": 1},
           "scaleDownStabilizationSeconds": 30}  # fmt: skip
    outcomes = {
        policy: _replayed(cluster, custom, core, namespace, name, patch, lambda url, served: replay(url, served, times), tmp_path / name)[:2]
        for policy, name, patch in (("static 1P1D", "burst-static", {}), ("SLO autoscaler", "burst-slo", {"autoscaling": slo}))
    }  # fmt: skip
    print(f"\nburst replay: {len(times)} requests over {BURST_S:.0f} s; targets TTFT {REPLAY_TARGETS_S[0]} s, TPOT {REPLAY_TARGETS_S[1]} s")
    print("| policy | attainment | most engines (P:D) | engine-seconds |")
    for policy, (results, engines) in outcomes.items():
        print(f"| {policy} | {_attained(results):.1%} | {engines.most('prefill')}:{engines.most('decode')} | {sum(engines.seconds.values()):.0f} |")
    for policy, (results, _) in outcomes.items():
        failed = [r for r in results if not r.ok]
        assert not failed, f"{policy}: {len(failed)} requests failed, e.g. {failed[0].error}"
    static, scaled = ([r.meets(*REPLAY_TARGETS_S) for r in outcomes[p][0]] for p in ("static 1P1D", "SLO autoscaler"))
    assert outcomes["SLO autoscaler"][1].most("prefill") >= 2, "prefill grew during the burst"
    assert sum(scaled) > sum(static), (sum(scaled), sum(static))


# A sinusoid replayed open loop (issue 32's periodic trace, compressed): 1 <-> 8 requests/s over a 120 s period, from
# trough to past the second peak. One prefill engine (BURST_TIMING) computes 6.7 prompts a second: each peak needs
# two, each trough one.
SINE_PERIOD_S, SINE_S = 120.0, 210.0
SINE = lambda t: 1.0 + 3.5 * (1.0 - math.cos(2.0 * math.pi * t / SINE_PERIOD_S))  # noqa: E731


def _moves(counts: list[int]) -> list[int]:
    """The counts with repeats dropped: [1, 1, 2, 2, 1] -> [1, 2, 1]."""
    return [n for i, n in enumerate(counts) if i == 0 or n != counts[i - 1]]


def test_a_replayed_sine_grows_prefill_on_each_peak_and_gives_it_back_in_the_trough_with_every_stream_answered(
        operator, cluster, api_client, namespace, tmp_path: Path) -> None:  # fmt: skip
    """A periodic load through the real router to the SLO autoscaler (Active, from 1P1D): prefill grows on the
    first peak, gives engines back in the trough (each leaving engine drained while requests still flow), and
    grows again on the second; every request is answered. Attainment and engine-seconds are printed, not
    asserted."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    times = list(thinned_arrivals(SINE, SINE_S, 8.0, random.Random(11)))
    slo = {**SLO, "mode": "Active", "ttftMilliseconds": 1000, "prefill": {"maxEngines": 3}, "decode": {"maxEngines": 1},
           "scaleDownStabilizationSeconds": 20}  # fmt: skip
    results, engines, _ = _replayed(cluster, custom, core, namespace, "sine-slo", {"autoscaling": slo},
                                    lambda url, served: replay(url, served, times), tmp_path / "sine-slo")  # fmt: skip
    print(f"\nsine replay: {len(times)} requests over {SINE_S:.0f} s; attainment {_attained(results):.1%}; engines (P:D) at "
          f"most {engines.most('prefill')}:{engines.most('decode')}, {sum(engines.seconds.values()):.0f} engine-seconds; "
          f"prefill engines over time {_moves(engines.counts['prefill'])}")  # fmt: skip
    failed = [r for r in results if not r.ok]
    assert not failed, f"{len(failed)} requests failed, e.g. {failed[0].error}"
    # from 1 engine, up on the first peak, down in the trough (how far depends on where the trough's decisions fall:
    # to 1 or to 2 in the runs so far, in one step or two), up again on the second peak (to 2 or 3: its forecast
    # goes no higher than the first peak's rate)
    moves = _moves(engines.counts["prefill"])
    down = next((i for i in range(1, len(moves)) if moves[i] < moves[i - 1]), None)
    assert down is not None and any(moves[i] > moves[i - 1] for i in range(down + 1, len(moves))), f"prefill engines over time: {moves}"


# Conversations replayed (issue 32's multi-turn trace, compressed): 62 chats arriving 0.5 a second (about 2
# minutes), 4 turns each of the run's 300-word system prompt and 130 words a turn, 2.5 s of thought on average
# between an answer and the next turn. Prefill costs 150 ms plus 1 ms a token past the prefix its engine holds: a
# turn whose history is cached stays well within the 1 s TTFT target; a last turn whose history is not (about 870
# tokens: 1.02 s) misses it.
CHATS = MultiTurnWorkload(session_rate=0.5, sessions=62, turns=4, system_tokens=300, user_tokens=130, answer_tokens=16, think_time=2.5)
CHAT_TIMING = {**BURST_TIMING, "prefill_us_per_token": 1000.0}
BLOCK = EngineSpec.model_fields["block_size"].default  # what a prefix cache holds of a prompt is its whole blocks


def _histories_cached(turns: list[RequestRecord], engines: PodEngines) -> tuple[int, int]:
    """(later turns whose prefill found the conversation's previous prompt cached, later turns prefilled): from the
    prefill engines' own record of each prompt (``prompt_scheduled``: its tokens found in the prefix cache)."""
    scheduled = {e["xid"]: e for engine in engines.all() if engine.role == "prefill" for e in engine.events() if e["kind"] == "prompt_scheduled"}
    cached = prefilled = 0
    by_turn = {(t.session, t.turn): t for t in turns}
    for (session, k), turn in by_turn.items():
        if k == 0:
            continue
        before = by_turn[(session, k - 1)]
        if (prev := scheduled.get(before.request_id)) is None or (now := scheduled.get(turn.request_id)) is None:
            continue
        prefilled += 1
        prompt = prev["hit_tokens"] + prev["restored_tokens"] + prev["computed_tokens"]
        cached += now["hit_tokens"] + now["restored_tokens"] >= prompt // BLOCK * BLOCK
    return cached, prefilled


def test_replayed_conversations_keep_their_history_cached_while_prefill_scales(operator, cluster, api_client, namespace,
                                                                               tmp_path: Path) -> None:  # fmt: skip
    """Multi-turn chats through the real router (prefix-and-load routing on the engines' KV events) to the SLO
    autoscaler (Active, from 1P1D): every turn is answered, and the later turns of a conversation find its history
    in their prefill engine's prefix cache while prefill grows. Attainment, engine-seconds and the
    share of histories found cached are printed."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    chats = multi_turn_sessions(CHATS, timing_seed=5, content_seed=5)
    slo = {**SLO, "mode": "Active", "ttftMilliseconds": 1000, "prefill": {"maxEngines": 3}, "decode": {"maxEngines": 1},
           "scaleDownStabilizationSeconds": 20}  # fmt: skip
    turns, engines, sims = _replayed(
        cluster, custom, core, namespace, "chat-slo", {"autoscaling": slo, "router": {**REPLAY_ROUTER, "prefillPolicy": "PrefixAndLoad"}},
        lambda url, served: replay_chats(url, served, chats), tmp_path / "chat-slo", CHAT_TIMING,
    )  # fmt: skip
    cached, prefilled = _histories_cached(turns, sims)
    print(f"\nconversation replay: {len(chats)} conversations, {len(turns)} turns over {chats[-1].arrival:.0f} s; "
          f"attainment {_attained(turns):.1%}; engines (P:D) at most {engines.most('prefill')}:{engines.most('decode')}, "
          f"{sum(engines.seconds.values()):.0f} engine-seconds; prefill engines over time {_moves(engines.counts['prefill'])}; "
          f"histories found cached {cached} of {prefilled}")  # fmt: skip
    failed = [t for t in turns if not t.ok]
    assert not failed, f"{len(failed)} turns failed, e.g. {failed[0].error}"
    assert len(turns) == CHATS.sessions * CHATS.turns
    # Prefix-and-load routing sends a turn where its history is unless that engine is much busier. Measured on
    # this trace: 168 of 186 found; with LeastOutstanding 69.
    assert cached >= 0.75 * prefilled, f"histories found cached {cached} of {prefilled}"
