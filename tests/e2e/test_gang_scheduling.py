"""Gangs (issue 18, part 4): the pods of an engine that spans nodes are bound all together or not at all.

The real parts: kube-scheduler v1.37.2 with GenericWorkload (its GangScheduling plugin and pod group
scheduling cycle), kube-apiserver serving scheduling.k8s.io/v1beta1 PodGroups and pod.spec.schedulingGroup,
kube-controller-manager's PodGroup protection, the LeaderWorkerSet v0.9.0 controller and webhooks
(hack/cluster.sh up), and kwok's p5en nodes (8 nvidia.com/gpu each, hack/nodes/p5en.yaml).

The gang: the label GANG_LABEL on an LWS's pod template, one PodGroup per LWS group named `<lws>-<group
index>` (its leader pod's name) with minCount = the group's size, and, once per cluster, the chart's
MutatingAdmissionPolicy (templates/gang-policy.yaml, rendered here by the real helm), which sets every labelled
LWS pod's spec.schedulingGroup.podGroupName to its leader pod's name (the leader's own name; a worker's
`leaderworkerset.sigs.k8s.io/leader-name` annotation). LWS v0.9.0 cannot: its only gang provider is Volcano.

The first tests make the LWS and PodGroups by hand, to show the scheduler's side. Filler pods take whole p5en
nodes so that a group of two 8-GPU pods finds only one free node. Then no pod of it is bound (without the gang
the leader takes the free node alone and holds 8 GPUs: the control test), the PodGroup and the pods say why,
and once a filler goes the whole group is bound at once. With two groups and room for one, one group is bound
whole and the other not at all. Pods with a priorityClassName need it on their PodGroup too, or the scheduler
refuses the group. The last tests are the operator's own: a model whose decode engines span two nodes each,
and one of one-pod engines, on pools of nodes too small for what they ask, then large enough.

Waits are on conditions; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from kubernetes import client

from disagg_connector import contract

from tests.fixtures.helm import CHART, helm
from tests.fixtures.e2e.models import model_manifest, whole_node_pair
from tests.fixtures.e2e.nodes import POOL, Pool
from tests.fixtures.e2e.models import get_model
from tests.fixtures.e2e.waiting import condition, pod_ready, wait_for

pytestmark = pytest.mark.e2e

LWS_GROUP, LWS_VERSION, LWS_PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
PG_GROUP, PG_VERSION, PG_PLURAL = "scheduling.k8s.io", "v1beta1", "podgroups"
MAP_GROUP, MAP_VERSION = "admissionregistration.k8s.io", "v1"
NAME_LABEL, GROUP_INDEX_LABEL = contract.LWS_NAME_LABEL, contract.LWS_GROUP_INDEX_LABEL
GANG_LABEL, GANG_VALUE = contract.LABEL_GANG, contract.GANG_LWS_GROUP
POLICY = "e2e-disagg-operator-gang"  # the chart's, release "e2e"
GPU = "nvidia.com/gpu"
P5EN_NODES = [f"kwok-p5en-{i}" for i in range(4)]  # hack/nodes/p5en.yaml: 8 GPUs each, tainted nvidia.com/gpu
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}

# The cluster-wide policy, as the chart renders it where PodGroups and MutatingAdmissionPolicies are served
# (templates/gang-policy.yaml): the PodGroup of an LWS pod is named after its group's leader pod,
# `<lws>-<group index>`, which every pod of the group knows at creation.
def chart_policy() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = helm("template", "e2e", str(CHART), "--show-only", "templates/gang-policy.yaml",
                "--api-versions", "scheduling.k8s.io/v1beta1/PodGroup",
                "--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy").docs()  # fmt: skip
    policy, binding = docs
    assert policy["metadata"]["name"] == POLICY and binding["spec"]["policyName"] == POLICY
    return policy, binding


@pytest.fixture(autouse=True, scope="module")
def gangs_served(cluster) -> None:
    """hack/cluster.sh up serves PodGroups (GenericWorkload) and runs LWS; a cluster from KUBECONFIG may not."""
    api = cluster.api_client()
    try:
        resources = client.CustomObjectsApi(api).get_api_resources(PG_GROUP, PG_VERSION).resources
    except client.ApiException as e:
        if e.status != 404:
            raise
        resources = []
    missing = [] if any(r.name == PG_PLURAL for r in resources) else [f"{PG_PLURAL}.{PG_GROUP}/{PG_VERSION}"]
    try:
        client.ApiextensionsV1Api(api).read_custom_resource_definition(f"{LWS_PLURAL}.{LWS_GROUP}")
    except client.ApiException as e:
        if e.status != 404:
            raise
        missing.append("the LeaderWorkerSet CRD")
    if missing:
        if cluster.local:
            pytest.fail(
                f"the local cluster does not serve {' and '.join(missing)}: it was started before hack/cluster.sh "
                "enabled GenericWorkload; run hack/cluster.sh down and up",
                pytrace=False,
            )
        pytest.skip(f"no {' and '.join(missing)} in the cluster from KUBECONFIG")


@pytest.fixture(scope="module")
def gang_policy(cluster, gangs_served) -> Iterator[None]:
    custom = client.CustomObjectsApi(cluster.api_client())
    policy, binding = chart_policy()
    for obj, plural in ((policy, "mutatingadmissionpolicies"), (binding, "mutatingadmissionpolicybindings")):
        try:
            custom.delete_cluster_custom_object(MAP_GROUP, MAP_VERSION, plural, obj["metadata"]["name"])
        except client.ApiException as e:
            if e.status != 404:
                raise
        custom.create_cluster_custom_object(MAP_GROUP, MAP_VERSION, plural, obj)
    yield
    for obj, plural in ((binding, "mutatingadmissionpolicybindings"), (policy, "mutatingadmissionpolicies")):
        try:
            custom.delete_cluster_custom_object(MAP_GROUP, MAP_VERSION, plural, obj["metadata"]["name"])
        except client.ApiException as e:
            if e.status != 404:
                raise


# --- objects -------------------------------------------------------------------------------------------


def lws_manifest(name: str, *, replicas: int, size: int, gang: bool, priority_class: str | None = None) -> dict[str, Any]:
    """`replicas` groups of `size` pods, each pod asking for a whole p5en node's 8 GPUs."""
    labels = {"app": name, **({GANG_LABEL: GANG_VALUE} if gang else {})}
    lws = {
        "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",  # the workers exist as soon as the leader does: one gang
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "nodeSelector": {"type": "kwok", "node.kubernetes.io/instance-type": "p5en.48xlarge"},
                        "tolerations": [GPU_TOLERATION],
                        "containers": [{
                            "name": "engine", "image": "registry.example/engine:dev",
                            "resources": {"requests": {GPU: "8"}, "limits": {GPU: "8"}},
                        }],  # fmt: skip
                    },
                },
            },
        },
    }
    if priority_class:
        lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["priorityClassName"] = priority_class
    return lws


