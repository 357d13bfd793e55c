"""One real node in the local control plane (issue 33: a kubelet + containerd beside the kwok nodes,
`DISAGG_REAL_NODE=1 hack/cluster.sh up`): it registers Ready, labelled and tainted so that only pods meant for it
land there; the router image built from its Dockerfile runs there as the chart runs it (non-root, read-only root,
its ServiceAccount token, pod discovery through the API server), `kubectl logs` and `exec` reach it through the
kubelet, a preStop hook runs before SIGTERM; `helm install` of the chart for HA runs two operator replicas there
on the pod network (the chart's securityContext and probes, in-cluster config through the node's kube-proxy),
which peer and reconcile a model whose engines land on kwok nodes, the standby taking over when the working
replica's pod is deleted; an engine pod placed there runs the preflight init container the operator rendered,
under the kubelet, and its termination message becomes the model's condition; an engine pair in the engine
image's stand-in (hack/node/engine-sim) passes that preflight with the GPUs the node's device plugin allocated,
the model's router Deployment on the node serves through it, and its decode, deleted mid-stream, drains through
the kubelet's own preStop with no stream cut or migrated; and `hack/cluster.sh down` leaves the host as it found
it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.request import urlopen

from prometheus_client.parser import text_string_to_metric_families

from disagg_connector import contract
from disagg_connector.contract.preflight import PreflightReason, parse_termination_message

from tests.fixtures.e2e.streams import LongStreams
from tests.fixtures.e2e.waiting import condition, wait_for
from tests.fixtures.helm import CHART, helm, values_args
from tests.fixtures.models import REPO, load_example
from tests.fixtures.real_node import NAMESPACE, NODE_LABEL, NODE_NAME, ON_THE_NODE, RealNodeCluster, host_state

OPERATOR_NAMESPACE, MODELS_NAMESPACE = "disagg-system", "real-node-models"
ROUTER_IMAGE = "ghcr.io/disagg-dev/disagg-router:0.1.0"  # hack/images.sh's name, the chart's default
ENGINE_SIM_IMAGE = "ghcr.io/disagg-dev/disagg-engine-sim:0.1.0"  # hack/images.sh engine-sim


def test_a_real_node_runs_the_router_operator_and_engine_images_as_the_chart_and_operator_do_and_down_leaves_the_host_as_it_was(
    image_tars: dict[str, Path], tmp_path: Path
) -> None:
    """One test, in order: the host before, up, what runs on the node, down, the host after."""
    before = host_state()
    cluster = RealNodeCluster.start()
    try:
        cluster.import_image(image_tars["router"])
        cluster.import_image(image_tars["operator"])
        _the_node_is_ready_labelled_and_tainted_and_kwok_pods_stay_off_it(cluster)
        _the_router_image_runs_on_the_node_as_the_chart_runs_it(cluster, tmp_path / "hook")
        _helm_install_runs_the_operator_image_on_the_node_and_it_reconciles(cluster, tmp_path)
        _an_engine_pods_preflight_runs_under_the_kubelet_and_its_reason_reaches_the_model(cluster)
        cluster.import_image(image_tars["engine-sim"])
        _an_engine_pair_serves_from_the_node_and_a_decode_drains_through_the_kubelets_prestop(cluster)
        helm("uninstall", "disagg", "--namespace", OPERATOR_NAMESPACE, "--wait", kubeconfig=cluster.kubeconfig)
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
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"  # from the device plugin, through the kubelet
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


def _helm_install_runs_the_operator_image_on_the_node_and_it_reconciles(cluster: RealNodeCluster, tmp_path: Path) -> None:
    """The chart as a user installs it for HA, with the image built here (the chart's default name, never pulled)
    and the real node's selector and toleration: two replicas on the pod network, the API server at the
    `kubernetes` Service's ClusterIP through the node's kube-proxy, as in a cluster. They peer (the chart's
    ClusterKopfPeering): one works, the other stands by, and takes over when the working one's pod is deleted."""
    values = {"image": {"pullPolicy": "Never"}, "replicaCount": 2, **ON_THE_NODE}
    helm("install", "disagg", str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace", "--wait",
         "--timeout", "180s", *values_args(values, tmp_path), kubeconfig=cluster.kubeconfig)  # fmt: skip
    replicas = wait_for("both replicas Ready and peering", lambda: len(_peers(cluster)) == 2 and _operator_pods(cluster),
                        timeout=120)  # fmt: skip
    assert len(replicas) == 2 and {p["spec"]["nodeName"] for p in replicas} == {NODE_NAME}
    # the chart's securityContext, enforced by the runtime: uid 65532, a root filesystem it cannot write
    in_pod = ("-n", OPERATOR_NAMESPACE, "exec", replicas[0]["metadata"]["name"], "--")
    assert cluster.kubectl(*in_pod, "id", "-u").strip() == "65532"
    denied = cluster.kubectl(*in_pod, "touch", "/written", check=False, stderr=True)
    assert "Read-only file system" in denied, denied

    cluster.kubectl("create", "namespace", MODELS_NAMESPACE)
    model = load_example(REPO / "examples" / "minimal.yaml")
    name = model["metadata"]["name"]
    cluster.kubectl("-n", MODELS_NAMESPACE, "apply", "-f", "-", stdin=json.dumps(model))
    _wait_model_ready(cluster, name, decode_pods=1)

    # the working replica is the live peer of the highest priority (kopf's rule); the other is paused for it:
    # it started paused (peering is mandatory: no "Resuming"), or it paused when the other came ("Pausing" last)
    peers = _peers(cluster)
    working = max(peers, key=lambda pod: int(peers[pod].get("priority") or 0))
    (standby,) = set(peers) - {working}
    logs = ("-n", OPERATOR_NAMESPACE, "logs", standby)

    def paused() -> bool:
        said = cluster.kubectl(*logs)
        return said.rfind("Pausing operations in favour of") >= said.rfind("Resuming operations")

    wait_for("the standby replica paused", paused)
    # the working one's pod deleted: the standby resumes (before the Deployment's next pod has started), and
    # the operator goes on reconciling
    resumed = cluster.kubectl(*logs).count("Resuming operations")
    cluster.kubectl("-n", OPERATOR_NAMESPACE, "delete", "pod", working, "--wait=true")
    # (a graceful exit takes its peer out at once; otherwise its entry lapses after kopf's 60 s lifetime)
    wait_for("the standby replica resumed", lambda: cluster.kubectl(*logs).count("Resuming operations") > resumed,
             timeout=120)  # fmt: skip
    cluster.kubectl("-n", MODELS_NAMESPACE, "patch", contract.KIND.lower(), name, "--type=merge",
                    "-p", json.dumps({"spec": {"decode": {"replicas": 2}}}))  # fmt: skip
    _wait_model_ready(cluster, name, decode_pods=2)
    for pod in _pods(cluster, MODELS_NAMESPACE, f"{contract.LABEL_MODEL}={contract.model_label_value(name)}"):
        assert pod["spec"]["nodeName"] != NODE_NAME  # the engines and the router stay on kwok nodes

    _delete_model(cluster, name)


def _an_engine_pods_preflight_runs_under_the_kubelet_and_its_reason_reaches_the_model(cluster: RealNodeCluster) -> None:
    """A model whose engines are placed on the real node, their image the router's (it has the connector's
    disagg-preflight, and no NIXL). The node's device plugin (hack/node/kubelet-tools/fakegpu) advertises
    nvidia.com/gpu as NVIDIA's would. The preflight init container the operator rendered runs in the image under the
    kubelet, fails, and its termination message (/dev/termination-log, read back by the kubelet) becomes the
    model's FabricReady, Ready and Degraded reason through the operator in its own pod."""
    on_the_node = {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}, **ON_THE_NODE}
    name = "preflight"
    model = {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
        "metadata": {"name": name, "namespace": MODELS_NAMESPACE},
        "spec": {"model": {"name": "Qwen/Qwen3-0.6B"}, "prefill": on_the_node, "decode": on_the_node,
                 "engine": {"image": ROUTER_IMAGE, "imagePullPolicy": "Never"}},
    }  # fmt: skip
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(model))

    def failed() -> dict | None:
        got = json.loads(cluster.kubectl("-n", MODELS_NAMESPACE, "get", contract.KIND.lower(), name, "-o", "json"))
        return got if condition(got, "FabricReady").get("reason") == PreflightReason.NIXL_IMPORT_FAILED else None

    got = wait_for("the preflight's reason in the model's FabricReady", failed, timeout=180)
    for type_ in ("FabricReady", "Ready", "Degraded"):
        c = condition(got, type_)
        assert c["status"] == ("True" if type_ == "Degraded" else "False"), c
        assert c["reason"] == PreflightReason.NIXL_IMPORT_FAILED and "cannot import nixl" in c["message"], c
    selector = f"{contract.LABEL_MODEL}={contract.model_label_value(name)},{contract.LABEL_ROLE} in (prefill,decode)"

    def preflight_ended(pod: dict) -> dict | None:
        """The preflight's last end: its state, or while the kubelet backs off its restart, its last state."""
        (preflight,) = pod["status"].get("initContainerStatuses") or [{}]
        return (preflight.get("state") or {}).get("terminated") or (preflight.get("lastState") or {}).get("terminated")

    def every_preflight_ended() -> list[dict] | None:
        engines = _pods(cluster, MODELS_NAMESPACE, selector)
        return engines if len(engines) == 2 and all(preflight_ended(p) for p in engines) else None

    engines = wait_for("both engine pods' preflight ended", every_preflight_ended, timeout=120)
    assert {p["spec"]["nodeName"] for p in engines} == {NODE_NAME}
    for pod in engines:
        ended = preflight_ended(pod)
        assert ended is not None and ended["exitCode"] == 1
        assert parse_termination_message(ended["message"])[0] == PreflightReason.NIXL_IMPORT_FAILED, ended
        assert not pod["status"].get("containerStatuses", [{}])[0].get("ready"), pod["status"]  # vLLM never started
    _delete_model(cluster, name)


