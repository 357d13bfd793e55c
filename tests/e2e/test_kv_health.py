"""A status that proves KV moved: the operator reads its routers' /health (on the router pods' IPs, as in a
cluster) and sets KVTransferHealthy from their numbers. When a revision's simulated decode engines fail every
KV transfer, the condition goes False with reason TransfersFailing naming the revision; when they recover,
it goes back to True."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client

from disagg_connector import contract
from disagg_bench.vllm_sim.pods import PodEngines, start_pod_router

from tests.fixtures.e2e.models import model_manifest
from tests.fixtures.e2e.traffic import BackgroundClient, wait_for
from tests.fixtures.e2e.waiting import condition
from tests.fixtures.e2e.traffic import control

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL


def test_kv_transfer_healthy_follows_the_routers_numbers(operator, cluster, api_client, namespace, tmp_path: Path) -> None:
    custom = client.CustomObjectsApi(api_client)
    name = "kvh"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                           model_manifest(name, {"router": {"disaggregationThresholdTokens": 0}}))  # fmt: skip

    def kv() -> dict[str, Any]:
        return condition(custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name), "KVTransferHealthy")

    obj = wait_for("Ready", lambda: (o := custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
                   and condition(o, "Ready").get("status") == "True" and o, 120)
    revision, served = obj["status"]["revision"], obj["spec"]["model"]["name"]
    engines = PodEngines(cluster.api_client(), namespace, name, served, tmp_path, stop_gone=True)
    engines.start()
    router = start_pod_router(cluster, namespace, name, tmp_path)
    background = BackgroundClient(router.url, served, workers=2)
    try:
        wait_for("engines listening", lambda: engines.serving(1, 1), 60)
        wait_for("router table", lambda: router.table() == {revision: (1, 1)}, 60)
        background.start()
        healthy = wait_for("KVTransferHealthy True", lambda: (c := kv()).get("status") == "True" and c, 90)
        assert healthy["reason"] == "TransfersSucceeding" and f"revision {revision}" in healthy["message"]

        for engine in engines.live("decode"):
            control(engine.url, fail_transfers=True)
        failing = wait_for("KVTransferHealthy False", lambda: (c := kv()).get("status") == "False" and c, 90)
        assert failing["reason"] == "TransfersFailing" and f"revision {revision}" in failing["message"], failing
        assert "decode_failed" in failing["message"]

        for engine in engines.live("decode"):
            control(engine.url, fail_transfers=False)
        back = wait_for("KVTransferHealthy True again", lambda: (c := kv()).get("status") == "True" and c, 150)
        assert back["reason"] == "TransfersSucceeding"
    finally:
        background.stop()
        router.proc.stop()
        engines.stop()