def pod_group_manifest(lws: dict[str, Any], index: int, priority_class: str | None = None) -> dict[str, Any]:
    """The PodGroup of group `index` of `lws`: all `size` pods or none, collected with the LWS. Its priority
    must be the pods' (the scheduler refuses a group whose pods' priority differs from its own)."""
    name = lws["metadata"]["name"]
    pg = {
        "apiVersion": f"{PG_GROUP}/{PG_VERSION}",
        "kind": "PodGroup",
        "metadata": {
            "name": f"{name}-{index}",
            "labels": {NAME_LABEL: name, GROUP_INDEX_LABEL: str(index)},
            "ownerReferences": [{
                "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}", "kind": "LeaderWorkerSet",
                "name": name, "uid": lws["metadata"]["uid"],
            }],  # fmt: skip
        },
        "spec": {"schedulingPolicy": {"gang": {"minCount": lws["spec"]["leaderWorkerTemplate"]["size"]}}},
    }
    if priority_class:
        pg["spec"]["priorityClassName"] = priority_class
    return pg


def create_lws(
    api_client, namespace: str, name: str, *, replicas: int, size: int, gang: bool,
    priority_class: str | None = None, pod_group_priority_class: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The LWS, then (with `gang`) its groups' PodGroups: a pod may exist before its PodGroup, and waits for it."""
    custom = client.CustomObjectsApi(api_client)
    manifest = lws_manifest(name, replicas=replicas, size=size, gang=gang, priority_class=priority_class)
    lws = custom.create_namespaced_custom_object(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, manifest)
    if gang:
        for index in range(replicas):
            pg = pod_group_manifest(lws, index, pod_group_priority_class)
            custom.create_namespaced_custom_object(PG_GROUP, PG_VERSION, namespace, PG_PLURAL, pg)
    return lws


def take_node(core: client.CoreV1Api, namespace: str, node: str) -> str:
    """A pod that holds all 8 GPUs of `node`; its name."""
    name = f"filler-{node}"
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "filler"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [GPU_TOLERATION],
            "containers": [{"name": "filler", "image": "registry.example/filler:dev",
                            "resources": {"requests": {GPU: "8"}, "limits": {GPU: "8"}}}],
        },
    })  # fmt: skip
    return name