def _an_engine_pair_serves_from_the_node_and_a_decode_drains_through_the_kubelets_prestop(cluster: RealNodeCluster) -> None:
    """A model whose engines run on the node in the engine image's stand-in (hack/node/engine-sim: real NIXL and
    the connector, the simulator as `vllm`, timed as an H200), as the operator renders them: the preflight passes
    under the kubelet with the GPUs the node's device plugin allocated, the kubelet's own probes make the engines
    Ready, and the model's router Deployment, placed on the node too, runs the router image: it finds the pair
    through the API server (in-cluster, through the node's kube-proxy) and serves through them on their pod IPs.
    Then the decode pod is deleted while streams run on it: the kubelet runs its rendered preStop
    (`disagg-drain`, polling the engine on 127.0.0.1 in the pod) to the streams' end before SIGTERM, so every
    stream ends whole on that decode, none migrated."""
    name, served = "drain", "Qwen/Qwen3-0.6B"
    on_the_node = {"resources": {"requests": {"cpu": "200m", "memory": "256Mi"}}, **ON_THE_NODE}
    model = {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
        "metadata": {"name": name, "namespace": MODELS_NAMESPACE},
        "spec": {"model": {"name": served}, "prefill": on_the_node, "decode": on_the_node,
                 "engine": {"image": ENGINE_SIM_IMAGE, "imagePullPolicy": "Never",
                            "env": [{"name": "DISAGG_SIM_PROFILE", "value": "h200-1gpu-push"}]},
                 # the stand-in's /dev/shm is the node's; the preflight holds it to what is asked
                 "network": {"efa": {"sharedMemory": "1Gi"}},
                 "router": {"image": ROUTER_IMAGE, "replicas": 1, **ON_THE_NODE,
                            "disaggregationThresholdTokens": 0}},  # every prompt through the pair
    }  # fmt: skip
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(model))
    selector = f"{contract.LABEL_MODEL}={contract.model_label_value(name)}"

    def fabric_ready_and_engines_ready() -> list[dict] | None:
        got = json.loads(cluster.kubectl("-n", MODELS_NAMESPACE, "get", contract.KIND.lower(), name, "-o", "json"))
        engines = _pods(cluster, MODELS_NAMESPACE, f"{selector},{contract.LABEL_ROLE} in (prefill,decode)")
        ready = [p for p in engines if _ready(p)]
        return ready if condition(got, "FabricReady").get("status") == "True" and len(ready) == 2 else None

    engines = wait_for("the pair's preflight passed and the kubelet's probes Ready", fabric_ready_and_engines_ready,
                       timeout=180)  # fmt: skip
    # Ready by the probe the operator renders (/health answers: serving, not draining); its pod watch below
    routers = wait_for("the router pod Ready", lambda: [p for p in _pods(cluster, MODELS_NAMESPACE,
                       f"{selector},{contract.LABEL_ROLE}=router") if _ready(p)], timeout=180)  # fmt: skip
    for pod in engines:
        assert pod["spec"]["nodeName"] == NODE_NAME
        in_pod = ("-n", MODELS_NAMESPACE, "logs", pod["metadata"]["name"], "-c", "preflight")
        assert "preflight ok" in (ok := cluster.kubectl(*in_pod)) and "backend=UCX" in ok and "nvidia=1/1" in ok, ok
        # the one GPU the device plugin allocated, as /dev/nvidia<i> in the engine's container
        devices = cluster.kubectl("-n", MODELS_NAMESPACE, "exec", pod["metadata"]["name"], "-c", "vllm", "--",
                                  "python", "-c", "import glob; print(' '.join(glob.glob('/dev/nvidia*')))").split()  # fmt: skip
        assert len(devices) == 1, devices
    (decode,) = [p for p in engines if p["metadata"]["labels"][contract.LABEL_ROLE] == "decode"]
    (router,) = routers
    assert router["spec"]["nodeName"] == NODE_NAME
    router_url = f"http://{router['status']['podIP']}:{contract.ROUTER_PORT}"  # the host reaches it on the bridge

    def pair_usable() -> bool:  # its pod watch, through the API server's ClusterIP, found both engines
        health = json.loads(urlopen(router_url + "/health", timeout=10).read())
        return health["synced"] and (1, 1) in {(r["prefill"], r["decode"]) for r in health["revisions"].values()}

    wait_for("the router pod to see the pair on the node", pair_usable, timeout=60, retry_on=(OSError,))

    streams = LongStreams(router_url, served, first=0)
    wait_for("every stream's first token", streams.all_started, timeout=60)
    deleted_at = time.monotonic()
    cluster.kubectl("-n", MODELS_NAMESPACE, "delete", "pod", decode["metadata"]["name"], "--wait=false")
    ended = streams.wait()
    uid = decode["metadata"]["uid"]
    wait_for("the drained decode pod gone",
             lambda: all(p["metadata"]["uid"] != uid for p in _pods(cluster, MODELS_NAMESPACE, selector)), timeout=120)  # fmt: skip
    cut = [s for s in ended if not s.whole]
    assert not cut, f"streams cut or incomplete: {cut}"
    # they went on well after the deletion, on the decode that was told to go: nothing was migrated
    assert min(s.last_token_at for s in ended) > deleted_at + 2, [s.last_token_at - deleted_at for s in ended]  # type: ignore[operator]
    logs = ("-n", MODELS_NAMESPACE, "logs", router["metadata"]["name"])
    assert _migrations(router_url) == 0, cluster.kubectl(*logs)[-3000:]
    _delete_model(cluster, name)


