"""The P/D router: Deployment, Service, and the RBAC it needs to watch this model's pods.

The flags are the router's CLI contract (`disagg-router --help`); the router discovers prefill and
decode pods itself by label, so serving continues while the operator is down.
"""

from __future__ import annotations

from typing import Any

from disagg_connector import contract

from ..api.models import DisaggregatedModel
from ..config import RenderDefaults
from ..resolve import TransferPlan
from .meta import metadata
from .vllm import served_model_name

DEFAULT_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
SHUTDOWN_MARGIN_SECONDS = 15
# The router stops accepting at SIGTERM; this keeps it listening until Service endpoints drop it.
PRE_STOP_SECONDS = 5
# The API's policy names as the router's flags spell them (disagg-router --prefill-policy, --decode-policy).
PREFILL_POLICY_FLAGS = {"PrefixAndLoad": "prefix-and-load", "LeastOutstanding": "least-outstanding"}
DECODE_POLICY_FLAGS = {"LeastLoaded": "least-loaded", "LeastOutstanding": "least-outstanding"}


def router_args(dm: DisaggregatedModel) -> list[str]:
    router = dm.spec.router
    # No --mode: every engine pod carries its revision's transfer mode (contract.ANNOTATION_TRANSFER_MODE) and the
    # router follows it per revision, so a Push <-> Pull change neither restarts the routers nor mixes protocols.
    return [
        "--served-model-name", served_model_name(dm.spec),
        "--namespace", dm.metadata.namespace,
        "--model-name", dm.metadata.name,
        "--selector", f"{contract.LABEL_MODEL}={contract.model_label_value(dm.metadata.name)}",
        "--port", str(contract.ROUTER_PORT),
        "--leg-timeout-seconds", str(router.request_deadline_seconds),
        "--kv-lease-seconds", str(dm.spec.kv_transfer.lease_seconds),
        "--max-retries", str(router.max_retries),
        "--max-migrations", str(router.migration.max_migrations if router.migration.enabled else 0),
        "--migration-wait-seconds", str(router.migration.wait_seconds),
        "--disaggregation-threshold-tokens", str(router.disaggregation_threshold_tokens),
        "--prefill-policy", PREFILL_POLICY_FLAGS[router.prefill_policy],
        "--decode-policy", DECODE_POLICY_FLAGS[router.decode_policy],
        # A stopping router lets its streams end (aiohttp returns as soon as they have), as a retiring engine does.
        "--shutdown-grace-seconds", str(dm.spec.rollout.drain_timeout_seconds),
    ]  # fmt: skip


def _labels(dm: DisaggregatedModel) -> dict[str, str]:
    return contract.child_labels(dm.metadata.name, "router")


def service_account(dm: DisaggregatedModel) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(dm, contract.router_name(dm.metadata.name), _labels(dm)),
    }


def role(dm: DisaggregatedModel) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(dm, contract.router_name(dm.metadata.name), _labels(dm)),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            # the Events on its model when a decode fails mid-stream (router/incidents.py)
            {"apiGroups": [contract.API_GROUP], "resources": [contract.PLURAL], "resourceNames": [dm.metadata.name], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        ],
    }


def role_binding(dm: DisaggregatedModel) -> dict[str, Any]:
    name = contract.router_name(dm.metadata.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(dm, name, _labels(dm)),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": dm.metadata.namespace}],
    }


def deployment(dm: DisaggregatedModel, plan: TransferPlan, defaults: RenderDefaults) -> dict[str, Any]:
    model = dm.metadata.name
    router = dm.spec.router
    probe = {"httpGet": {"path": "/health", "port": contract.HTTP_PORT_NAME}, "periodSeconds": 5}
    resources = router.resources.model_dump(by_alias=True)
    if not resources["requests"] and not resources["limits"]:
        resources = DEFAULT_RESOURCES
    container = {
        "name": "router",
        "image": router.image or defaults.router_image,
        "command": ["disagg-router"],
        "args": router_args(dm),
        "ports": [{"name": contract.HTTP_PORT_NAME, "containerPort": contract.ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": {**probe, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "resources": resources,
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": contract.router_name(model),
        "terminationGracePeriodSeconds": PRE_STOP_SECONDS + dm.spec.rollout.drain_timeout_seconds + SHUTDOWN_MARGIN_SECONDS,
        "containers": [container],
    }
    if router.node_selector:
        pod_spec["nodeSelector"] = dict(router.node_selector)
    if router.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in router.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(dm, contract.router_name(model), _labels(dm)),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": contract.selector_labels(model, "router")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": _labels(dm)}, "spec": pod_spec},
        },
    }


def service(dm: DisaggregatedModel) -> dict[str, Any]:
    model = dm.metadata.name
    svc = dm.spec.router.service
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(dm, contract.router_name(model), _labels(dm), dict(svc.annotations) or None),
        "spec": {
            "type": svc.type,
            "selector": contract.selector_labels(model, "router"),
            "ports": [{"name": "http", "port": svc.port, "targetPort": contract.HTTP_PORT_NAME, "protocol": "TCP"}],
        },
    }
