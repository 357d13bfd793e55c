"""Gangs that tell the truth, on the real API server, kube-scheduler (GenericWorkload), LWS and kwok p5en nodes,
with the operator running as users run it: installed without the chart, and on the demo's own cluster.

- Without the chart's admission policy, the multi-node example's LWS pods join no PodGroup and are bound one by
  one: the model says so (GangScheduled=False, the reason, the fix) instead of GangScheduled=True, and the gang
  that binds only in part is named with the GPUs it holds, in GangScheduled, Ready and an Event.
- One-pod engines name their revision's pair themselves: without the policy the pair still binds whole or not
  at all.
- On the cluster as `hack/demo.sh cluster --p5en 8` leaves it (the chart's policy installed, four p5en nodes in a
  zone of their own), the multi-node example as it is, which fits one decode engine but not two: the pair and
  decode group 0 bound whole, group 1 waiting whole, no GPU held by a part.

Waits are on conditions; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Iterator

import pytest
from kubernetes import client

from disagg_connector import contract
from disagg_operator import gangs
from disagg_operator.render import gang

from tests.fixtures.e2e.models import get_model, model_manifest, whole_node_pair
from tests.fixtures.e2e.nodes import POOL, Pool
from tests.fixtures.e2e.waiting import condition, wait_for
from tests.fixtures.models import REPO

pytestmark = pytest.mark.e2e

MAP_GROUP, MAP_VERSION = "admissionregistration.k8s.io", "v1"
PG_GROUP, PG_VERSION, PG_PLURAL = "scheduling.k8s.io", "v1beta1", "podgroups"
MULTI_NODE = "deepseek-v3-p5en-wide-ep"  # prefill one 8-GPU pod per engine, decode engines of two 8-GPU pods
GPU = "nvidia.com/gpu"


def gang_policies(api_client) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    custom = client.CustomObjectsApi(api_client)
    return (custom.list_cluster_custom_object(MAP_GROUP, MAP_VERSION, "mutatingadmissionpolicies")["items"],
            custom.list_cluster_custom_object(MAP_GROUP, MAP_VERSION, "mutatingadmissionpolicybindings")["items"])  # fmt: skip


def remove_gang_policies(api_client) -> None:
    """Every bound policy that puts our pods in PodGroups (the chart's, the demo's copy of it, another test's)."""
    custom = client.CustomObjectsApi(api_client)
    policies, bindings = gang_policies(api_client)
    ours = {p["metadata"]["name"] for p in policies if gangs.policy_covers([p], bindings)}
    for binding in bindings:
        if binding["spec"].get("policyName") in ours:
            custom.delete_cluster_custom_object(MAP_GROUP, MAP_VERSION, "mutatingadmissionpolicybindings", binding["metadata"]["name"])
    for name in ours:
        custom.delete_cluster_custom_object(MAP_GROUP, MAP_VERSION, "mutatingadmissionpolicies", name)


def put_in_a_group(api_client) -> bool:
    """Whether the API server's admission puts a pod of a pair in its PodGroup now (a server-side dry run: the API
    server takes policies up, and lets them go, a moment after they are written)."""
    probe = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "gang-policy-probe", "labels": {contract.LABEL_GANG: contract.GANG_PAIR, contract.LABEL_POD_GROUP: "probe"}},
             "spec": {"containers": [{"name": "probe", "image": "probe"}]}}  # fmt: skip
    made = client.CoreV1Api(api_client).create_namespaced_pod("default", probe, dry_run="All")
    return made.spec.scheduling_group is not None


@pytest.fixture
def no_gang_policy(api_client) -> Iterator[None]:
    """The operator installed without the chart: no admission policy puts pods in their PodGroups."""
    remove_gang_policies(api_client)
    wait_for("no gang policy in effect", lambda: not gangs.policy_covers(*gang_policies(api_client)) and not put_in_a_group(api_client),
             timeout=30)  # fmt: skip
    yield


def model_pods(core: client.CoreV1Api, namespace: str, name: str) -> list[client.V1Pod]:
    selector = f"{contract.LABEL_MODEL}={contract.model_label_value(name)},{contract.LABEL_ROLE} in (prefill,decode)"
    return core.list_namespaced_pod(namespace, label_selector=selector).items


def unschedulable(pod: client.V1Pod) -> bool:
    return any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable" for c in pod.status.conditions or [])


