"""Gateway API inference routing (issue 21, item 4) on the real API server with the upstream CRDs.

hack/cluster.sh up installs GAIE v1.6.0's InferencePool CRD and Gateway API v1.6.3's GatewayClass, Gateway and
HTTPRoute CRDs, copied from their Go modules: their schemas and CEL rules judge what the operator writes. No
gateway controller runs here (none is in the registries this project may use), so the Gateway is never
programmed; what is shown is that the API server stores the operator's InferencePool and HTTPRoute as rendered,
that the pool's selector picks exactly the model's router pods, and that a malformed spec.gateway is refused at
admission with the field and the fix.

Waits are on conditions; nothing sleeps to synchronise.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any, Iterator

import pytest
from kubernetes import client

from disagg_connector import contract
from disagg_bench.ports import free_port

from tests.fixtures.e2e.models import model_manifest
from tests.fixtures.e2e.models import pods_of, wait_ready
from tests.fixtures.e2e.waiting import pod_ready, wait_for
from tests.fixtures.e2e.cluster import built

pytestmark = pytest.mark.e2e

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
GW_GROUP, GW_VERSION = "gateway.networking.k8s.io", "v1"
UPSTREAM_CRDS = ("inferencepools.inference.networking.k8s.io", "gatewayclasses.gateway.networking.k8s.io",
                 "gateways.gateway.networking.k8s.io", "httproutes.gateway.networking.k8s.io")  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def upstream_crds(cluster) -> None:
    """hack/cluster.sh up installs them; a cluster from KUBECONFIG must have them too (this test is about them)."""
    api = client.ApiextensionsV1Api(cluster.api_client())
    names = {c.metadata.name for c in api.list_custom_resource_definition().items}
    missing = [c for c in UPSTREAM_CRDS if c not in names]
    assert not missing, f"the cluster lacks {missing}: run hack/cluster.sh up (it installs them from their Go modules)"


@pytest.fixture
def run_lwepp(cluster, tmp_path) -> Iterator[Any]:
    """Starts the real lwepp with the given arguments (ports of its own on this machine) against the local API server;
    yields a function that does that and returns the ext-proc address."""
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []

    def start(args: list[str]) -> str:
        grpc_port = free_port()
        own = ["--grpc-port", str(grpc_port), "--grpc-health-port", str(free_port()), "--metrics-port", str(free_port())]
        log = (tmp_path / f"lwepp-{len(procs)}.log").open("wb")
        logs.append(log)
        procs.append(subprocess.Popen([str(built("lwepp")), *args, *own], stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "KUBECONFIG": cluster.kubeconfig}))  # fmt: skip
        return f"127.0.0.1:{grpc_port}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=20)
    for log in logs:
        log.close()


def ask(address: str, requests: int) -> list[str] | None:
    """`lwepp-ask`: what a gateway asks the picker (ext_proc request headers, end of stream) and the endpoints it
    sets; None while it cannot answer yet (starting, its pool not synced)."""
    done = subprocess.run([str(built("lwepp-ask")), "-addr", address, "-n", str(requests), "-timeout", "2s"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    return done.stdout.split() if done.returncode == 0 else None


def gateway_of(namespace: str) -> list[dict[str, Any]]:
    """A GatewayClass and a Gateway as a platform team would have them (no controller programs them here)."""
    return [
        {"apiVersion": f"{GW_GROUP}/{GW_VERSION}", "kind": "GatewayClass", "metadata": {"name": f"e2e-{namespace}"},
         "spec": {"controllerName": "example.com/e2e-no-controller"}},
        {"apiVersion": f"{GW_GROUP}/{GW_VERSION}", "kind": "Gateway", "metadata": {"name": "inference", "namespace": namespace},
         "spec": {"gatewayClassName": f"e2e-{namespace}",
                  "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}]}},
    ]  # fmt: skip


def test_pool_and_route_are_stored_by_the_real_api_server(operator, cluster, api_client, namespace) -> None:
    custom = client.CustomObjectsApi(api_client)
    gateway_class, gateway = gateway_of(namespace)
    custom.create_cluster_custom_object(GW_GROUP, GW_VERSION, "gatewayclasses", gateway_class)
    try:
        custom.create_namespaced_custom_object(GW_GROUP, GW_VERSION, namespace, "gateways", gateway)
        name = "routed"
        spec = {"gateway": {"parentRefs": [{"name": "inference", "sectionName": "http"}],
                            "hostnames": ["routed.example.com"], "endpointPicker": "Lwepp"},
                "router": {"replicas": 2}}  # fmt: skip
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name, spec))
        wait_ready(custom, namespace, name)

        pool = custom.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL,
                                                   contract.inference_pool_name(name))  # fmt: skip
        assert pool["spec"]["targetPorts"] == [{"number": contract.ROUTER_PORT}]
        assert pool["spec"]["endpointPickerRef"]["name"] == contract.endpoint_picker_name(name)
        assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
        assert pool["metadata"]["ownerReferences"][0]["kind"] == contract.KIND
        # The pool's selector, as the API server stored it, picks exactly the model's router pods (kwok runs them).
        selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
        core = client.CoreV1Api(api_client)
        routers = wait_for("both router pods Ready", lambda: (r := [p for p in pods_of(api_client, namespace, name, "router")
                                                                    if pod_ready(p)]) and len(r) == 2 and r, 60)  # fmt: skip
        selected = core.list_namespaced_pod(namespace, label_selector=selector).items
        assert {p.metadata.name for p in selected} == {p.metadata.name for p in routers}
        assert all(c.container_port == contract.ROUTER_PORT for p in selected for c in p.spec.containers[0].ports)

        route = custom.get_namespaced_custom_object(GW_GROUP, GW_VERSION, namespace, "httproutes", contract.http_route_name(name))
        assert route["spec"]["parentRefs"][0]["name"] == "inference" and route["spec"]["parentRefs"][0]["sectionName"] == "http"
        assert route["spec"]["hostnames"] == ["routed.example.com"]
        (rule,) = route["spec"]["rules"]
        # Gateway API's defaults applied by the API server (weight 1), the pool as the one backend.
        (backend,) = rule["backendRefs"]
        assert (backend["group"], backend["kind"], backend["name"]) == (POOL_GROUP, "InferencePool", pool["metadata"]["name"])
        assert backend.get("weight", 1) == 1

        apps = client.AppsV1Api(api_client)
        picker = apps.read_namespaced_deployment(contract.endpoint_picker_name(name), namespace)
        assert picker.spec.template.spec.containers[0].args[1] == pool["metadata"]["name"]
        client.CoreV1Api(api_client).read_namespaced_service(contract.endpoint_picker_name(name), namespace)

        # Without spec.gateway the pool, the route and the picker go (stale children), and the model still serves.
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"gateway": None}})

        def gone(read: Any) -> bool:
            try:
                read()
            except client.ApiException as e:
                if e.status == 404:
                    return True
                raise
            return False

        wait_for("the gateway's children deleted", lambda: all(map(gone, (
            lambda: custom.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL, pool["metadata"]["name"]),
            lambda: custom.get_namespaced_custom_object(GW_GROUP, GW_VERSION, namespace, "httproutes", route["metadata"]["name"]),
            lambda: apps.read_namespaced_deployment(contract.endpoint_picker_name(name), namespace),
        ))), 60)  # fmt: skip
        wait_ready(custom, namespace, name)
    finally:
        custom.delete_cluster_custom_object(GW_GROUP, GW_VERSION, "gatewayclasses", gateway_class["metadata"]["name"])


def test_lwepp_answers_a_gateway_with_the_router_pods(operator, api_client, namespace, run_lwepp) -> None:
    """GAIE's lwepp, built from its module and run with the arguments of the operator's <name>-lwepp Deployment,
    asked the way a gateway asks: it picks the model's ready router pods on the router port, round robin."""
    custom = client.CustomObjectsApi(api_client)
    name = "picked"
    spec = {"gateway": {"parentRefs": [{"name": "inference"}], "endpointPicker": "Lwepp"}, "router": {"replicas": 2}}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name, spec))
    wait_ready(custom, namespace, name)
    routers = wait_for("both router pods Ready with IPs", lambda: (r := [p for p in pods_of(api_client, namespace, name, "router")
                                                                         if pod_ready(p) and p.status.pod_ip])
                       and len(r) == 2 and r, 60)  # fmt: skip
    want = {f"{p.status.pod_ip}:{contract.ROUTER_PORT}" for p in routers}
    picker = client.AppsV1Api(api_client).read_namespaced_deployment(contract.endpoint_picker_name(name), namespace)
    address = run_lwepp(picker.spec.template.spec.containers[0].args)
    picked = wait_for("lwepp to pick endpoints", lambda: ask(address, 4), 90)
    assert set(picked) == want, (picked, want)  # both router pods, nothing else (no engine, no lwepp pod)
    # A router pod that goes leaves the picker's choice, and its replacement joins once Ready: lwepp follows the
    # pool's pods (compared with the ready router pods other than the deleted one, read afresh each time).
    gone = routers[0].metadata.name
    client.CoreV1Api(api_client).delete_namespaced_pod(gone, namespace, grace_period_seconds=0)

    def follows() -> bool:
        ready = {f"{p.status.pod_ip}:{contract.ROUTER_PORT}" for p in pods_of(api_client, namespace, name, "router")
                 if pod_ready(p) and p.status.pod_ip and p.metadata.name != gone}  # fmt: skip
        return len(ready) == 2 and set(ask(address, 4) or ()) == ready

    wait_for("lwepp to pick the replacement router pod, not the deleted one", follows, 90)


@pytest.mark.parametrize(("gateway", "phrase"), [
    ({"parentRefs": [{"name": "gw"}, {"name": "gw"}]}, "names one Gateway listener twice"),
    ({"parentRefs": [{"name": "gw"}, {"name": "gw", "sectionName": "a"}]}, "sectionName on each"),
    ({"parentRefs": [{"name": "gw"}], "endpointPickerImage": "x/lwepp:1"}, "set endpointPicker to Lwepp"),
    ({"parentRefs": []}, "spec.gateway.parentRefs"),
    ({"parentRefs": [{"name": "gw"}], "hostnames": ["Routed.Example.com"]}, "spec.gateway.hostnames[0]"),
])  # fmt: skip
def test_a_malformed_gateway_is_refused_at_admission(crd_installed, api_client, namespace, gateway, phrase) -> None:
    custom = client.CustomObjectsApi(api_client)
    with pytest.raises(client.ApiException) as refused:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("bad", {"gateway": gateway}))
    assert refused.value.status == 422 and phrase in refused.value.body, refused.value.body
