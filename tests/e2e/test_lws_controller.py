"""The real LeaderWorkerSet controller (sigs.k8s.io/lws v0.9.0, started by hack/cluster.sh up) runs here.

A LeaderWorkerSet of one group of two pods on a kwok CPU node: LWS's controller makes the leader
StatefulSet, its pod webhook gives the pods their labels and LWS_* environment, its pod controller makes
the workers' StatefulSet, and the LWS reports the group ready once kwok marks both pods Ready. Its
admission webhooks (served on 127.0.0.1, see hack/lws/webhooks.yaml) default and validate, and its
RecreateGroupOnPodRestart policy replaces the whole group when a worker goes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from disagg_connector import contract

from tests.fixtures.e2e.waiting import pod_ready, wait_for

pytestmark = pytest.mark.e2e

GROUP, VERSION, PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
# holds the worker pod terminating, the way a kubelet does for its grace period (kwok deletes a
# terminating pod at once, which could race LWS's pod controller seeing it terminate)
HOLD = "e2e.disagg.dev/hold"


@pytest.fixture(autouse=True, scope="module")
def lws_installed(cluster) -> None:
    """hack/cluster.sh up installs LWS; a cluster from KUBECONFIG may not have it."""
    try:
        client.ApiextensionsV1Api(cluster.api_client()).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    except client.ApiException as e:
        if e.status != 404:
            raise
        if cluster.local:
            pytest.fail("hack/cluster.sh up did not install the LeaderWorkerSet CRD", pytrace=False)
        pytest.skip("no LeaderWorkerSet CRD in the cluster from KUBECONFIG")


def lws_manifest(name: str, *, replicas: int = 1, size: int = 2) -> dict[str, Any]:
    """One group of `size` pods (the leader uses the worker template) on a kwok CPU node."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        # hack/nodes/cpu.yaml: untainted m7i.8xlarge kwok nodes
                        "nodeSelector": {"type": "kwok", "node.kubernetes.io/instance-type": "m7i.8xlarge"},
                        "containers": [{"name": "engine", "image": "registry.example/engine:dev"}],
                    },
                },
            },
        },
    }


def env_of(pod: client.V1Pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env or []}


def controller_of(obj: Any) -> client.V1OwnerReference:
    refs = [r for r in obj.metadata.owner_references or [] if r.controller]
    assert len(refs) == 1, obj.metadata.owner_references
    return refs[0]


