"""One real node in the local control plane (issue 33: a kubelet + containerd beside the kwok nodes,
`DISAGG_REAL_NODE=1 hack/cluster.sh up`): it registers Ready, labelled and tainted so that only pods meant for it
land there; the router image built from its Dockerfile runs there as the chart runs it (non-root, read-only root,
its ServiceAccount token, pod discovery through the API server), `kubectl logs` and `exec` reach it through the
kubelet, a preStop hook runs before SIGTERM; and `hack/cluster.sh down` leaves the host as it found it.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.request import urlopen

from tests.fixtures.e2e.waiting import wait_for
from tests.fixtures.real_node import NAMESPACE, NODE_LABEL, NODE_NAME, RealNodeCluster, host_state


def test_a_real_node_runs_the_router_image_as_the_chart_does_and_down_leaves_the_host_as_it_was(
    image_tars: dict[str, Path], tmp_path: Path
) -> None:
    """One test, in order: the host before, up, what runs on the node, down, the host after."""
    before = host_state()
    cluster = RealNodeCluster.start()
    try:
        cluster.import_image(image_tars["router"])
        _the_node_is_ready_labelled_and_tainted_and_kwok_pods_stay_off_it(cluster)
        _the_router_image_runs_on_the_node_as_the_chart_runs_it(cluster, tmp_path / "hook")
        during = host_state()
    finally:
        cluster.stop()
    assert during.links - before.links, "the node made no bridge or veth: the comparison below would prove nothing"
    assert host_state() == before


def _the_node_is_ready_labelled_and_tainted_and_kwok_pods_stay_off_it(cluster: RealNodeCluster) -> None:
    node = json.loads(cluster.kubectl("get", "node", NODE_NAME, "-o", "json"))
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    assert node["metadata"]["labels"][NODE_LABEL] == "true"
    assert {"key": NODE_LABEL, "value": "true", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    # a workload that does not tolerate the taint lands on kwok nodes only
    cluster.kubectl("create", "deployment", "plain", "--image=registry.invalid/plain:1", "--replicas=4")
    cluster.kubectl("wait", "--for=condition=Available", "deployment/plain", "--timeout=120s")
    pods = json.loads(cluster.kubectl("get", "pods", "-l", "app=plain", "-o", "json"))["items"]
    assert len(pods) == 4 and NODE_NAME not in {p["spec"]["nodeName"] for p in pods}
    cluster.kubectl("delete", "deployment", "plain", "--wait=true")


def _the_router_image_runs_on_the_node_as_the_chart_runs_it(cluster: RealNodeCluster, hook_dir: Path) -> None:
    hook_dir.mkdir()
    cluster.apply_test_pods(hook_dir)
    cluster.kubectl("-n", NAMESPACE, "wait", "--for=condition=Ready", "pod/router", "pod/hook", "pod/podnet",
                    "--timeout=180s")  # fmt: skip
    cluster.kubectl("-n", NAMESPACE, "wait", "--for=jsonpath={.status.phase}=Succeeded", "pod/router-help",
                    "--timeout=120s")  # fmt: skip
    assert cluster.kubectl("-n", NAMESPACE, "logs", "router-help").startswith("usage: disagg-router")
    placed = json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pods", "-o", "json"))["items"]
    assert {p["spec"]["nodeName"] for p in placed} == {NODE_NAME}
    # the router, non-root on a read-only root: its ServiceAccount's token and in-cluster config reach the API
    # server (synced: its pod watch listed), its readinessProbe passed (Ready above), `kubectl exec` goes
    # through the kubelet
    def health() -> dict:
        return json.loads(urlopen(f"http://127.0.0.1:{cluster.router_port}/health", timeout=10).read())

    assert health()["status"] == "ok"
    wait_for("the router's pod watch to list through the API server", lambda: health()["synced"], timeout=60)
    assert cluster.kubectl("-n", NAMESPACE, "exec", "router", "--", "id", "-u").strip() == "65532"
    # a pod on the pod network got an address of the node's bridge
    assert json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pod", "podnet", "-o", "json"))["status"]["podIP"]
    # the kubelet's termination order: the preStop hook to its end, then SIGTERM
    cluster.kubectl("-n", NAMESPACE, "delete", "pod", "hook", "--wait=true", "--timeout=60s")
    start, end, sigterm = (float((hook_dir / name).read_text()) for name in ("prestop-start", "prestop-end", "sigterm"))
    assert start + 3 <= end <= sigterm
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=120s")
