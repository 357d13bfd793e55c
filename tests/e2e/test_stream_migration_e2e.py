"""A crashed decode engine cuts no stream, on the real API server: simulated engines on the pods' IPs, the router on
its pod's IP with the operator's rendered arguments (stream migration on by default, spec.router.migration).

1. A 1P2D model; long streams (24 s) on both decodes; one decode's engine is killed (SIGKILL) mid-generation. Every
   stream still ends with all its tokens in order (the simulator's answer is a function of the token-id prefix: a
   dropped or repeated token would show) and [DONE], and the router counts one migration per stream that was on the
   dead engine.
2. Engines that span nodes (two decode engines of DP16, each an LWS group of two pods): long streams on every decode
   pod, then the worker pod of group 0 crashes (its engine killed, its pod deleted as a kubelet's restart would make
   LWS recreate the group). The leader's engine dies with it (their collectives), every stream of both pods moves to
   the other group, none is cut, and the recreated group comes back into routing."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from kubernetes import client

from disagg_connector import contract
from disagg_bench.vllm_sim.harness import FAST, http_get
from disagg_bench.vllm_sim.pods import PodEngines, start_pod_router

from tests.fixtures.e2e.models import create_rolled_out, get_model, wide_ep_model
from tests.fixtures.e2e.nodes import Pool
from tests.fixtures.e2e.serving import Serving
from tests.fixtures.e2e.streams import LongStreams, TPOT_MS, check_whole, decode_streams, long_model, on_every_decode
from tests.fixtures.e2e.traffic import wait_for
from tests.fixtures.e2e.waiting import condition

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL


def _migrated(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("disagg_router_migrations_total{") and 'outcome="migrated"' in line)  # fmt: skip


def _stream_events(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, list[str]]:
    """The routers' Events on the model (StreamsMigrated, StreamsCut): their notes by reason."""
    out: dict[str, list[str]] = {}
    for e in core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name},involvedObject.kind={contract.KIND}").items:
        if e.reason in ("StreamsMigrated", "StreamsCut"):
            out.setdefault(e.reason, []).append(e.message)
    return out


def test_a_decode_engine_killed_mid_stream_cuts_no_stream(operator, cluster, api_client, namespace, tmp_path: Path) -> None:
    custom = client.CustomObjectsApi(api_client)
    name = "crash"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, long_model(name))
    revision = wait_for("1P2D Ready", lambda: (o := get_model(custom, namespace, name)) and condition(o, "Ready").get("status") == "True"
                        and o["status"]["decode"]["readyReplicas"] == 2 and o, 180)["status"]["revision"]  # fmt: skip
    served = get_model(custom, namespace, name)["spec"]["model"]["name"]
    engines = PodEngines(cluster.api_client(), namespace, name, served, tmp_path, timing={**FAST, "tpot_ms": TPOT_MS})
    engines.start()
    wait_for("3 engines listening", lambda: engines.serving(1, 2), 120)
    router = start_pod_router(cluster, namespace, name, tmp_path)
    try:
        wait_for("router table 1P2D", lambda: router.table() == {revision: (1, 2)}, 60)
        assert "--max-migrations" in router.argv and router.argv[router.argv.index("--max-migrations") + 1] == "2"
        streams = LongStreams(router.url, served, first=0)
        wait_for("every long stream has its first token", streams.all_started, 60)
        spread = wait_for("a long stream on each decode", lambda: on_every_decode(engines.live("decode"), streams), 60)
        wait_for("every long stream has its first token", streams.all_started, 60)
        victim = engines.live("decode")[0]
        on_victim = decode_streams([victim], streams.streams)[victim.pod]
        victim.proc.signal(signal.SIGKILL)  # the engine dies mid-generation (an Xid error, an OOM kill)
        check_whole(streams.wait(), f"{victim.pod} killed with streams {on_victim} on it (spread {spread})")
        status, body = http_get(router.url + "/metrics", timeout=5)
        assert status == 200 and _migrated(body.decode()) >= len(on_victim) >= 1, body.decode()[-2000:]
        # the router said it on the model, once for the engine, with its own ServiceAccount (the rendered Role)
        told = wait_for("the router's StreamsMigrated Event", lambda: _stream_events(client.CoreV1Api(api_client), namespace, name) or None, 30)
        assert list(told) == ["StreamsMigrated"] and len(told["StreamsMigrated"]) == 1, told
        assert f"decode pod {victim.pod} (revision {revision})" in told["StreamsMigrated"][0], told
    finally:
        router.proc.stop()
        engines.stop()



@pytest.fixture
def pool(cluster, namespace):
    with Pool.of(cluster.api_client(), f"{namespace}-mig", 8) as nodes:  # prefill 1 + 1 surge, decode 2 x 2 + a surge engine of 2
        yield nodes


def test_a_decode_group_losing_its_worker_moves_every_stream_of_both_pods(operator, cluster, api_client, namespace, pool,
                                                                        tmp_path: Path) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "widecrash"
    first = create_rolled_out(custom, namespace, wide_ep_model(name, pool.label))
    revision, served = first["status"]["revision"], first["spec"]["model"]["name"]
    with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 4), timing={**FAST, "tpot_ms": TPOT_MS}) as harness:
        sims, router = harness.engines, harness.router
        wait_for("router offers 8 prefill ranks and 4 decode pods", lambda: router.table() == {revision: (8, 4)}, 60)
        streams = LongStreams(router.url, served, first=0)
        spread = wait_for("a long stream on each decode pod", lambda: on_every_decode(sims.live("decode"), streams, most=12), 90)
        wait_for("every long stream has its first token", streams.all_started, 60)
        leader = next(e for e in sims.live("decode") if e.pod.endswith("-0"))
        worker = next(e for e in sims.live("decode") if e.pod == f"{leader.pod}-1")
        on_group = spread[leader.pod] + spread[worker.pod]
        worker.proc.signal(signal.SIGKILL)  # a GPU of the worker's node fails: its engine dies ...
        core.delete_namespaced_pod(worker.pod, namespace)  # ... and LWS recreates the group (RecreateGroupOnPodRestart)
        check_whole(streams.wait(), f"group {leader.pod} lost its worker with streams {on_group} on it (spread {spread})")
        assert leader.proc.popen.wait(30) == 1  # the leader's engine died with its worker (a stopped one exits 0)
        status, body = http_get(router.url + "/metrics", timeout=5)
        assert status == 200 and _migrated(body.decode()) >= len(on_group) >= 2, body.decode()[-2000:]
        told = wait_for("the router's StreamsMigrated Events", lambda: _stream_events(core, namespace, name) or None, 30)
        assert "StreamsCut" not in told and any(worker.pod in note for note in told["StreamsMigrated"]), told
        wait_for("the router offers the recreated group", lambda: router.table().get(revision) == (8, 4), 180)
