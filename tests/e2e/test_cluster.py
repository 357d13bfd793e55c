"""The control plane itself behaves like a real cluster.

These checks prove the parts the operator relies on are real and running:
the scheduler (extended resources, taints), kwok (pods Running/Ready with
loopback pod IPs), the controller-manager (Deployments, garbage collection,
ServiceAccounts), the apiserver's service-account signing, RBAC and audit log.
"""

from __future__ import annotations

import ipaddress
import socket
import time
import uuid

import pytest
from kubernetes import client

pytestmark = pytest.mark.e2e

GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
NEURON = "aws.amazon.com/neuron"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
ZONE = "topology.kubernetes.io/zone"
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def wait_for(what: str, fn, timeout: float = 60.0, interval: float = 0.5):
    """Poll fn() until it returns something truthy; fail with `what` after timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def kwok_nodes(core: client.CoreV1Api, instance_type: str | None = None) -> list[client.V1Node]:
    selector = "type=kwok"
    if instance_type:
        selector += f",{INSTANCE_TYPE}={instance_type}"
    return core.list_node(label_selector=selector).items


def is_ready(obj) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (obj.status.conditions or []))


def gpu_deployment(name: str, requests: dict[str, str], replicas: int = 1) -> client.V1Deployment:
    labels = {"app": name}
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(
                    containers=[
                        client.V1Container(
                            name="engine",
                            image="vllm/vllm-openai:v0.33.0",
                            resources=client.V1ResourceRequirements(requests=requests, limits=requests),
                        )
                    ],
                    tolerations=[
                        client.V1Toleration(key=GPU, operator="Exists", effect="NoSchedule")
                    ],
                ),
            ),
        ),
    )


# --------------------------------------------------------------------------- nodes


def test_nodes_advertise_accelerator_shapes(api_client):
    core = client.CoreV1Api(api_client)

    p5en = kwok_nodes(core, "p5en.48xlarge")
    trn2 = kwok_nodes(core, "trn2.48xlarge")
    assert len(p5en) == 4, [n.metadata.name for n in p5en]
    assert len(trn2) == 2, [n.metadata.name for n in trn2]

    for n in p5en:
        alloc = n.status.allocatable
        assert alloc[GPU] == "8"
        assert alloc[EFA] == "16"
        assert alloc["hugepages-2Mi"] == "21Gi"
        assert alloc["pods"] == "110"
        assert n.status.capacity["cpu"] == "192"
        labels = n.metadata.labels
        assert labels["kubernetes.io/os"] == "linux"
        assert labels["kubernetes.io/arch"] == "amd64"
        for layer in (1, 2, 3):
            assert labels[f"topology.k8s.aws/network-node-layer-{layer}"]
        assert [(t.key, t.value, t.effect) for t in n.spec.taints] == [(GPU, "true", "NoSchedule")]
        assert is_ready(n), n.metadata.name
    assert sorted(n.metadata.labels[ZONE] for n in p5en) == [
        "us-west-2a", "us-west-2a", "us-west-2b", "us-west-2b",
    ]

    for n in trn2:
        alloc = n.status.allocatable
        assert alloc[NEURON] == "16"
        assert alloc[EFA] == "16"
        assert alloc["hugepages-2Mi"] == "21Gi"
        assert n.metadata.labels[ZONE] == "us-west-2a"
        assert [(t.key, t.effect) for t in n.spec.taints] == [(NEURON, "NoSchedule")]
        assert is_ready(n), n.metadata.name

    cpu = [
        n for n in kwok_nodes(core)
        if n.metadata.labels[INSTANCE_TYPE] not in ("p5en.48xlarge", "trn2.48xlarge")
    ]
    assert cpu, "expected at least one plain CPU node"
    for n in cpu:
        assert not n.spec.taints
        assert GPU not in n.status.allocatable and EFA not in n.status.allocatable
        assert is_ready(n), n.metadata.name

    # every fake node hands out pod IPs from its own loopback /24
    cidrs = [ipaddress.ip_network(n.spec.pod_cidr) for n in kwok_nodes(core)]
    assert all(c.subnet_of(LOOPBACK) for c in cidrs), cidrs
    assert len(set(cidrs)) == len(cidrs), "podCIDRs must not overlap"


# --------------------------------------------------------------------------- scheduling + kwok


def test_gpu_deployment_lands_on_p5en_ready_with_bindable_loopback_ip(api_client, namespace):
    apps, core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
    name = "decode"
    apps.create_namespaced_deployment(namespace, gpu_deployment(name, {GPU: "8", EFA: "16"}))

    def available():
        d = apps.read_namespaced_deployment(name, namespace)
        return d if (d.status.available_replicas or 0) == 1 else None

    wait_for("deployment available", available, timeout=90)

    pods = core.list_namespaced_pod(namespace, label_selector=f"app={name}").items
    assert len(pods) == 1
    pod = pods[0]
    assert pod.status.phase == "Running"
    assert is_ready(pod)
    node = core.read_node(pod.spec.node_name)
    assert node.metadata.labels[INSTANCE_TYPE] == "p5en.48xlarge"

    ip = ipaddress.ip_address(pod.status.pod_ip)
    assert ip in LOOPBACK, ip
    assert ip in ipaddress.ip_network(node.spec.pod_cidr), (ip, node.spec.pod_cidr)
    # the point of loopback pod IPs: a simulated engine can listen on the pod's own address
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((str(ip), 0))
        s.listen(1)
        port = s.getsockname()[1]
        with socket.create_connection((str(ip), port), timeout=5):
            pass


def test_more_efa_than_any_node_stays_pending_with_reason(api_client, namespace):
    core = client.CoreV1Api(api_client)
    name = "too-many-efa"
    requests = {GPU: "8", EFA: "17"}
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(
                    name="engine",
                    image="vllm/vllm-openai:v0.33.0",
                    resources=client.V1ResourceRequirements(requests=requests, limits=requests),
                )
            ],
            tolerations=[client.V1Toleration(key=GPU, operator="Exists", effect="NoSchedule")],
        ),
    )
    core.create_namespaced_pod(namespace, pod)

    def unschedulable():
        p = core.read_namespaced_pod(name, namespace)
        for c in p.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                return c
        return None

    cond = wait_for("PodScheduled=False/Unschedulable", unschedulable, timeout=60)
    assert EFA in cond.message, cond.message

    def failed_scheduling_event():
        events = core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={name},reason=FailedScheduling"
        ).items
        return [e for e in events if EFA in (e.message or "")]

    wait_for("FailedScheduling event naming the EFA resource", failed_scheduling_event, timeout=30)

    # The window: the scheduler binds a pod only in a scheduling cycle; one it found unschedulable waits for a
    # cluster event that could make it fit (none comes here). A pod created after that failure and bound shows
    # the scheduler ran its cycles past it, and left it where it was.
    later = client.V1Pod(metadata=client.V1ObjectMeta(name="later"),
                         spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="registry.example/pause:1")]))
    core.create_namespaced_pod(namespace, later)
    wait_for("a pod created after the failure bound", lambda: core.read_namespaced_pod("later", namespace).spec.node_name, timeout=60)
    p = core.read_namespaced_pod(name, namespace)
    assert p.status.phase == "Pending"
    assert not p.spec.node_name


# --------------------------------------------------------------------------- controller-manager


def test_deleting_a_deployment_garbage_collects_replicaset_and_pods(api_client, namespace):
    apps, core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
    name = "router"
    labels = {"app": name}
    dep = client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1DeploymentSpec(
            replicas=2,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(
                    containers=[client.V1Container(name="router", image="router:dev")],
                ),
            ),
        ),
    )
    apps.create_namespaced_deployment(namespace, dep)

    def ready_pods():
        pods = core.list_namespaced_pod(namespace, label_selector=f"app={name}").items
        return pods if len(pods) == 2 and all(is_ready(p) for p in pods) else None

    pods = wait_for("2 ready router pods", ready_pods, timeout=90)
    rs = apps.list_namespaced_replica_set(namespace, label_selector=f"app={name}").items
    assert len(rs) == 1
    assert rs[0].metadata.owner_references[0].kind == "Deployment"
    assert all(p.metadata.owner_references[0].name == rs[0].metadata.name for p in pods)
    # router pods have no GPU request: they must not land on tainted accelerator nodes
    for p in pods:
        node = core.read_node(p.spec.node_name)
        assert not node.spec.taints, p.spec.node_name

    # Background propagation: only the garbage collector removes the dependents.
    apps.delete_namespaced_deployment(name, namespace, propagation_policy="Background")

    def all_gone():
        left_rs = apps.list_namespaced_replica_set(namespace, label_selector=f"app={name}").items
        left_pods = core.list_namespaced_pod(namespace, label_selector=f"app={name}").items
        return not left_rs and not left_pods

    wait_for("ReplicaSet and pods garbage-collected", all_gone, timeout=90)


# --------------------------------------------------------------------------- authn / authz


def test_service_account_token_authenticates_and_rbac_denies_then_allows(cluster, api_client, namespace):
    core, rbac = client.CoreV1Api(api_client), client.RbacAuthorizationV1Api(api_client)
    sa = "reader"
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=sa))
    )
    tr = core.create_namespaced_service_account_token(
        sa, namespace,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
        ),
    )
    token = tr.status.token
    assert token.count(".") == 2  # a signed JWT

    sa_api = cluster.token_api_client(token)
    # authentication: the apiserver verifies the signature and knows who we are
    review = client.AuthenticationV1Api(sa_api).create_self_subject_review(
        client.V1SelfSubjectReview()
    )
    assert review.status.user_info.username == f"system:serviceaccount:{namespace}:{sa}"

    # authorization: nothing granted yet -> 403 from RBAC (not 401)
    with pytest.raises(client.ApiException) as denied:
        client.CoreV1Api(sa_api).list_namespaced_secret(namespace)
    assert denied.value.status == 403
    assert f"system:serviceaccount:{namespace}:{sa}" in denied.value.body

    # a token the apiserver did not sign is rejected outright
    forged = token[: token.rindex(".") + 1] + "AAAA" + token[token.rindex(".") + 5 :]
    with pytest.raises(client.ApiException) as unauth:
        client.CoreV1Api(cluster.token_api_client(forged)).list_namespaced_secret(namespace)
    assert unauth.value.status == 401

    # grant list on secrets in this namespace only, and it works
    rbac.create_namespaced_role(
        namespace,
        client.V1Role(
            metadata=client.V1ObjectMeta(name="secret-reader"),
            rules=[client.V1PolicyRule(api_groups=[""], resources=["secrets"], verbs=["list"])],
        ),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="secret-reader"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="secret-reader"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=sa, namespace=namespace)],
        ),
    )

    def allowed():
        try:
            client.CoreV1Api(sa_api).list_namespaced_secret(namespace)
            return True
        except client.ApiException as e:
            if e.status == 403:
                return False
            raise

    wait_for("RBAC grant to take effect", allowed, timeout=30)
    with pytest.raises(client.ApiException) as other_ns:
        client.CoreV1Api(sa_api).list_namespaced_secret("kube-system")
    assert other_ns.value.status == 403


# --------------------------------------------------------------------------- audit log


def test_audit_log_records_writes_with_user(cluster, api_client, namespace):
    if not cluster.audit_log:
        pytest.skip("no audit log for this cluster (DISAGG_AUDIT_LOG not set)")
    core = client.CoreV1Api(api_client)
    name = f"audit-{uuid.uuid4().hex[:6]}"
    core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name), data={"k": "v"})
    )
    core.read_namespaced_config_map(name, namespace)  # reads are not logged

    def events():
        return [
            e for e in cluster.audit_events()
            if (e.get("objectRef") or {}).get("name") == name
        ]

    found = wait_for("audit event for the ConfigMap create", events, timeout=15)
    assert [e["verb"] for e in found] == ["create"]
    assert found[0]["level"] == "Metadata"
    assert found[0]["user"]["username"] == "kubernetes-admin"
    assert found[0]["responseStatus"]["code"] == 201