# --- observations --------------------------------------------------------------------------------------


def _gpu_pods(core: client.CoreV1Api, nodes: list[str]) -> list[tuple[client.V1Pod, int]]:
    """The pods bound to these nodes that still hold GPUs (terminating ones too), with how many they ask for."""
    out = []
    for pod in core.list_pod_for_all_namespaces().items:
        if pod.spec.node_name in nodes and pod.status.phase not in ("Succeeded", "Failed"):
            gpus = sum(int(((c.resources and c.resources.requests) or {}).get(GPU, 0)) for c in pod.spec.containers)
            if gpus:
                out.append((pod, gpus))
    return out


def gpus_in_use(core: client.CoreV1Api, nodes: list[str] = P5EN_NODES) -> dict[str, int]:
    """GPUs requested by the pods bound to each p5en node that still hold them (terminating ones too)."""
    used = {node: 0 for node in nodes}
    for pod, gpus in _gpu_pods(core, nodes):
        used[pod.spec.node_name] += gpus
    return used


@pytest.fixture
def free_gpu_nodes(api_client) -> None:
    """The p5en nodes hold no GPU pod (earlier tests' namespaces may still be going)."""
    core = client.CoreV1Api(api_client)
    try:
        wait_for("every p5en node's GPUs free", lambda: not any(gpus_in_use(core).values()), timeout=120)
    except AssertionError as e:  # which test left them, and what holds them there
        raise AssertionError(f"{e}; GPU pods left on them: {gpu_holders(core)}") from None


def gpu_holders(core: client.CoreV1Api, nodes: list[str] = P5EN_NODES) -> list[str]:
    """The pods that hold GPUs of the p5en nodes: namespace/name, phase, since when deleting, finalizers, annotations."""
    return [
        f"{p.metadata.namespace}/{p.metadata.name} on {p.spec.node_name} ({p.status.phase}, deleting since "
        f"{p.metadata.deletion_timestamp}, finalizers {p.metadata.finalizers}, owners "
        f"{[o.kind + '/' + o.name for o in p.metadata.owner_references or []]}, annotations {sorted(p.metadata.annotations or {})})"
        for p, _ in _gpu_pods(core, nodes)
    ]  # fmt: skip


def lws_pods(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, client.V1Pod]:
    return {p.metadata.name: p for p in core.list_namespaced_pod(namespace, label_selector=f"{NAME_LABEL}={name}").items}


def group_pods(core: client.CoreV1Api, namespace: str, name: str, index: int, size: int) -> dict[str, client.V1Pod] | None:
    """The `size` pods of group `index` (leader `<name>-<index>`, workers `<name>-<index>-<k>`), once all exist."""
    leader = f"{name}-{index}"
    wanted = {leader, *(f"{leader}-{k}" for k in range(1, size))}
    pods = {n: p for n, p in lws_pods(core, namespace, name).items() if n in wanted}
    return pods if set(pods) == wanted else None


def pod_group(api_client, namespace: str, name: str) -> dict[str, Any]:
    return client.CustomObjectsApi(api_client).get_namespaced_custom_object(PG_GROUP, PG_VERSION, namespace, PG_PLURAL, name)


def initially_scheduled(pg: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in (pg.get("status") or {}).get("conditions", []) if c["type"] == "PodGroupInitiallyScheduled"), {})


def pod_scheduled(pod: client.V1Pod) -> client.V1PodCondition | None:
    return next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)


def failed_scheduling_notes(api_client, namespace: str, pod_name: str) -> list[str]:
    raw = client.EventsV1Api(api_client).list_namespaced_event(namespace, _preload_content=False)
    return [
        e.get("note") or "" for e in json.loads(raw.data)["items"]
        if e.get("reason") == "FailedScheduling" and (e.get("regarding") or {}).get("name") == pod_name
    ]  # fmt: skip