def model_events(api_client, namespace: str, name: str) -> list[dict[str, Any]]:
    raw = client.EventsV1Api(api_client).list_namespaced_event(namespace, _preload_content=False)
    return [e for e in json.loads(raw.data)["items"] if (e.get("regarding") or {}).get("kind") == contract.KIND
            and (e.get("regarding") or {}).get("name") == name]  # fmt: skip


def delete_model(custom, core, namespace: str, name: str) -> None:
    custom.delete_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, name)
    wait_for("the model's pods gone", lambda: not core.list_namespaced_pod(
        namespace, label_selector=f"{contract.LABEL_MODEL}={contract.model_label_value(name)}").items, timeout=120)


def test_without_the_policy_the_model_says_its_pods_are_outside_their_groups_and_names_the_part_bound(
    operator, api_client, namespace, no_gang_policy
) -> None:
    """The multi-node example on a pool of 4 whole nodes for its 5 pods (a prefill pod, two decode engines of two
    pods), with no admission policy: the pods are bound one by one, 4 of them, so a gang is bound in part."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    pool = Pool(api_client, f"{namespace}-truth")
    name = "outside"
    place = {"nodeSelector": {POOL: pool.label}}
    manifest = model_manifest(name, {"prefill": place, "decode": place}, example=MULTI_NODE)
    try:
        pool.add(4)
        custom.create_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, manifest)
        wait_for("4 pods bound one by one, the fifth refused", lambda: (p := model_pods(core, namespace, name)) and len(p) == 5
                 and sum(bool(x.spec.node_name) for x in p) == 4 and sum(unschedulable(x) for x in p) == 1, timeout=120)  # fmt: skip
        assert all(p.spec.scheduling_group is None for p in model_pods(core, namespace, name)), "no policy: no pod in a group"

        said = wait_for("GangScheduled=False, PartlyBound", lambda: (c := condition(get_model(custom, namespace, name), "GangScheduled"))
                        .get("reason") == "PartlyBound" and c, timeout=60)  # fmt: skip
        assert said["status"] == "False"
        assert " is partly bound: " in said["message"] and f" {GPU} (" in said["message"], said["message"]
        assert "gang pods are not in their PodGroup" in said["message"] and gang.POLICY_COMMAND in said["message"]
        ready = condition(get_model(custom, namespace, name), "Ready")
        assert ready["status"] == "False" and " is partly bound: " in ready["message"], ready
        noted = wait_for("a PartlyBound Event", lambda: [e for e in model_events(api_client, namespace, name)
                                                        if e["reason"] == "PartlyBound"], timeout=30)  # fmt: skip
        assert noted[0]["type"] == "Warning" and f" {GPU} (" in noted[0]["note"]
    finally:
        delete_model(custom, core, namespace, name)
        pool.remove()


def test_without_the_policy_one_pod_engines_name_their_pair_and_it_binds_whole_or_not_at_all(
    operator, api_client, namespace, no_gang_policy
) -> None:
    """Prefill and decode one 8-GPU pod each on a pool of one node: the pods name their revision's pair themselves,
    so neither binds (the node keeps its GPUs); a second node, and both bind at once."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    pool = Pool(api_client, f"{namespace}-pair")
    name = "pair"
    manifest = whole_node_pair(name, pool.label)
    try:
        pool.add(1)
        custom.create_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, manifest)
        pods = wait_for("both pods refused as one", lambda: (p := model_pods(core, namespace, name)) and len(p) == 2
                        and all(unschedulable(x) for x in p) and p, timeout=90)  # fmt: skip
        revision = pods[0].metadata.labels[contract.LABEL_REVISION]
        assert {p.spec.scheduling_group.pod_group_name for p in pods} == {contract.pair_pod_group_name(name, revision)}
        assert [p.spec.node_name for p in pods] == [None, None]
        assert not core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={pool.names[0]}").items
        said = wait_for("GangScheduled=True", lambda: (c := condition(get_model(custom, namespace, name), "GangScheduled"))
                        .get("status") == "True" and c, timeout=60)  # fmt: skip
        assert said["reason"] == "PodGroups"

        pool.add(1)
        bound = wait_for("both bound", lambda: (p := model_pods(core, namespace, name)) and len(p) == 2
                         and all(x.spec.node_name for x in p) and p, timeout=120)  # fmt: skip
        assert sorted(p.spec.node_name for p in bound) == sorted(pool.names)
    finally:
        delete_model(custom, core, namespace, name)
        pool.remove()