def _ready(pod: dict) -> bool:
    return "deletionTimestamp" not in pod["metadata"] and {
        c["type"]: c["status"] for c in pod["status"].get("conditions", [])
    }.get("Ready") == "True"


def _migrations(router_url: str) -> float:
    """Every stream the router continued on another decode, whatever became of it."""
    text = urlopen(router_url + "/metrics", timeout=10).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) if family.name == "disagg_router_migrations"
               for sample in family.samples if sample.name == "disagg_router_migrations_total")  # fmt: skip


def _pods(cluster: RealNodeCluster, namespace: str, selector: str) -> list[dict]:
    return json.loads(cluster.kubectl("-n", namespace, "get", "pods", "-l", selector, "-o", "json"))["items"]


def _operator_pods(cluster: RealNodeCluster) -> list[dict]:
    """The operator's Ready pods."""
    return [p for p in _pods(cluster, OPERATOR_NAMESPACE, "app.kubernetes.io/name=disagg-operator") if _ready(p)]


def _peers(cluster: RealNodeCluster) -> dict[str, dict]:
    """The chart's ClusterKopfPeering's peers of the operator's Ready pods (kopf's peer id: the pod's name)."""
    (peering,) = json.loads(cluster.kubectl("get", "clusterkopfpeerings", "-o", "json"))["items"]
    ready = {p["metadata"]["name"] for p in _operator_pods(cluster)}
    return {peer: info for peer, info in (peering.get("status") or {}).items() if peer in ready}


def _delete_model(cluster: RealNodeCluster, name: str) -> None:
    """The model gone, and its pods: the garbage collector removes them after it (a ReplicaSet may still make one)."""
    cluster.kubectl("-n", MODELS_NAMESPACE, "delete", contract.KIND.lower(), name, "--wait=true", "--timeout=120s")
    selector = f"{contract.LABEL_MODEL}={contract.model_label_value(name)}"
    wait_for(f"model {name}'s pods gone", lambda: not _pods(cluster, MODELS_NAMESPACE, selector), timeout=120)


def _wait_model_ready(cluster: RealNodeCluster, name: str, decode_pods: int) -> None:
    def ready() -> bool:
        model = json.loads(cluster.kubectl("-n", MODELS_NAMESPACE, "get", contract.KIND.lower(), name, "-o", "json"))
        decode = _pods(cluster, MODELS_NAMESPACE, f"{contract.LABEL_MODEL}={contract.model_label_value(name)},"
                                                  f"{contract.LABEL_ROLE}=decode")  # fmt: skip
        return condition(model, "Ready").get("status") == "True" and len(decode) == decode_pods

    wait_for(f"model {name} Ready with {decode_pods} decode pods, reconciled by the operator pod", ready, timeout=180)