def ready_replicas(api_client, namespace: str, name: str) -> int:
    lws = client.CustomObjectsApi(api_client).get_namespaced_custom_object(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name)
    return (lws.get("status") or {}).get("readyReplicas") or 0


def wait_unschedulable(api_client, namespace: str, name: str, index: int, size: int) -> dict[str, client.V1Pod]:
    """The group's pods once the scheduler has tried the group and refused it as a whole."""
    core = client.CoreV1Api(api_client)
    pg_name = f"{name}-{index}"
    # A first cycle may end in a SchedulerError (seen once in CI, on a PodGroup made while its pods waited) that
    # the scheduler retries: the refusal this waits for is the Unschedulable one, which must come.
    condition = wait_for(
        f"PodGroup {pg_name} PodGroupInitiallyScheduled=False, Unschedulable",
        lambda: (c := initially_scheduled(pod_group(api_client, namespace, pg_name))).get("status") == "False"
        and c.get("reason") == "Unschedulable" and c,
        timeout=60,
    )
    assert f"minCount ({size}) cannot be satisfied" in condition["message"], condition

    def refused() -> dict[str, client.V1Pod] | None:
        pods = group_pods(core, namespace, name, index, size)
        if not pods or not all((c := pod_scheduled(p)) and c.status == "False" for p in pods.values()):
            return None
        return pods

    return wait_for(f"every pod of group {pg_name} PodScheduled=False", refused, timeout=30)


# --- tests ---------------------------------------------------------------------------------------------


def test_without_a_gang_the_leader_binds_alone_and_holds_gpus(api_client, namespace, gang_policy, free_gpu_nodes) -> None:
    """The control: the same group without the label and PodGroup (the policy leaves its pods alone). The
    scheduler places pod by pod, so the leader takes the one free node and holds its 8 GPUs while the worker
    waits, and the engine cannot serve."""
    core = client.CoreV1Api(api_client)
    for node in P5EN_NODES[1:]:
        take_node(core, namespace, node)
    wait_for("3 fillers bound", lambda: sum(gpus_in_use(core).values()) == 24, timeout=60)

    name = "no-gang"
    create_lws(api_client, namespace, name, replicas=1, size=2, gang=False)

    def partial() -> dict[str, client.V1Pod] | None:
        pods = group_pods(core, namespace, name, 0, 2)
        if not pods:
            return None
        unbound = [p for p in pods.values() if not p.spec.node_name]
        if len(unbound) == 1 and (c := pod_scheduled(unbound[0])) and c.status == "False":
            return pods
        return None

    pods = wait_for("one pod bound, the other refused", partial, timeout=60)
    bound = [p for p in pods.values() if p.spec.node_name]
    assert [(p.metadata.name, p.spec.node_name) for p in bound] == [(f"{name}-0", P5EN_NODES[0])]  # the leader
    assert all(p.spec.scheduling_group is None for p in pods.values())
    assert gpus_in_use(core)[P5EN_NODES[0]] == 8  # a partial group holds a whole node's GPUs


def test_a_group_that_cannot_fit_binds_no_pod_until_all_of_it_fits(api_client, namespace, gang_policy, free_gpu_nodes) -> None:
    core = client.CoreV1Api(api_client)
    fillers = {node: take_node(core, namespace, node) for node in P5EN_NODES[1:]}
    wait_for("3 fillers bound", lambda: sum(gpus_in_use(core).values()) == 24, timeout=60)

    name = "gang"
    create_lws(api_client, namespace, name, replicas=1, size=2, gang=True)
    pods = wait_unschedulable(api_client, namespace, name, 0, 2)

    # the policy put both pods in their group's PodGroup, named after the leader
    assert {n: p.spec.scheduling_group.pod_group_name for n, p in pods.items()} == {"gang-0": "gang-0", "gang-0-1": "gang-0"}
    # no pod of the group is bound: the free node holds no GPU although one pod would fit on it
    assert [p.spec.node_name for p in pods.values()] == [None, None]
    assert gpus_in_use(core)[P5EN_NODES[0]] == 0
    # why, on each pod: the one that would fit is refused for its group, the other for want of GPUs
    messages = sorted(pod_scheduled(p).message for p in pods.values())
    assert all(pod_scheduled(p).reason == "Unschedulable" for p in pods.values())
    assert any(m.startswith("pod group is unschedulable, minCount (2) cannot be satisfied") for m in messages), messages
    assert any(f"Insufficient {GPU}" in m for m in messages), messages
    assert any(
        note.startswith("pod group is unschedulable")
        for pod in pods for note in failed_scheduling_notes(api_client, namespace, pod)
    )  # fmt: skip

    # a node frees up: the whole group is bound at once, one pod per free node
    core.delete_namespaced_pod(fillers[P5EN_NODES[1]], namespace, grace_period_seconds=0)

    def bound() -> dict[str, client.V1Pod] | None:
        pods = group_pods(core, namespace, name, 0, 2)
        return pods if pods and all(p.spec.node_name for p in pods.values()) else None

    pods = wait_for("both pods of the group bound", bound, timeout=90)
    assert sorted(p.spec.node_name for p in pods.values()) == P5EN_NODES[:2]
    condition = initially_scheduled(pod_group(api_client, namespace, "gang-0"))
    assert (condition["status"], condition["reason"]) == ("True", "Scheduled"), condition
    wait_for("both pods Ready", lambda: (g := group_pods(core, namespace, name, 0, 2)) and all(map(pod_ready, g.values())), timeout=60)
    wait_for("LWS status.readyReplicas == 1", lambda: ready_replicas(api_client, namespace, name) == 1, timeout=60)


