"""Engines that span nodes, on the real API server, scheduler and LeaderWorkerSet controller (v0.9.0).

A DeepSeek-V3-class shape on fake p5en nodes (8 GPUs each) of a pool of this test's own: prefill one engine of
DP8 on one node (a Deployment), decode two engines of DP16 with expert parallelism, each over two nodes (one
LeaderWorkerSet group per engine). The pool holds the model plus one surge engine per role and no more.

Simulated engines listen on every engine pod's IP, each serving the ranks its pod serves
(bench/disagg_bench/vllm_sim/pods.py), the router runs as rendered and a client keeps sending requests through it.

1. The model goes Ready: one LeaderWorkerSet of two groups of two pods, each pod labelled by LWS and
   serving 8 of its engine's 16 ranks; status counts engines, not pods. The router offers the 8 prefill
   ranks and the 4 decode pods, and requests reach every prefill rank (pinned with X-data-parallel-rank,
   read as the index within the pod) and every decode pod.
2. A worker pod deleted by hand: LWS recreates its whole group (RecreateGroupOnPodRestart); the router
   stops using the group at once (only the other group's 2 decode pods are offered), the model comes back
   to two ready engines, and the router to 4 decode pods. Then decode is scaled as an HPA scales it (the
   DisaggregatedRole's scale subresource) to 3 engines and back: the LWS gets a third group and its PodGroup,
   the scale status counts engines, and the way back drains the third group before it goes.
3. An image change rolls out in engines: at every moment (a watch over every pod transition) decode has at
   most 3 engines (2 + a surge of one engine; an engine is there while its leader is: a group whose leader
   went leaves whole, LWS's garbage collector taking its workers), some revision has a whole ready prefill
   and decode engine, and the pool's 8 nodes were enough (a second set would not fit).
No request fails throughout, and no pod is deleted while its engine works on a request.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from disagg_connector import contract
from disagg_bench.vllm_sim.pods import PodEngines, assert_idle_when_deleted, assert_no_kv_trouble

from tests.fixtures.e2e.models import create_rolled_out, wide_ep_model
from tests.fixtures.e2e.serving import Serving
from tests.fixtures.e2e.nodes import Pool
from tests.fixtures.e2e.models import get_model, rolled_out
from tests.fixtures.e2e.waiting import Marks, PodStates, condition, engine_pods, pod_ready, wait_for

pytestmark = pytest.mark.e2e

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
NODES = 8  # prefill 1 + 1 surge, decode 2 x 2 + one surge engine of 2
NOT_YET = (client.ApiException, OSError)  # a simulator or the router not listening yet


@pytest.fixture
def pool(cluster, namespace) -> Any:
    with Pool.of(cluster.api_client(), f"{namespace}-mn", NODES) as nodes:
        yield nodes


def _engine_facts(pod: Any) -> tuple[str, str, str, bool]:
    meta = pod.metadata
    group = contract.engine_group(meta.name, meta.labels, meta.annotations)
    # the leader (index 0) stands for its engine: once it goes, LWS's garbage collector takes the workers
    key = group.key if group.index == 0 else f"{group.key}#worker"
    return meta.labels[contract.LABEL_ROLE], meta.labels[contract.LABEL_REVISION], key, pod_ready(pod)


class Engines(PodStates[tuple[str, str, str, bool]]):
    """After every pod event of the model: pod -> (role, revision, engine key, ready), terminating pods left out
    (as a Deployment's surge leaves them out)."""

    def __init__(self, api_client: Any, namespace: str, model: str):
        super().__init__(api_client, namespace, engine_pods(model), _engine_facts)

    @staticmethod
    def engines(state: dict[str, tuple[str, str, str, bool]], role: str) -> int:
        """Engines of the role whose leader is there (not terminating)."""
        return len({(revision, key) for r, revision, key, _ in state.values() if r == role and not key.endswith("#worker")})

    @staticmethod
    def whole(state: dict[str, tuple[str, str, str, bool]], role: str, pods_per_engine: int) -> set[tuple[str, str]]:
        """(revision, engine) of the role's engines whose every pod is ready in this state."""
        ready: dict[tuple[str, str], int] = {}
        for r, revision, engine, ok in state.values():
            if r == role and ok:
                ready[(revision, engine.removesuffix("#worker"))] = ready.get((revision, engine.removesuffix("#worker")), 0) + 1
        return {k for k, n in ready.items() if n == pods_per_engine}


def lws_of(api_client: Any, namespace: str, name: str) -> dict[str, Any]:
    return client.CustomObjectsApi(api_client).get_namespaced_custom_object(*LWS[:2], namespace, LWS[2], name)


def test_engines_that_span_nodes_serve_recreate_and_roll_out_in_engines(operator, cluster, api_client, namespace, pool,
                                                                         tmp_path: Path) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "wide"

    # --- 1. Ready, in engines ------------------------------------------------------------------------------
    first = create_rolled_out(custom, namespace, wide_ep_model(name, pool.label))
    revision = first["status"]["revision"]
    assert (first["status"]["decode"]["readyReplicas"], first["status"]["decode"]["replicas"]) == (2, 2)
    lws_name = contract.engine_deployment_name(name, "decode", revision)
    lws = lws_of(api_client, namespace, lws_name)
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "DisaggregatedModel"
    decode = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=decode").items
    groups = {(p.metadata.labels[contract.LWS_GROUP_INDEX_LABEL], p.metadata.labels[contract.LWS_WORKER_INDEX_LABEL]) for p in decode}
    assert groups == {("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}
    assert {p.spec.node_name for p in decode}.__len__() == 4, "one node per pod"
    for pod in decode:
        ranks = contract.identities_from_pod(pod.metadata.name, pod.metadata.uid, "10.0.0.1", pod.metadata.annotations, pod.metadata.labels)
        worker = int(pod.metadata.labels[contract.LWS_WORKER_INDEX_LABEL])
        assert [i.dp_rank for i in ranks] == list(range(8 * worker, 8 * worker + 8))
    prefill = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=prefill").items
    assert len(prefill) == 1 and contract.LWS_NAME_LABEL not in prefill[0].metadata.labels  # one pod: a Deployment

    served = first["spec"]["model"]["name"]
    with (
        Serving(cluster, namespace, name, served, tmp_path, listening=(1, 4)) as harness,
        Engines(api_client, namespace, name) as engines,
        Marks(api_client, namespace, engine_pods(name)) as marks,
    ):
        sims, router = harness.engines, harness.router
        wait_for("router offers 8 prefill ranks and 4 decode pods", lambda: router.table() == {revision: (8, 4)}, 60, retry_on=NOT_YET)
        background = harness.start_client(workers=4)
        wait_for("every prefill rank and decode pod served", lambda: _served(sims, revision) == (set(range(8)), 4), 120, retry_on=NOT_YET)

        # --- 2. a worker deleted by hand: its group is recreated whole ---------------------------------------
        leader = next(p for p in decode if p.metadata.labels[contract.LWS_GROUP_INDEX_LABEL] == "0"
                      and p.metadata.labels[contract.LWS_WORKER_INDEX_LABEL] == "0")  # fmt: skip
        worker = f"{leader.metadata.name}-1"
        core.delete_namespaced_pod(worker, namespace)
        wait_for("the router offers only the other group", lambda: router.table().get(revision) == (8, 2), 30, retry_on=NOT_YET)
        wait_for("group 0 recreated", lambda: (p := _pod(core, namespace, leader.metadata.name)) is not None
                 and p.metadata.uid != leader.metadata.uid, 120)  # fmt: skip
        back = wait_for("two ready decode engines again", lambda: (o := get_model(custom, namespace, name))
                        and o["status"]["decode"]["readyReplicas"] == 2 and condition(o, "Ready").get("status") == "True" and o, 120)
        assert back["status"]["revision"] == revision
        wait_for("the router offers the recreated group", lambda: router.table().get(revision) == (8, 4), 120, retry_on=NOT_YET)

        # --- 2b. scaled as an HPA scales it (the DisaggregatedRole's scale subresource), in engines ------------
        scaler = contract.role_scaler_name(name, "decode")
        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL, scaler, {"spec": {"replicas": 3}})
        wait_for("three ready decode engines", lambda: (o := get_model(custom, namespace, name))
                 and o["status"]["decode"]["readyReplicas"] == 3 and o, 120)  # fmt: skip
        assert lws_of(api_client, namespace, lws_name)["spec"]["replicas"] == 3
        scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL, scaler)
        assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)  # what an HPA reads: engines
        # group 0 is in the revision's prefill/decode pair (render/gang.py); the others have their own
        wait_for("the groups' PodGroups", lambda: {g["metadata"]["name"] for g in _pod_groups(api_client, namespace, lws_name)}
                 == {f"{lws_name}-{i}" for i in (1, 2)}, 30)  # fmt: skip
        wait_for("the router offers the third engine", lambda: router.table().get(revision) == (8, 6), 60, retry_on=NOT_YET)
        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL, scaler, {"spec": {"replicas": 2}})
        wait_for("back to two engines, the third drained and gone", lambda: lws_of(api_client, namespace, lws_name)["spec"]["replicas"] == 2
                 and (o := get_model(custom, namespace, name))["status"]["decode"]["replicas"] == 2, 120)  # fmt: skip
        wait_for("its PodGroup gone", lambda: {g["metadata"]["name"] for g in _pod_groups(api_client, namespace, lws_name)}
                 == {f"{lws_name}-1"}, 60)  # fmt: skip
        wait_for("the router offers two engines", lambda: router.table().get(revision) == (8, 4), 60, retry_on=NOT_YET)
        third = [f"{lws_name}-2", f"{lws_name}-2-1"]  # the group LWS removed (the highest index): leader, worker
        wait_for("the third group's engines stopped", lambda: all(e.final is not None for e in sims.all() if e.pod in third), 60)
        wait_for("the watch saw the third group go", lambda: set(third) <= set(marks.deleted), 30)
        assert_drained_before_deleted(sims, marks, third)

        # --- 3. an image rollout, in engines ------------------------------------------------------------------
        started = len(engines.states)
        before = {e.uid for e in sims.live()}
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                              {"spec": {"engine": {"image": "registry.example/vllm-runtime:0.33.0-next"}}})  # fmt: skip
        done = wait_for("image rollout complete", lambda: rolled_out(custom, namespace, name, revision), 600)
        assert done["status"]["decode"]["readyReplicas"] == 2
        background.wait_past(time.monotonic(), "the rollout")
        results = harness.stop_client()
        failed = [r for r in results if not r.ok]
        assert not failed and len(results) >= 20, (len(failed), len(results), failed[:3])
        engines.stop()
        during = [state for _, state in engines.states[started:]]
        assert len(during) > 8, "the watch saw the rollout"
        for state in during:
            engines_now = {role: Engines.engines(state, role) for role in ("prefill", "decode")}
            assert engines_now["decode"] <= 2 + 1 and engines_now["prefill"] <= 1 + 1, "\n".join(map(str, sorted(state.items())))
            paired = {v for v, _ in Engines.whole(state, "prefill", 1)} & {v for v, _ in Engines.whole(state, "decode", 2)}
            assert paired, f"no revision with a whole ready prefill and decode engine: {state}"
        old_lws = contract.engine_deployment_name(name, "decode", revision)
        wait_for("the old LeaderWorkerSet deleted", lambda: not _exists(api_client, namespace, old_lws), 60)
        # The rollout's retirements (the worker deleted by hand, and its leader that LWS deleted, were not idle
        # when they got their deletionTimestamp: their preStop drained them, and no request failed).
        retired = [e for e in sims.all() if e.uid in before and e.revision == revision]
        assert sorted(e.role for e in retired) == ["decode"] * 4 + ["prefill"], [(e.pod, e.role) for e in retired]
        assert_idle_when_deleted(retired)
        assert_no_kv_trouble(sims.all())