@pytest.fixture
def demo_cluster(cluster, api_client) -> Iterator[None]:
    """The cluster as `hack/demo.sh cluster --p5en 8` leaves it: the chart's gang policy, eight p5en nodes (the four
    beyond hack/nodes/ in a zone of their own, us-west-2c). Afterwards the pool and policy are as before."""
    if not cluster.local:
        pytest.skip("the demo's cluster is the local one (hack/cluster.sh); DISAGG_E2E_USE_KUBECONFIG uses another")
    subprocess.run(["bash", "hack/demo.sh", "cluster", "--p5en", "8"], cwd=REPO, check=True, env=os.environ.copy())
    assert put_in_a_group(api_client), "hack/demo.sh waits until its policy is in effect"
    try:
        yield
    finally:
        subprocess.run(["bash", "hack/cluster.sh", "p5en", "4"], cwd=REPO, check=True, env=os.environ.copy())
        remove_gang_policies(api_client)


def test_on_the_demos_cluster_the_multi_node_example_binds_whole_engines_only(operator, api_client, namespace, demo_cluster) -> None:
    """The example as it is (its placement requires one zone for all its pods): only us-west-2c has room for its
    pair (3 whole nodes), and not for the second decode engine beside it (4 nodes for 5 pods): the pair (the
    prefill pod and decode group 0) bound whole, group 1 waiting whole, the fourth node holding no GPU."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "deepseek-v3"
    manifest = model_manifest(name, example=MULTI_NODE)
    zone_nodes = [n.metadata.name for n in core.list_node(label_selector="topology.kubernetes.io/zone=us-west-2c").items]
    assert len(zone_nodes) == 4, zone_nodes
    try:
        custom.create_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, manifest)
        revision = wait_for("a revision", lambda: (get_model(custom, namespace, name).get("status") or {}).get("revision"), timeout=60)
        lws = contract.engine_deployment_name(name, "decode", revision)
        def settled() -> dict[str, client.V1Pod] | None:
            p = {x.metadata.name: x for x in model_pods(core, namespace, name)}
            group1 = [p.get(f"{lws}-1"), p.get(f"{lws}-1-1")]
            whole = len(p) == 5 and all(x is not None and unschedulable(x) for x in group1)
            return p if whole and sum(bool(x.spec.node_name) for x in p.values()) == 3 else None

        try:
            pods = wait_for("the pair bound, group 1 refused whole", settled, timeout=180)
        except AssertionError as error:
            seen = [(x.metadata.name, x.spec.node_name, [(c.reason, c.message) for c in x.status.conditions or [] if c.type == "PodScheduled"])
                    for x in model_pods(core, namespace, name)]  # fmt: skip
            raise AssertionError(f"{error}: pods {seen}") from None
        bound = {n for n, p in pods.items() if p.spec.node_name}
        assert {f"{lws}-0", f"{lws}-0-1"} <= bound and any(n.startswith(f"{name}-prefill-") for n in bound), bound
        assert [pods[f"{lws}-1"].spec.node_name, pods[f"{lws}-1-1"].spec.node_name] == [None, None]
        free = set(zone_nodes) - {p.spec.node_name for p in pods.values()}
        assert len(free) == 1 and not core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={free.pop()}").items
        pair = contract.pair_pod_group_name(name, revision)
        assert {p.spec.scheduling_group.pod_group_name for n, p in pods.items() if n in bound} == {pair}
        assert {pods[f"{lws}-1"].spec.scheduling_group.pod_group_name, pods[f"{lws}-1-1"].spec.scheduling_group.pod_group_name} == {f"{lws}-1"}
        said = wait_for("GangScheduled=True and Ready naming engine 1", lambda: (o := get_model(custom, namespace, name))
                        and f"decode engine {lws}/1" in condition(o, "Ready").get("message", "") and o, timeout=60)  # fmt: skip
        assert (condition(said, "GangScheduled")["status"], condition(said, "GangScheduled")["reason"]) == ("True", "PodGroups")
        assert "partly bound" not in condition(said, "Ready")["message"]
    finally:
        delete_model(custom, core, namespace, name)