def test_each_group_is_its_own_gang(api_client, namespace, gang_policy, free_gpu_nodes) -> None:
    """Two groups of two and room for three pods: one group is bound whole, the other not at all (one PodGroup
    per group: a single PodGroup for the LWS would let the third pod in)."""
    core = client.CoreV1Api(api_client)
    filler = take_node(core, namespace, P5EN_NODES[3])
    wait_for("filler bound", lambda: sum(gpus_in_use(core).values()) == 8, timeout=60)

    name = "gangs"
    create_lws(api_client, namespace, name, replicas=2, size=2, gang=True)

    def one_group_bound() -> tuple[int, int] | None:
        groups = [group_pods(core, namespace, name, i, 2) for i in range(2)]
        if not all(groups):
            return None
        done = [i for i, g in enumerate(groups) if all(p.spec.node_name for p in g.values())]
        return (done[0], 1 - done[0]) if len(done) == 1 else None

    placed, waiting = wait_for("one whole group bound", one_group_bound, timeout=60)
    condition = initially_scheduled(pod_group(api_client, namespace, f"{name}-{placed}"))
    assert (condition["status"], condition["reason"]) == ("True", "Scheduled"), condition
    pods = wait_unschedulable(api_client, namespace, name, waiting, 2)
    assert [p.spec.node_name for p in pods.values()] == [None, None]
    assert {p.spec.scheduling_group.pod_group_name for p in pods.values()} == {f"{name}-{waiting}"}
    used = gpus_in_use(core)
    assert sum(used.values()) == 8 + 2 * 8  # the filler and the placed group; one node stays free
    assert sorted(used.values()) == [0, 8, 8, 8]

    core.delete_namespaced_pod(filler, namespace, grace_period_seconds=0)

    def all_bound() -> bool:
        pods = lws_pods(core, namespace, name)
        return len(pods) == 4 and all(p.spec.node_name for p in pods.values())

    wait_for("the second group bound", all_bound, timeout=90)
    condition = initially_scheduled(pod_group(api_client, namespace, f"{name}-{waiting}"))
    assert (condition["status"], condition["reason"]) == ("True", "Scheduled"), condition
    wait_for("LWS status.readyReplicas == 2", lambda: ready_replicas(api_client, namespace, name) == 2, timeout=60)


@pytest.fixture
def priority_class(api_client, namespace) -> Iterator[str]:
    """A PriorityClass of its own (cluster-scoped: removed after the test)."""
    scheduling = client.SchedulingV1Api(api_client)
    name = f"{namespace}-engines"
    scheduling.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                      "metadata": {"name": name}, "value": 1000})  # fmt: skip
    yield name
    scheduling.delete_priority_class(name)