def assert_drained_before_deleted(sims: PodEngines, marks: Marks, pods: list[str]) -> None:
    """The group (`pods`, its leader first) was drained before it went: every pod of it was marked draining before
    its leader was deleted (the group goes with its leader: LWS's garbage collector takes the workers), each pod
    still bore the mark at its own deletion (a group the LWS was shrunk past keeps its marks: retirement.py), and
    each pod's engine was idle with nothing in flight at its own deletion (the simulator's stats as the pod got its
    deletionTimestamp, read before its preStop ran)."""
    leader = pods[0]
    assert leader in marks.deleted, f"{leader} was not deleted: {sorted(marks.deleted)}"
    went = marks.deleted[leader][0]
    for pod in pods:
        assert pod in marks.marked and marks.marked[pod][0] < went, \
            f"{pod} was not marked draining before its group went at {went}: marked {marks.marked.get(pod)}"
        assert pod in marks.deleted and marks.deleted[pod][1], \
            f"{pod} was deleted without the draining mark: first marked {marks.marked.get(pod)}, deleted {marks.deleted.get(pod)}"
        (engine,) = [e for e in sims.all() if e.pod == pod]
        hook = engine.pre_stop
        assert hook is not None and hook.stats_at_start is not None, f"{pod}: no preStop ran, or its engine was not listening"
        at = hook.stats_at_start
        busy = {k: at[k] for k in ("active", "waiting_for_kv")}
        assert not any(busy.values()) and not at["in_flight"], f"{pod} was deleted with work in flight: {busy} {at['in_flight']}"


def _pod_groups(api_client: Any, namespace: str, lws: str) -> list[dict[str, Any]]:
    """The PodGroups the operator made for an LWS's groups (the cluster serves them: hack/cluster.sh)."""
    return client.CustomObjectsApi(api_client).list_namespaced_custom_object(
        "scheduling.k8s.io", "v1beta1", namespace, "podgroups", label_selector=f"{contract.LWS_NAME_LABEL}={lws}")["items"]


def _served(sims: PodEngines, revision: str) -> tuple[set[int], int]:
    """(prefill ranks that got a leg, decode pods that got a leg) of a revision."""
    ranks = {e["rank"] for p in sims.all() if p.role == "prefill" and p.revision == revision for e in p.legs().values()}
    pods = sum(1 for p in sims.live("decode") if p.revision == revision and p.legs())
    return ranks, pods


def _pod(core: client.CoreV1Api, namespace: str, name: str) -> Any:
    try:
        pod = core.read_namespaced_pod(name, namespace)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise
    return None if pod.metadata.deletion_timestamp else pod


def _exists(api_client: Any, namespace: str, name: str) -> bool:
    try:
        lws_of(api_client, namespace, name)
    except client.ApiException as e:
        if e.status == 404:
            return False
        raise
    return True
