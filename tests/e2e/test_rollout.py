"""Rollouts that fit a GPU budget, under traffic, on the real API server.

A 4P4D model whose pods each take a whole fake p5en node (8 GPUs), on a pool of exactly 10 such nodes: the
4P4D set and one surge pod per role fit, a second full set cannot. Simulated engines listen on every engine
pod's IP (bench/disagg_bench/vllm_sim/pods.py), the router runs on its router pod's IP at the router port (so the operator
reads its /health as it would in a cluster), and a client keeps sending requests through it.

1. A release change, vLLM 0.33.0 -> 0.34.0 (an image of it and spec.engine.vllmVersion), rolls out to the end.
   A watch over every pod transition proves, at every moment: pods per role <= target + maxSurge (1), some
   revision has a ready prefill and a ready decode, the ready P:D ratio within one pod of 4:4. Zero failed
   requests, and no request had legs on engines of two releases: each pod's engine answers as its pod's release,
   and vLLM's NIXL handshake (so the simulator's) refuses a peer of another release.
2. A Push -> Pull change under the same traffic, with decode scaled 4 -> 6 through its DisaggregatedRole's
   scale subresource in the middle: the rollout finishes at 6 on the same revision (not restarted), zero
   failed requests (a request in the wrong protocol fails in the simulator as it fails in vLLM).
3. Retirement: no engine pod is deleted while its simulator still works on a request: every simulator
   event of a retired pod happened before the pod's deletion.
Plus: an HPA the operator renders for `autoscaling` resolves its scale target (AbleToScale=True from the
kube-controller-manager's HPA controller).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from disagg_connector import contract
from disagg_bench.vllm_sim.pods import assert_idle_when_deleted, assert_no_kv_trouble

from tests.fixtures.e2e.models import PRODUCTION_DRAIN_TIMEOUT, model_manifest
from tests.fixtures.e2e.serving import Serving
from tests.fixtures.e2e.traffic import wait_for
from tests.fixtures.e2e.waiting import PodStates, condition, engine_pods, pod_ready
from tests.fixtures.e2e.models import GROUP, PLURAL, VERSION, get_model, rolled_out
from tests.fixtures.e2e.nodes import POOL, Pool

NODES = 10
SURGE = 1


@pytest.fixture
def pool(cluster, namespace) -> Any:
    with Pool.of(cluster.api_client(), namespace, NODES) as nodes:
        yield nodes


def big_model(name: str, pool_label: str, mode: str) -> dict[str, Any]:
    role = {"replicas": 4, "parallelism": {"tensor": 8}, "accelerator": {"count": 8}, "nodeSelector": {POOL: pool_label}}
    return model_manifest(name, {
        # Retries: kwok makes a pod Ready the moment it is bound and hands it a freed IP at once, so the router can
        # try a pod before its simulated engine listens (a real engine turns Ready only once it serves).
        "kvTransfer": {"mode": mode, "leaseSeconds": 120}, "router": {"replicas": 1, "requestDeadlineSeconds": 60,
                                                                        "disaggregationThresholdTokens": 0, "maxRetries": 3},
        "prefill": role, "decode": copy.deepcopy(role),
        "network": {"placement": {"zone": "None", "spine": "None"}}, **PRODUCTION_DRAIN_TIMEOUT,
    })  # fmt: skip


def _role_revision_ready(pod: Any) -> tuple[str, str, bool]:
    labels = pod.metadata.labels
    return labels[contract.LABEL_ROLE], labels[contract.LABEL_REVISION], pod_ready(pod)


class Timeline(PodStates[tuple[str, str, bool]]):
    """After every pod event of the model: pod -> (role, revision, ready); and when each pod went."""

    def __init__(self, api_client: Any, namespace: str, model: str):
        super().__init__(api_client, namespace, engine_pods(model), _role_revision_ready)

    def check(self, targets: dict[str, int], since: float = 0.0, until: float = float("inf"), ratio: bool = True) -> dict[str, int]:
        """The invariants over every recorded state in [since, until]; returns the peak pods per role."""
        peak = {"prefill": 0, "decode": 0}
        for t, pods in self.states:
            if not since <= t <= until:
                continue
            for role in peak:
                count = sum(1 for r, _, _ in pods.values() if r == role)
                peak[role] = max(peak[role], count)
                assert count <= targets[role] + SURGE, (role, count, pods)
            ready = {(r, v) for r, v, ok in pods.values() if ok}
            prefill_revs = {v for r, v in ready if r == "prefill"}
            decode_revs = {v for r, v in ready if r == "decode"}
            assert prefill_revs & decode_revs, f"no revision with a ready pair: {pods}"
            if ratio:
                p = sum(1 for r, _, ok in pods.values() if ok and r == "prefill")
                d = sum(1 for r, _, ok in pods.values() if ok and r == "decode")
                expected = d * targets["prefill"] / targets["decode"]
                assert abs(p - expected) <= 1, f"ready P:D {p}:{d} against {targets}: {pods}"
        return peak


def test_rollouts_fit_the_budget_under_traffic(operator, cluster, api_client, namespace, pool, tmp_path: Path) -> None:
    custom, apps = client.CustomObjectsApi(api_client), client.AppsV1Api(api_client)
    name = "big"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, big_model(name, pool.label, "Push"))
    first = wait_for("4P4D Ready", lambda: (o := get_model(custom, namespace, name)) and condition(o, "Ready").get("status") == "True"
                     and o["status"]["decode"]["readyReplicas"] == 4 and o, 180)["status"]["revision"]
    served = get_model(custom, namespace, name)["spec"]["model"]["name"]

    with (
        Serving(cluster, namespace, name, served, tmp_path, listening=(4, 4)) as harness,
        Timeline(cluster.api_client(), namespace, name) as timeline,
    ):
        engines, router = harness.engines, harness.router
        wait_for("router table 4P4D", lambda: router.table() == {first: (4, 4)}, 60)
        background = harness.start_client(workers=3)
        wait_for("traffic", lambda: len(background.results) >= 6)

        # --- 1. a release change: 0.33.0 -> 0.34.0 -----------------------------------------------------
        started = time.monotonic()
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"engine": {
            "image": "registry.example/vllm-runtime:0.34.0-efa", "vllmVersion": "0.34.0"}}})  # fmt: skip
        second = wait_for("release rollout complete", lambda: rolled_out(custom, namespace, name, first), 600)["status"]["revision"]
        peak_image = timeline.check({"prefill": 4, "decode": 4}, since=started)
        assert peak_image == {"prefill": 5, "decode": 5}, peak_image
        assert not background.failures(), background.failures()[:3]
        releases = {(e.revision, e.vllm_version) for e in engines.all()}
        assert releases == {(first, "0.33.0"), (second, "0.34.0")}, releases
        legs_by_request: dict[str, set[str | None]] = {}
        for engine in engines.all():
            for xid in engine.legs():
                legs_by_request.setdefault(xid, set()).add(engine.vllm_version)
        assert {frozenset(v) for v in legs_by_request.values()} == {frozenset({"0.33.0"}), frozenset({"0.34.0"})}, \
            "every request's legs ran on one release, and both releases served"

        # --- 2. Push -> Pull, decode scaled 4 -> 6 through the scale subresource mid-rollout ------------
        started = time.monotonic()
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"kvTransfer": {"mode": "Pull"}}})
        third = wait_for("the Pull revision", lambda: (r := get_model(custom, namespace, name)["status"].get("revision")) != second and r, 60)
        wait_for("a ready Pull pair", lambda: any(v == third and ok and r == "decode" for r, v, ok in timeline.states[-1][1].values())
                 and any(v == third and ok and r == "prefill" for r, v, ok in timeline.states[-1][1].values()), 300)
        new_decode = apps.read_namespaced_deployment(contract.engine_deployment_name(name, "decode", third), namespace)
        pool.add(2)  # what a cluster autoscaler would bring for two more decode pods
        scaled_at = time.monotonic()
        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL,
                                                    contract.role_scaler_name(name, "decode"), {"spec": {"replicas": 6}})  # fmt: skip
        done = wait_for("Pull rollout complete at 6 decode", lambda: (o := rolled_out(custom, namespace, name, second))
                        and o["status"]["decode"]["readyReplicas"] == 6 and o, 600)  # fmt: skip
        assert done["status"]["revision"] == third and done["status"]["transferMode"] == "Pull", "the rollout was not restarted"
        assert done["status"]["decode"]["targetReplicas"] == 6
        again = apps.read_namespaced_deployment(contract.engine_deployment_name(name, "decode", third), namespace)
        assert again.metadata.uid == new_decode.metadata.uid and again.spec.replicas == 6
        timeline.check({"prefill": 4, "decode": 4}, since=started, until=scaled_at)
        timeline.check({"prefill": 4, "decode": 6}, since=scaled_at, ratio=False)  # the target ratio itself moved
        assert get_model(custom, namespace, name)["spec"]["decode"]["replicas"] == 4, "the spec is the user's, untouched"

        background.wait_past(time.monotonic(), "the Pull rollout")
        results = harness.stop_client()
        failed = [r for r in results if not r.ok]
        assert not failed and len(results) >= 30, (len(failed), len(results), failed[:3])

        # --- 3. no pod went while its engine still worked on a request ----------------------------------
        timeline.stop()
        retired = [e for e in engines.all() if e.pod in timeline.deleted]
        assert len(retired) >= 16, f"both rollouts retired every old pod: {len(retired)}"
        assert sum(1 for e in retired for ev in e.events() if ev["kind"] == "leg_received"), "the retired pods served"
        assert_idle_when_deleted(retired)
        assert_no_kv_trouble(engines.all())


def test_the_rendered_hpa_resolves_its_scale_target(operator, api_client, namespace) -> None:
    custom = client.CustomObjectsApi(api_client)
    autoscaling = {"minReplicas": 1, "maxReplicas": 3, "metrics": [{"type": "Pods", "pods": {
        "metric": {"name": "vllm:num_requests_waiting"}, "target": {"type": "AverageValue", "averageValue": "4"}}}]}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("auto", {"decode": {"autoscaling": autoscaling}}))
    hpa_api = client.AutoscalingV2Api(api_client)

    def able() -> Any:
        hpa = hpa_api.read_namespaced_horizontal_pod_autoscaler(contract.role_scaler_name("auto", "decode"), namespace)
        found = {c.type: c for c in (hpa.status.conditions or [])} if hpa.status else {}
        able = found.get("AbleToScale")
        return able if able is not None and able.status == "True" else None

    cond = wait_for("the HPA controller reads the DisaggregatedRole's scale", able, 120)
    assert cond.reason in ("SucceededGetScale", "ReadyForNewScale", "SucceededRescale"), cond
    # The role's status comes with the pass after the one that created it; the HPA may read its scale before.
    selector = wait_for("the DisaggregatedRole's status names its pods' selector", lambda: (custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, contract.ROLE_PLURAL, contract.role_scaler_name("auto", "decode")).get("status") or {}).get("selector"), 60)
    assert selector == f"{contract.LABEL_MODEL}=auto,{contract.LABEL_ROLE}=decode"