def test_the_pod_group_carries_the_pods_priority(api_client, namespace, gang_policy, free_gpu_nodes, priority_class) -> None:
    """Pods with a priorityClassName (spec.<role>.priorityClassName) need a PodGroup with the same one: with
    none, the PodGroup's priority is 0 and the scheduler refuses the group as an error; with it, the group is
    bound (room enough here)."""
    core = client.CoreV1Api(api_client)
    create_lws(api_client, namespace, "bare", replicas=1, size=2, gang=True, priority_class=priority_class)
    condition = wait_for(
        "PodGroup bare-0 PodGroupInitiallyScheduled=False",
        lambda: (c := initially_scheduled(pod_group(api_client, namespace, "bare-0"))).get("status") == "False" and c,
        timeout=60,
    )
    assert condition["reason"] == "SchedulerError", condition
    assert "should have the same priority as the pod group's priority, got 1000 and 0" in condition["message"], condition
    assert all(not p.spec.node_name for p in (group_pods(core, namespace, "bare", 0, 2) or {}).values())

    create_lws(
        api_client, namespace, "prio", replicas=1, size=2, gang=True,
        priority_class=priority_class, pod_group_priority_class=priority_class,
    )  # fmt: skip
    pg = wait_for(
        "PodGroup prio-0 PodGroupInitiallyScheduled=True",
        lambda: (g := pod_group(api_client, namespace, "prio-0")) and initially_scheduled(g).get("status") == "True" and g,
        timeout=60,
    )
    assert (pg["spec"]["priorityClassName"], pg["spec"]["priority"]) == (priority_class, 1000)  # set by admission
    # the condition comes with the quorum's reservation; the bindings follow
    pods = wait_for("both pods bound", lambda: (g := group_pods(core, namespace, "prio", 0, 2))
                    and all(p.spec.node_name for p in g.values()) and g, timeout=30)  # fmt: skip
    assert all(p.spec.priority == 1000 for p in pods.values())