def read_pod(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    try:
        return core.read_namespaced_pod(name, namespace)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def ready_group(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, client.V1Pod] | None:
    """{"leader": pod, "worker": pod} once both are there and Ready, else None."""
    pods = {
        p.metadata.name: p
        for p in core.list_namespaced_pod(namespace, label_selector=f"{NAME_LABEL}={name}").items
    }
    leader, worker = pods.get(f"{name}-0"), pods.get(f"{name}-0-1")
    if len(pods) == 2 and leader and worker and pod_ready(leader) and pod_ready(worker):
        return {"leader": leader, "worker": worker}
    return None


def ready_replicas(custom: client.CustomObjectsApi, namespace: str, name: str) -> int:
    lws = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    return (lws.get("status") or {}).get("readyReplicas") or 0


def test_lws_controller_makes_a_ready_group_with_lws_env_and_labels(api_client, namespace) -> None:
    core, apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)
    custom = client.CustomObjectsApi(api_client)
    name = "lws-e2e"
    created = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, lws_manifest(name))
    # LWS's defaulting webhook answered the create (the CRD has no default for subdomainPolicy)
    assert created["spec"]["networkConfig"]["subdomainPolicy"] == "Shared"
    assert created["spec"]["rolloutStrategy"]["type"] == "RollingUpdate"

    group = wait_for("leader and worker pods Ready", lambda: ready_group(core, namespace, name), timeout=90)
    leader, worker = group["leader"], group["worker"]

    # the controller's objects: LWS -> leader StatefulSet -> leader pod -> worker StatefulSet -> worker pod
    leader_sts_ref = controller_of(leader)
    assert (leader_sts_ref.kind, leader_sts_ref.name) == ("StatefulSet", name)
    leader_sts = apps.read_namespaced_stateful_set(name, namespace)
    assert (controller_of(leader_sts).kind, controller_of(leader_sts).name) == ("LeaderWorkerSet", name)
    worker_sts_ref = controller_of(worker)
    assert (worker_sts_ref.kind, worker_sts_ref.name) == ("StatefulSet", f"{name}-0")
    worker_sts = apps.read_namespaced_stateful_set(f"{name}-0", namespace)
    assert (controller_of(worker_sts).kind, controller_of(worker_sts).name) == ("Pod", f"{name}-0")
    assert controller_of(worker_sts).uid == leader.metadata.uid
    # the headless Service the leader address names
    assert core.read_namespaced_service(name, namespace).spec.cluster_ip == "None"

    # LWS's labels and annotations (the pod webhook adds group-key and the workers' worker-index)
    for pod, index in ((leader, "0"), (worker, "1")):
        labels = pod.metadata.labels
        assert labels[NAME_LABEL] == name
        assert labels[GROUP_INDEX_LABEL] == "0"
        assert labels[WORKER_INDEX_LABEL] == index
        assert labels["app"] == name
        assert pod.metadata.annotations[SIZE_ANNOTATION] == "2"
    assert leader.metadata.labels[GROUP_KEY_LABEL]
    assert worker.metadata.labels[GROUP_KEY_LABEL] == leader.metadata.labels[GROUP_KEY_LABEL]

    # LWS's environment, injected by its pod webhook into every container
    leader_address = f"{name}-0.{name}.{namespace}"
    assert env_of(leader) == {"LWS_LEADER_ADDRESS": leader_address, "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}
    assert env_of(worker) == {"LWS_LEADER_ADDRESS": leader_address, "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    # each pod's DNS name (its hostname under its subdomain: the StatefulSet's), as an engine pod's preStop
    # derives it from the leader's to wait for the whole group (disagg-drain)
    for pod, index in ((leader, 0), (worker, 1)):
        assert contract.lws_pod_address(leader_address, index) == f"{pod.spec.hostname}.{pod.spec.subdomain}.{namespace}"

    # placed on a kwok CPU node, Running with a loopback pod IP
    for pod in (leader, worker):
        node = core.read_node(pod.spec.node_name)
        assert node.metadata.labels["node.kubernetes.io/instance-type"] == "m7i.8xlarge"
        assert pod.status.phase == "Running" and pod.status.pod_ip.startswith("127.")

    wait_for("LWS status.readyReplicas == 1", lambda: ready_replicas(custom, namespace, name) == 1, timeout=60)
    lws = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    assert lws["status"]["replicas"] == 1
    available = [c for c in lws["status"].get("conditions", []) if c["type"] == "Available"]
    assert available and available[0]["status"] == "True", lws["status"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"leaderWorkerTemplate": {"size": 0}},
            "spec.leaderWorkerTemplate.size: Invalid value: 0: size must be equal or greater than 1",
        ),
        (
            {"rolloutStrategy": {"type": "RollingUpdate",
                                 "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 0}}},
            "spec.rolloutStrategy.rollingUpdateConfiguration.maxUnavailable: Invalid value: 0: "
            "must not be 0 when `maxSurge` is 0",
        ),
    ],
    ids=["size-0", "no-unavailable-no-surge"],
)
def test_lws_validating_webhook_refuses_an_invalid_spec(api_client, namespace, spec, message) -> None:
    """Specs the CRD's schema lets through (it has no minimum for size, and cannot relate two fields) but
    LWS's validating webhook refuses. (A negative replicas never reaches it: the API server's scale
    subresource check refuses it first.)"""
    custom = client.CustomObjectsApi(api_client)
    manifest = lws_manifest("invalid")
    for key, value in spec.items():
        if isinstance(value, dict) and key in manifest["spec"]:
            manifest["spec"][key].update(value)
        else:
            manifest["spec"][key] = value
    with pytest.raises(client.ApiException) as refused:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    body = json.loads(refused.value.body)
    assert refused.value.status == 403, body  # controller-runtime's admission.Denied
    assert body["message"].startswith('admission webhook "vleaderworkerset.kb.io" denied the request: '), body
    assert message in body["message"], body
    assert custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"] == []


def test_deleting_the_worker_pod_recreates_the_group(api_client, namespace) -> None:
    core = client.CoreV1Api(api_client)
    custom = client.CustomObjectsApi(api_client)
    name = "lws-restart"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, lws_manifest(name))
    group = wait_for("leader and worker pods Ready", lambda: ready_group(core, namespace, name), timeout=90)
    wait_for("LWS status.readyReplicas == 1", lambda: ready_replicas(custom, namespace, name) == 1, timeout=60)
    old_leader, old_worker = group["leader"], group["worker"]

    # the worker stays terminating (as under a kubelet's grace period) until the finalizer goes
    core.patch_namespaced_pod(old_worker.metadata.name, namespace, {"metadata": {"finalizers": [HOLD]}})
    try:
        core.delete_namespaced_pod(old_worker.metadata.name, namespace)

        def leader_deleted() -> bool:
            pod = read_pod(core, namespace, old_leader.metadata.name)
            return pod is None or pod.metadata.uid != old_leader.metadata.uid or pod.metadata.deletion_timestamp is not None

        # RecreateGroupOnPodRestart: LWS's pod controller deletes the leader, and so the whole group
        wait_for("LWS to delete the leader pod of the worker's group", leader_deleted, timeout=60)

        def recreate_group_event() -> list[dict[str, Any]]:
            raw = client.EventsV1Api(api_client).list_namespaced_event(namespace, _preload_content=False)
            return [
                e for e in json.loads(raw.data)["items"]
                if e.get("reason") == "RecreateGroup" and (e.get("regarding") or {}).get("name") == name
                and old_worker.metadata.name in (e.get("note") or "")
            ]

        wait_for("a RecreateGroup Event on the LWS", recreate_group_event, timeout=30)
    finally:  # never leave a pod the namespace's deletion would wait for
        if read_pod(core, namespace, old_worker.metadata.name):
            core.patch_namespaced_pod(old_worker.metadata.name, namespace, {"metadata": {"finalizers": None}})

    def replaced_group() -> dict[str, client.V1Pod] | None:
        g = ready_group(core, namespace, name)
        if not g or g["leader"].metadata.uid == old_leader.metadata.uid:
            return None
        return g if g["worker"].metadata.uid != old_worker.metadata.uid else None

    new = wait_for("a new leader and a new worker, both Ready", replaced_group, timeout=90)
    assert env_of(new["worker"])["LWS_WORKER_INDEX"] == "1"
    assert controller_of(new["worker"]).kind == "StatefulSet"
    wait_for("LWS status.readyReplicas == 1 again", lambda: ready_replicas(custom, namespace, name) == 1, timeout=60)
