"""Triggers that cannot be lost: the resync repairs what no event announced, and an API server that stops
answering in the middle of a pass delays the change it was making, never loses it. Plus the operator's
/metrics, whose counters move with the work."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from disagg_connector import contract

from tests.fixtures.e2e.models import model_manifest
from disagg_bench.operator_process import E2E_RESYNC_SECONDS
from tests.fixtures.e2e.waiting import condition, wait_for
from tests.fixtures.e2e.operator import scrape

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL


def create_ready(custom: client.CustomObjectsApi, namespace: str, name: str, spec_patch: dict[str, Any] | None = None) -> dict[str, Any]:
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name, spec_patch))
    return wait_ready(custom, namespace, name)


def wait_ready(custom: client.CustomObjectsApi, namespace: str, name: str, timeout: float = 120) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        current = (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
        return obj if current and condition(obj, "Ready").get("status") == "True" else None

    return wait_for(f"{namespace}/{name} Ready", ready, timeout)


def test_hand_deleted_deployment_comes_back(operator, api_client, namespace) -> None:
    custom, apps = client.CustomObjectsApi(api_client), client.AppsV1Api(api_client)
    revision = create_ready(custom, namespace, "hand")["status"]["revision"]
    name = contract.engine_deployment_name("hand", "decode", revision)
    old_uid = apps.read_namespaced_deployment(name, namespace).metadata.uid
    apps.delete_namespaced_deployment(name, namespace)
    back = wait_for("the Deployment back", lambda: (d := apps.read_namespaced_deployment(name, namespace)).metadata.uid != old_uid and d,
                    E2E_RESYNC_SECONDS + 15)
    assert back.metadata.labels[contract.LABEL_REVISION] == revision
    wait_ready(custom, namespace, "hand")


def test_resync_repairs_what_no_event_announces(operator, api_client, namespace) -> None:
    """Removing our managed-by label takes a child out of every watch the operator has: no event reaches
    it; only the periodic resync notices the child missing, finds it by name and puts the label back."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    create_ready(custom, namespace, "quiet")
    service = contract.role_service_name("quiet", "prefill")
    core.patch_namespaced_service(service, namespace, {"metadata": {"labels": {contract.LABEL_MANAGED_BY: None}}})
    removed = time.monotonic()
    wait_for("the label back", lambda: (core.read_namespaced_service(service, namespace).metadata.labels or {})
             .get(contract.LABEL_MANAGED_BY) == contract.OPERATOR_NAME, E2E_RESYNC_SECONDS + 20)
    assert time.monotonic() - removed <= E2E_RESYNC_SECONDS + 20


def _apiserver_pid() -> int:
    state = Path(os.environ.get("DISAGG_STATE") or Path.home() / ".cache" / "disagg-operator" / "cluster")
    return int((state / "pids" / "kube-apiserver.pid").read_text().strip())


def test_api_server_stopped_mid_pass_loses_no_change(operator, cluster, api_client, namespace) -> None:
    if not cluster.local:
        pytest.skip("stops the local control plane's kube-apiserver (DISAGG_E2E_USE_KUBECONFIG points elsewhere)")
    custom, apps = client.CustomObjectsApi(api_client), client.AppsV1Api(api_client)
    before = create_ready(custom, namespace, "frozen")["status"]["revision"]
    pid = operator.proc.pid
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "frozen",
                                          {"spec": {"engine": {"image": "registry.example/vllm-runtime:frozen"}}})  # fmt: skip
    time.sleep(0.2)  # the operator's pass has begun writing the new revision
    apiserver = _apiserver_pid()
    os.kill(apiserver, signal.SIGSTOP)
    try:
        time.sleep(20)
    finally:
        os.kill(apiserver, signal.SIGCONT)
    obj = wait_ready(custom, namespace, "frozen", timeout=180)
    assert obj["status"]["revision"] != before
    wait_for("the old revision retired", lambda: condition(custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "frozen"), "Progressing").get("reason") == "Complete", 60)
    images = {d.spec.template.spec.containers[0].image for d in apps.list_namespaced_deployment(namespace).items
              if (d.metadata.labels or {}).get(contract.LABEL_ROLE) in contract.ENGINE_ROLES}
    assert images == {"registry.example/vllm-runtime:frozen"}, "the change made before the stop is applied, old revision retired"
    assert operator.alive() and operator.proc.pid == pid


def test_metrics_move_with_the_work(operator, api_client, namespace) -> None:
    custom = client.CustomObjectsApi(api_client)
    before = scrape(operator.metrics_port)
    create_ready(custom, namespace, "counted")
    after = scrape(operator.metrics_port)
    success = 'controller_runtime_reconcile_total{controller="disaggregatedmodel",result="success"}'
    deployments = 'disagg_operator_children_applied_total{kind="Deployment"}'
    assert after[success] > before.get(success, 0)
    assert after[deployments] >= before.get(deployments, 0) + 3  # prefill, decode, router
    assert after['disagg_operator_models{phase="Ready"}'] >= 1
    assert 'controller_runtime_reconcile_time_seconds_count{controller="disaggregatedmodel"}' in after
    assert after['controller_runtime_max_concurrent_reconciles{controller="disaggregatedmodel"}'] >= 1
