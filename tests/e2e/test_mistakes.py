"""Realistic mistakes, made the way a new user makes them, on the real API server with the operator running.

Each one is either refused at admission with a message naming the field, or reaches the model's status
within 30 s with a reason and a message naming the child and what the API server said; nothing of the
pass is half-written, nothing running is lost, and the operator process never restarts.

The admission half (the stalls and silent overrides of issue 9: a dotted name, limits below requests, a
toleration Exists with a value, a bad nodeSelector key, managed vLLM flags with underscores, --config, GPUs
named in resources, and more of our own) is every case of tests/unit/operator/api/test_api.py INVALID, applied to the
API server by test_operator.py; the names are here. The status half is here.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from kubernetes import client

from disagg_connector import contract

from tests.fixtures.e2e.models import model_manifest
from tests.fixtures.e2e.operator import model_passes
from tests.fixtures.e2e.waiting import condition, wait_for

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
STATUS_BOUND = 30.0


@pytest.mark.parametrize("name", ["qwen3.5-small", "3b-chat"])
def test_a_name_no_service_can_carry_is_refused_at_admission(crd_installed, cluster, namespace, tmp_path: Path, name: str) -> None:
    file = tmp_path / "m.yaml"
    file.write_text(yaml.safe_dump({**model_manifest(name), "metadata": {"name": name, "namespace": namespace}}))
    result = cluster.kubectl("apply", "--server-side", "-f", str(file), check=False)
    assert result.returncode != 0 and "metadata.name must start with a letter" in result.stderr, result.stderr
    assert "qwen3-5-small" in result.stderr  # the message says what to write instead


@dataclass
class Mistake:
    id: str
    patch: dict[str, Any]
    reason: str
    phrases: tuple[str, ...]  # in the Ready condition's message: the child and the API server's words
    setup: Callable[[client.ApiClient, str], None] = field(default=lambda api, ns: None)


def _quota(api: client.ApiClient, ns: str) -> None:
    client.CoreV1Api(api).create_namespaced_resource_quota(ns, {
        "metadata": {"name": "no-gpus"}, "spec": {"hard": {"requests.nvidia.com/gpu": "0"}}})  # fmt: skip


def _limit_range(api: client.ApiClient, ns: str) -> None:
    client.CoreV1Api(api).create_namespaced_limit_range(ns, {
        "metadata": {"name": "small"}, "spec": {"limits": [{"type": "Container", "max": {"memory": "16Gi"}}]}})  # fmt: skip


def _restricted(api: client.ApiClient, ns: str) -> None:
    client.CoreV1Api(api).patch_namespace(ns, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})


def _taken_router_service(api: client.ApiClient, ns: str) -> None:
    client.CoreV1Api(api).create_namespaced_service(ns, {
        "metadata": {"name": "m-router", "labels": {"team": "web"}},
        "spec": {"ports": [{"port": 80}], "selector": {"app": "web"}}})  # fmt: skip


MISTAKES = [
    Mistake("affinity-without-terms",
            {"decode": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}}},
            "ChildRejected", ("Deployment m-decode-", "nodeSelectorTerms", "nothing was changed")),
    Mistake("affinity-empty-topology-key",
            {"prefill": {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": ""}]}}}},
            "ChildRejected", ("Deployment m-prefill-", "topologyKey")),
    # One role only: with both, their revision's pair PodGroup (same priority) is refused first, ChildRejected
    # (tests/unit/operator/test_reconciler.py), where the cluster serves PodGroups.
    Mistake("missing-priority-class", {"prefill": {"priorityClassName": "gold"}},
            "PodCreationFailed", ("Deployment m-", "no PriorityClass with name gold")),
    Mistake("namespace-gpu-quota", {}, "QuotaExceeded", ("Deployment m-", "exceeded quota: no-gpus"), _quota),
    Mistake("namespace-limit-range", {}, "PodCreationFailed", ("Deployment m-", "must be less than or equal to memory limit of 16Gi"),
            _limit_range),
    Mistake("pod-security-restricted", {}, "PodCreationFailed", ("Deployment m-", "violates PodSecurity", "IPC_LOCK"), _restricted),
    Mistake("router-service-name-taken", {}, "OwnershipConflict", ("Service m-router", "never changes or deletes it"),
            _taken_router_service),
    Mistake("missing-model-claim", {"model": {"source": {"uri": "pvc://weights/qwen3"}}},
            "Unschedulable", ("pod m-", 'persistentvolumeclaim "weights" not found')),
]


def _namespace(api: client.ApiClient) -> str:
    core = client.CoreV1Api(api)
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for("default ServiceAccount", lambda: core.read_namespaced_service_account("default", name), 30)
    return name


def test_mistakes_reach_status_naming_child_and_field(operator, api_client) -> None:
    custom = client.CustomObjectsApi(api_client)
    core = client.CoreV1Api(api_client)
    pid = operator.proc.pid
    namespaces = {m.id: _namespace(api_client) for m in MISTAKES}
    try:
        started = {}
        for m in MISTAKES:
            m.setup(api_client, namespaces[m.id])
            custom.create_namespaced_custom_object(GROUP, VERSION, namespaces[m.id], PLURAL, model_manifest("m", m.patch))
            started[m.id] = time.monotonic()
        for m in MISTAKES:
            ns = namespaces[m.id]

            def reported() -> dict[str, Any] | None:
                ready = condition(custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "m"), "Ready")
                return ready if ready.get("reason") == m.reason else None

            ready = wait_for(f"{m.id}: Ready reason {m.reason}", reported, max(1.0, STATUS_BOUND - (time.monotonic() - started[m.id])))
            assert ready["status"] == "False"
            for phrase in m.phrases:
                assert phrase in ready["message"], (m.id, phrase, ready["message"])

        # Nothing half-applied: a refused pass wrote no child at all.
        ns = namespaces["affinity-without-terms"]
        assert not client.AppsV1Api(api_client).list_namespaced_deployment(ns).items
        assert not core.list_namespaced_service(ns).items
        # The same-named Service is someone else's: untouched, and not adopted.
        ns = namespaces["router-service-name-taken"]
        taken = core.read_namespaced_service("m-router", ns)
        assert taken.metadata.labels == {"team": "web"} and not taken.metadata.owner_references
        assert contract.FIELD_MANAGER not in {f.manager for f in taken.metadata.managed_fields or []}

        # Fixing the spec is all it takes.
        fixed = "affinity-without-terms"
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespaces[fixed], PLURAL, "m",
                                              {"spec": {"decode": {"affinity": None}}})  # fmt: skip
        wait_for("the fixed model Ready", lambda: condition(
            custom.get_namespaced_custom_object(GROUP, VERSION, namespaces[fixed], PLURAL, "m"), "Ready").get("status") == "True")
        # The owner of the taken name deletes the model: their Service survives it.
        ns = namespaces["router-service-name-taken"]
        passes = model_passes(operator.metrics_port, ns, "m")
        custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "m")
        # The operator saw it gone: a pass of the model after its deletion (the DELETED event queues one), nothing
        # more to do for it. (Nothing owns the Service, so no garbage collector could take it.)
        wait_for("the model gone, and a pass of it after", lambda: _gone(custom, ns, "m")
                 and model_passes(operator.metrics_port, ns, "m") > passes, 60)  # fmt: skip
        assert core.read_namespaced_service("m-router", ns).metadata.uid == taken.metadata.uid
        assert operator.alive() and operator.proc.pid == pid, "the operator never restarts"
    finally:
        for ns in namespaces.values():
            core.delete_namespace(ns, propagation_policy="Background")


def _gone(custom: client.CustomObjectsApi, ns: str, name: str) -> bool:
    try:
        custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    except client.ApiException as e:
        if e.status == 404:
            return True
        raise
    return False
