"""Gateway API inference routing (spec.gateway): GAIE's "router as the pool" shape (docs/gateway.md).

- an InferencePool (inference.networking.k8s.io/v1) selecting the model's router pods on the router port: the
  gateway sends each request to one router pod, which pairs prefill and decode, pushes concurrently and keeps
  the revision fence, as it does behind the router's Service;
- an HTTPRoute from the parent Gateways to that pool;
- with endpointPicker Lwepp, GAIE's lightweight endpoint picker for the pool (Deployment, Service and the RBAC
  it reads the pool and its pods with), for gateways that need one.

One pool per model, not per revision: the router is one Deployment per model and splits traffic between
revisions itself, by ready pairs (docs/router.md), so a pool per revision would select the same pods twice.
"""

from __future__ import annotations

from typing import Any

from disagg_connector import contract

from ..api.models import LWEPP_IMAGE, DisaggregatedModel, GatewaySpec
from .meta import metadata

INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND, INFERENCE_POOL_PLURAL = (
    "inference.networking.k8s.io/v1", "InferencePool", "inferencepools")
HTTP_ROUTE_API_VERSION, HTTP_ROUTE_KIND, HTTP_ROUTE_PLURAL = "gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes"
INSTALL_HINTS = {
    INFERENCE_POOL_KIND: "spec.gateway needs the Gateway API Inference Extension's CRDs: kubectl apply -f "
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/v1.6.0/manifests.yaml "
    "(v1.6.0 is tested), or remove spec.gateway",
    HTTP_ROUTE_KIND: "spec.gateway needs Gateway API's CRDs: kubectl apply --server-side -f "
    "https://github.com/kubernetes-sigs/gateway-api/releases/download/v1.6.3/standard-install.yaml "
    "(v1.6.3 is tested), or remove spec.gateway",
}
LWEPP_COMPONENT = "lwepp"


def objects(dm: DisaggregatedModel) -> list[dict[str, Any]]:
    """Every child of spec.gateway (none without it)."""
    gw = dm.spec.gateway
    if gw is None:
        return []
    out = [inference_pool(dm, gw), http_route(dm, gw)]
    if gw.endpoint_picker == "Lwepp":
        out += lwepp(dm, gw)
    return out


def _labels(dm: DisaggregatedModel, component: str) -> dict[str, str]:
    return contract.common_labels(dm.metadata.name, component)


def inference_pool(dm: DisaggregatedModel, gw: GatewaySpec) -> dict[str, Any]:
    model = dm.metadata.name
    spec: dict[str, Any] = {
        # The router Deployment's own selector: exactly its pods, every revision's traffic behind them.
        "selector": {"matchLabels": contract.selector_labels(model, "router")},
        "targetPorts": [{"number": contract.ROUTER_PORT}],
    }
    if gw.endpoint_picker == "Lwepp":
        # Fail closed: a gateway that cannot ask its picker answers an error instead of guessing an endpoint.
        spec["endpointPickerRef"] = {"kind": "Service", "name": contract.endpoint_picker_name(model),
                                     "port": {"number": contract.LWEPP_GRPC_PORT}, "failureMode": "FailClose"}  # fmt: skip
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": INFERENCE_POOL_KIND,
        "metadata": metadata(dm, contract.inference_pool_name(model), _labels(dm, "inference-pool")),
        "spec": spec,
    }


def http_route(dm: DisaggregatedModel, gw: GatewaySpec) -> dict[str, Any]:
    model = dm.metadata.name
    parents = []
    for ref in gw.parent_refs:
        parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": ref.name}
        if ref.namespace:
            parent["namespace"] = ref.namespace
        if ref.section_name:
            parent["sectionName"] = ref.section_name
        parents.append(parent)
    spec: dict[str, Any] = {"parentRefs": parents}
    if gw.hostnames:
        spec["hostnames"] = list(gw.hostnames)
    spec["rules"] = [{
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": "inference.networking.k8s.io", "kind": INFERENCE_POOL_KIND,
                         "name": contract.inference_pool_name(model)}],
    }]  # fmt: skip
    return {
        "apiVersion": HTTP_ROUTE_API_VERSION,
        "kind": HTTP_ROUTE_KIND,
        "metadata": metadata(dm, contract.http_route_name(model), _labels(dm, "http-route")),
        "spec": spec,
    }


def lwepp(dm: DisaggregatedModel, gw: GatewaySpec) -> list[dict[str, Any]]:
    """GAIE's lwepp for the pool: it watches the pool and its pods in this namespace (a Role, not a ClusterRole)
    and answers the gateway's ext-proc calls with a ready router pod. Its pods carry no model label: the router
    and the operator's census read only engine and router pods."""
    model = dm.metadata.name
    name = contract.endpoint_picker_name(model)
    labels = _labels(dm, LWEPP_COMPONENT)
    pod_labels = {contract.LABEL_NAME: contract.APP_NAME, contract.LABEL_INSTANCE: contract.model_label_value(model),
                  contract.LABEL_COMPONENT: LWEPP_COMPONENT}  # fmt: skip
    grpc_health = {"grpc": {"port": contract.LWEPP_HEALTH_PORT, "service": "inference-extension"}}
    container = {
        "name": LWEPP_COMPONENT,
        "image": gw.endpoint_picker_image or LWEPP_IMAGE,
        "args": [
            "--pool-name", contract.inference_pool_name(model),
            "--pool-namespace", dm.metadata.namespace,
            "--pool-group", "inference.networking.k8s.io",
            "--grpc-port", str(contract.LWEPP_GRPC_PORT),
            "--grpc-health-port", str(contract.LWEPP_HEALTH_PORT),
            "--metrics-port", str(contract.LWEPP_METRICS_PORT),
        ],  # fmt: skip
        "ports": [{"name": "grpc", "containerPort": contract.LWEPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": contract.LWEPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": contract.LWEPP_METRICS_PORT, "protocol": "TCP"}],  # fmt: skip
        "readinessProbe": {**grpc_health, "periodSeconds": 5},
        "livenessProbe": {**grpc_health, "periodSeconds": 10, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
    }  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(dm, name, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(dm, name, labels),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["inference.networking.k8s.io"], "resources": [INFERENCE_POOL_PLURAL],
                 "verbs": ["get", "list", "watch"]},
            ],  # fmt: skip
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(dm, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": dm.metadata.namespace}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": metadata(dm, name, labels),
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": pod_labels},
                "template": {"metadata": {"labels": pod_labels},
                             "spec": {"serviceAccountName": name, "containers": [container]}},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata(dm, name, labels),
            "spec": {
                "selector": pod_labels,
                # lwepp serves gRPC over TLS with a certificate of its own (its default), as GAIE's gateways expect.
                "ports": [{"name": "grpc", "port": contract.LWEPP_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"}],
            },
        },
    ]
