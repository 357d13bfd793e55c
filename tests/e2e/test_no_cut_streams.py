"""Day 2 never cuts a response: streams that outlive every request deadline and KV lease survive an image
rollout, a scale-in and an operator restart in the middle of a drain, on the real API server.

A 1P2D model with a short router leg deadline (4 s) and KV lease (6 s) but the production drain timeout
(1 h): before "drained means idle", a retiring decode was removed once deadline + lease (10 s) had passed
since its mark, cutting every stream longer than that. Simulated engines run on the pods' IPs (decode steps
of 100 ms, so a 240-token stream lasts 24 s, more than twice that bound), the router runs on its router
pod's IP so the operator asks it what is in flight, and a client keeps short requests going throughout.

Each phase starts long streams, waits until every one has its first token (so each is on a pod that the
change will retire), makes the change, and checks: every stream ends with all its tokens and [DONE], no
request failed, and no retired pod went while its engine still worked (its simulator's own counters at the
moment its pod was deleted). The rollout cannot finish before the streams on the old decodes end. A scale-in
retires one decode of two (the newest): it starts once a long stream runs on each, and checks that the decode
marked carried one through its mark (its simulator received the stream's decode leg, by X-Request-Id, before
the scale-in and finished it after the mark), else the phase would have drained an idle pod and proved nothing.

The test runs twice: on a quiet machine, and with both cores kept busy by CPU hogs it starts and stops
(timing must not decide correctness).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from kubernetes import client

from disagg_connector import contract
from disagg_bench.vllm_sim.harness import FAST
from disagg_bench.vllm_sim.pods import PodEngines, assert_idle_when_deleted, assert_no_kv_trouble, at_deletion, start_pod_router

from tests.fixtures.e2e.models import get_model, rolled_out
from tests.fixtures.e2e.traffic import BackgroundClient, wait_for
from tests.fixtures.e2e.waiting import condition
from tests.fixtures.e2e.streams import (LongStreams, TPOT_MS, assert_carried_through_mark, check_whole, decode_settled, draining_pod,
                                        long_model, on_every_decode)

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL


@pytest.fixture(params=["quiet", "both-cores-busy"])
def load(request) -> Iterator[str]:
    hogs = []
    if request.param == "both-cores-busy":
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield request.param
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_streams_outlive_every_bound_through_day_2(load, operator, cluster, api_client, namespace, tmp_path: Path) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "long"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, long_model(name))
    first = wait_for("1P2D Ready", lambda: (o := get_model(custom, namespace, name)) and condition(o, "Ready").get("status") == "True"
                     and o["status"]["decode"]["readyReplicas"] == 2 and o, 180)["status"]["revision"]  # fmt: skip
    served = get_model(custom, namespace, name)["spec"]["model"]["name"]

    engines = PodEngines(cluster.api_client(), namespace, name, served, tmp_path, timing={**FAST, "tpot_ms": TPOT_MS}, stop_gone=True)
    engines.start()
    wait_for("3 engines listening", lambda: engines.serving(1, 2), 120)
    router = start_pod_router(cluster, namespace, name, tmp_path)
    background: BackgroundClient | None = None
    try:
        wait_for("router table 1P2D", lambda: router.table() == {first: (1, 2)}, 60)
        background = BackgroundClient(router.url, served, workers=2)
        background.start()
        wait_for("traffic", lambda: len(background.results) >= 4)

        # --- 1. an image change while long streams run on both old decodes ------------------------------
        streams = LongStreams(router.url, served, first=0)
        wait_for("every long stream has its first token", streams.all_started, 60)
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                              {"spec": {"engine": {"image": "registry.example/vllm-runtime:0.33.0-next"}}})  # fmt: skip
        mid = wait_for("the old decodes draining", lambda: draining_pod(core, namespace, name), 120)
        # Ready means serving: a rollout is no outage, so `kubectl wait` passes in the middle of it.
        waited = cluster.kubectl("wait", "--for=condition=Ready", f"{PLURAL}/{name}", "-n", namespace, "--timeout=30s", check=False)
        assert waited.returncode == 0, waited.stderr
        assert condition(get_model(custom, namespace, name), "Progressing").get("status") == "True", "still rolling out"
        done = wait_for("image rollout complete", lambda: rolled_out(custom, namespace, name, first), 600)
        rolled_at = time.monotonic()
        last_stream = check_whole(streams.wait(), "image rollout")
        assert rolled_at >= last_stream, f"the rollout finished {last_stream - rolled_at:.1f} s before the streams on {mid} ended"
        second = done["status"]["revision"]

        # --- 2. scale-in 2 -> 1 while long streams run on both decodes ----------------------------------
        # Both new decodes listening and routed to: the router ejects a decode it tried before its engine listened
        # (kwok makes a pod Ready at once) until a probe finds it up, and the streams would all go to the other one.
        wait_for("2 decode engines listening", lambda: engines.serving(1, 2), 120)
        wait_for("router routes to both decodes", lambda: router.table().get(second) == (1, 2), 60)
        streams = LongStreams(router.url, served, first=100)
        wait_for("every long stream has its first token", streams.all_started, 60)
        # The operator marks the newest decode: each carries a long stream, so the one marked does.
        spread = wait_for("a long stream on each decode", lambda: on_every_decode(engines.live("decode"), streams), 60)
        wait_for("every long stream has its first token", streams.all_started, 60)
        print(f"[{load}] scale-in: long streams per decode {spread}")
        scaler = contract.role_scaler_name(name, "decode")
        scaled_at = time.monotonic()
        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL, scaler, {"spec": {"replicas": 1}})
        leaving = wait_for("a decode draining", lambda: draining_pod(core, namespace, name), 60)
        marked_by = time.monotonic()
        wait_for("scaled in to 1 decode", lambda: decode_settled(custom, namespace, name, 1), 600)
        check_whole(streams.wait(), "scale-in")
        wait_for(f"{leaving} retired", lambda: any(e.pod == leaving and e.final is not None for e in engines.all()), 120)
        assert_carried_through_mark(engines.all(), leaving, streams.streams, scaled_at, marked_by, "scale-in")

        # --- 3. the operator restarts while a decode drains ---------------------------------------------
        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL, scaler, {"spec": {"replicas": 2}})
        wait_for("back at 2 decodes", lambda: decode_settled(custom, namespace, name, 2), 180)
        wait_for("2 decode engines listening", lambda: engines.serving(1, 2), 120)
        wait_for("router table 1P2D", lambda: router.table() == {second: (1, 2)}, 60)
        streams = LongStreams(router.url, served, first=200)
        wait_for("every long stream has its first token", streams.all_started, 60)
        spread = wait_for("a long stream on each decode", lambda: on_every_decode(engines.live("decode"), streams), 60)
        wait_for("every long stream has its first token", streams.all_started, 60)
        print(f"[{load}] operator restart: long streams per decode {spread}")
        scaled_at = time.monotonic()
        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL, scaler, {"spec": {"replicas": 1}})
        leaving = wait_for("a decode draining", lambda: draining_pod(core, namespace, name), 60)
        marked_by = time.monotonic()
        operator.stop()
        operator.start()
        wait_for("scaled in to 1 decode", lambda: decode_settled(custom, namespace, name, 1), 600)
        last_stream = check_whole(streams.wait(), "operator restart mid-drain")
        # Its engine stops once the pod is gone (after its preStop, as under a kubelet).
        wait_for(f"{leaving} retired", lambda: any(e.pod == leaving and e.final is not None for e in engines.all()), 120)
        assert_carried_through_mark(engines.all(), leaving, streams.streams, scaled_at, marked_by, "operator restart mid-drain")

        background.wait_past(time.monotonic(), "the last phase")
        results = background.stop()
        background = None
        failed = [r for r in results if not r.ok]
        assert not failed and len(results) >= 20, (len(failed), len(results), failed[:3])

        # --- every retired pod was idle when it went -------------------------------------------------------
        retired = [e for e in engines.all() if e.final is not None]
        assert len(retired) >= 5, f"the rollout retired 3 pods, each scale-in one: {[e.pod for e in retired]}"
        for engine in retired:
            assert engine.pre_stop is not None and at_deletion(engine) is engine.pre_stop.stats_at_start, f"{engine.pod}: its preStop ran"
        assert_idle_when_deleted(retired)
        assert_no_kv_trouble(engines.all())
    finally:
        if background is not None:
            background.stop()
        code = router.proc.stop()
        print(f"[{load}] router exited with {code}; log tail:\n{router.proc.log_text()[-2000:]}")
        engines.stop()