def test_the_operators_engines_wait_whole_first_pair_first(operator, cluster, api_client, namespace, gang_policy) -> None:
    """The operator's PodGroups on the real scheduler: prefill one 8-GPU pod, decode two engines of two 8-GPU
    pods each, on a pool of nodes of this test's own.

    - Two nodes: the revision's first pair (the prefill pod and decode group 0: 3 pods) does not fit, so nothing
      is bound and the nodes keep their GPUs (decode group 1 has no PodGroup yet: its pods wait outside the
      scheduler's queue, so it cannot take the nodes the pair needs).
    - A third node: the pair is bound whole; then group 1 gets its PodGroup and, with no room, waits whole; the
      model names that engine and what it lacks.
    - Two nodes more: group 1 is bound whole, and the model is Ready."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    pool = Pool(api_client, f"{namespace}-gang")
    place = {"nodeSelector": {POOL: pool.label}}
    name = "gangs"
    manifest = model_manifest(name, {
        "prefill": {"replicas": 1, "parallelism": {"tensor": 8}, "accelerator": {"count": 8}, **place},
        "decode": {"replicas": 2, "parallelism": {"data": 16, "expert": True}, "accelerator": {"count": 8}, **place},
        "network": {"placement": {"zone": "None", "spine": "None"}},
    })  # fmt: skip
    engines = f"{contract.LABEL_MODEL}={contract.model_label_value(name)},{contract.LABEL_ROLE} in (prefill,decode)"

    def bound() -> dict[str, str]:
        return {p.metadata.name: p.spec.node_name for p in core.list_namespaced_pod(namespace, label_selector=engines).items
                if p.spec.node_name}  # fmt: skip

    def pool_gpus() -> int:
        return sum(gpus_in_use(core, pool.names).values())

    try:
        pool.add(2)
        custom.create_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, manifest)
        revision = wait_for("a revision", lambda: (get_model(custom, namespace, name).get("status") or {}).get("revision"), timeout=60)
        lws, pair = contract.engine_deployment_name(name, "decode", revision), contract.pair_pod_group_name(name, revision)
        refused = wait_for(
            f"PodGroup {pair} PodGroupInitiallyScheduled=False",
            lambda: (c := initially_scheduled(pod_group(api_client, namespace, pair))).get("status") == "False" and c,
            timeout=90,
        )
        assert "minCount (3) cannot be satisfied" in refused["message"], refused
        assert bound() == {} and pool_gpus() == 0
        assert not _pod_group_exists(api_client, namespace, f"{lws}-1"), "group 1 waits for the pair"

        pool.add(1)
        wait_for("the pair bound whole", lambda: set(bound()) == {f"{lws}-0", f"{lws}-0-1"} | {
            p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=prefill").items}, timeout=120)
        wait_for("group 1's PodGroup, once the pair is bound", lambda: _pod_group_exists(api_client, namespace, f"{lws}-1"), timeout=60)
        pods = wait_unschedulable(api_client, namespace, lws, 1, 2)  # no room: neither of its pods is bound
        assert {p.spec.scheduling_group.pod_group_name for p in pods.values()} == {f"{lws}-1"}
        assert [p.spec.node_name for p in pods.values()] == [None, None]
        pg = pod_group(api_client, namespace, f"{lws}-1")
        assert pg["metadata"]["ownerReferences"][0]["kind"] == "DisaggregatedModel"

        def names_the_engine() -> dict[str, Any] | None:
            obj = get_model(custom, namespace, name)
            said = [c for c in (obj.get("status") or {}).get("conditions", []) if f"decode engine {lws}/1" in c.get("message", "")]
            return obj if any(c["reason"] == "InsufficientGPUs" for c in said) else None

        obj = wait_for("the model names decode engine 1 and what it lacks", names_the_engine, timeout=60)
        gang = condition(obj, "GangScheduled")
        assert (gang["status"], gang["reason"]) == ("True", "PodGroups"), gang

        pool.add(2)
        wait_for("group 1 bound whole", lambda: {f"{lws}-1", f"{lws}-1-1"} <= set(bound()), timeout=120)
        assert len(set(bound().values())) == 5, "one node per pod"
        wait_for("Ready, two decode engines", lambda: (o := get_model(custom, namespace, name))
                 and condition(o, "Ready").get("status") == "True" and o["status"]["decode"]["readyReplicas"] == 2, timeout=120)  # fmt: skip
    finally:
        custom.delete_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, name)
        wait_for("the model's pods gone", lambda: not core.list_namespaced_pod(
            namespace, label_selector=f"{contract.LABEL_MODEL}={contract.model_label_value(name)}").items, timeout=120)
        pool.remove()


def _pod_group_exists(api_client, namespace: str, name: str) -> bool:
    try:
        pod_group(api_client, namespace, name)
    except client.ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def test_a_pair_is_bound_whole_or_not_at_all(operator, cluster, api_client, namespace, gang_policy) -> None:
    """One-pod engines, prefill and decode 8 GPUs each, on a pool of one node: without a gang the first pod
    bound would take the node and serve nothing; with the revision's pair PodGroup neither is bound and the node
    keeps its GPUs. A second node, and both are bound at once."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    pool = Pool(api_client, f"{namespace}-pair")
    name = "pair"
    manifest = whole_node_pair(name, pool.label)
    engines = f"{contract.LABEL_MODEL}={contract.model_label_value(name)},{contract.LABEL_ROLE} in (prefill,decode)"
    try:
        pool.add(1)
        custom.create_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, manifest)
        revision = wait_for("a revision", lambda: (get_model(custom, namespace, name).get("status") or {}).get("revision"), timeout=60)
        group = contract.pair_pod_group_name(name, revision)
        condition_ = wait_for(
            f"PodGroup {group} PodGroupInitiallyScheduled=False",
            lambda: (c := initially_scheduled(pod_group(api_client, namespace, group))).get("status") == "False" and c,
            timeout=90,
        )
        assert condition_["reason"] == "Unschedulable" and "minCount (2) cannot be satisfied" in condition_["message"], condition_
        pods = wait_for("both pods refused", lambda: (p := core.list_namespaced_pod(namespace, label_selector=engines).items)
                        and len(p) == 2 and all((c := pod_scheduled(x)) and c.status == "False" for x in p) and p, timeout=60)  # fmt: skip
        assert {p.spec.scheduling_group.pod_group_name for p in pods} == {group}
        assert [p.spec.node_name for p in pods] == [None, None]
        assert not core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={pool.names[0]}").items

        pool.add(1)
        bound = wait_for("both bound", lambda: (p := core.list_namespaced_pod(namespace, label_selector=engines).items)
                         and len(p) == 2 and all(x.spec.node_name for x in p) and p, timeout=120)  # fmt: skip
        assert sorted(p.spec.node_name for p in bound) == sorted(pool.names)
        wait_for("Ready", lambda: condition(get_model(custom, namespace, name), "Ready").get("status") == "True", timeout=120)
    finally:
        custom.delete_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, name)
        wait_for("the model's pods gone", lambda: not core.list_namespaced_pod(
            namespace, label_selector=f"{contract.LABEL_MODEL}={contract.model_label_value(name)}").items, timeout=120)
        pool.remove()
