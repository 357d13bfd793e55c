"""The operator live on a real API server: apply, update, rollout, delete, admission, capacity, restart.

Runs against the local control plane (hack/cluster.sh) where kwok plays kubelet for fake p5en/trn2
nodes, or against KUBECONFIG with DISAGG_E2E_USE_KUBECONFIG=1.
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import client

from disagg_connector import contract

from tests.fixtures.models import REPO, load_example, merge
from tests.fixtures.api_cases import INVALID, VALID_EDGES
from tests.fixtures.e2e.operator import OPERATOR_USER, idle, model_passes
from tests.fixtures.e2e.models import model_manifest
from tests.fixtures.e2e.waiting import condition, pod_ready as is_ready, wait_for
from tests.fixtures.e2e.models import GROUP, PLURAL, VERSION, get_model, pods_of, wait_ready

MINIMAL = load_example(REPO / "examples" / "minimal.yaml")
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


@pytest.fixture
def custom(api_client) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


def test_apply_creates_children_and_reports_ready(operator, api_client, custom, namespace) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("qwen"))
    obj = wait_ready(custom, namespace, "qwen")
    status = obj["status"]
    assert status["transferMode"] == "Push" and status["backend"] == "LIBFABRIC"
    assert status["prefill"]["readyReplicas"] == 1 and status["decode"]["readyReplicas"] == 1
    assert status["router"] == {"readyReplicas": 1, "url": f"http://qwen-router.{namespace}.svc:8000"}
    revision = status["revision"]

    apps = client.AppsV1Api(api_client)
    uid = obj["metadata"]["uid"]
    names = sorted(d.metadata.name for d in apps.list_namespaced_deployment(namespace).items)
    assert names == sorted([f"qwen-prefill-{revision}", f"qwen-decode-{revision}", "qwen-router"])
    core, rbac = client.CoreV1Api(api_client), client.RbacAuthorizationV1Api(api_client)
    children = [
        *apps.list_namespaced_deployment(namespace).items,
        *core.list_namespaced_service(namespace).items,
        *rbac.list_namespaced_role(namespace).items,
        *client.NetworkingV1Api(api_client).list_namespaced_network_policy(namespace).items,
        *client.PolicyV1Api(api_client).list_namespaced_pod_disruption_budget(namespace).items,
    ]
    for child in children:
        assert child.metadata.labels[contract.LABEL_MODEL] == "qwen"
        assert [o.uid for o in child.metadata.owner_references] == [uid]
    (prefill,) = pods_of(api_client, namespace, "qwen", "prefill")
    assert prefill.metadata.labels[contract.LABEL_REVISION] == revision
    vllm = prefill.spec.containers[0]
    assert vllm.resources.limits["vpc.amazonaws.com/efa"] == "2"
    assert prefill.spec.init_containers[0].name == "preflight"
    node = core.read_node(prefill.spec.node_name)
    assert node.metadata.labels["node.kubernetes.io/instance-type"] == "p5en.48xlarge"
    (decode,) = pods_of(api_client, namespace, "qwen", "decode")
    zone = "topology.kubernetes.io/zone"
    assert core.read_node(decode.spec.node_name).metadata.labels[zone] == node.metadata.labels[zone]


class PodTimeline:
    """Every pod event of a namespace, in order (a watch misses no transition, unlike polling)."""

    def __init__(self, api_client, namespace: str):
        from kubernetes import watch

        self.states: list[dict[str, tuple[str, str, bool]]] = []  # after each event: pod -> (role, revision, serving)
        self._watch = watch.Watch()
        self._core = client.CoreV1Api(api_client)
        self._namespace = namespace
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _entry(pod: Any) -> tuple[str, str, bool] | None:
        labels = pod.metadata.labels or {}
        if labels.get(contract.LABEL_ROLE) not in contract.ENGINE_ROLES:
            return None
        return labels[contract.LABEL_ROLE], labels[contract.LABEL_REVISION], is_ready(pod)

    def _run(self) -> None:
        listed = self._core.list_namespaced_pod(self._namespace)
        pods = {p.metadata.name: e for p in listed.items if (e := self._entry(p))}
        self.states.append(dict(pods))
        stream = self._watch.stream(self._core.list_namespaced_pod, self._namespace,
                                    resource_version=listed.metadata.resource_version, timeout_seconds=300)
        try:
            for event in stream:
                entry = self._entry(event["object"])
                if entry is None:
                    continue
                if event["type"] == "DELETED":
                    pods.pop(event["object"].metadata.name, None)
                else:
                    pods[event["object"].metadata.name] = entry
                self.states.append(dict(pods))
        except urllib3.exceptions.ProtocolError:
            if not self._stopped:
                raise  # only stop() may cut the stream

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()
        self._thread.join(timeout=10)


@pytest.mark.parametrize(
    ("change", "check"),
    [
        ({"kvTransfer": {"mode": "Pull"}}, lambda s: s["transferMode"] == "Pull"),
        ({"engine": {"image": "registry.example/vllm-runtime:0.33.0-patched"}}, lambda s: s["transferMode"] == "Push"),
    ],
    ids=["mode", "image"],
)
def test_scale_and_revision_rollout_never_mixes_revisions(operator, api_client, custom, namespace, change, check) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("roll"))
    first = wait_ready(custom, namespace, "roll")["status"]["revision"]

    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "roll", {"spec": {"prefill": {"replicas": 2}}})
    scaled = wait_ready(custom, namespace, "roll")
    assert scaled["status"]["revision"] == first, "scaling is not a new revision"
    wait_for("2 prefill ready", lambda: sum(is_ready(p) for p in pods_of(api_client, namespace, "roll", "prefill")) == 2)

    timeline = PodTimeline(api_client, namespace)
    wait_for("the watch to list the pods", lambda: timeline.states)
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "roll", {"spec": change})

    def rolled_out() -> dict | None:
        obj = get_model(custom, namespace, "roll")
        done = obj["status"].get("revision") != first and condition(obj, "Ready").get("status") == "True" \
            and condition(obj, "Progressing").get("status") == "False"
        return obj if done else None

    status = wait_for("rollout to finish", rolled_out, 120)["status"]
    apps = client.AppsV1Api(api_client)
    wait_for("old revision retired", lambda: not [
        p for p in pods_of(api_client, namespace, "roll", "prefill") + pods_of(api_client, namespace, "roll", "decode")
        if p.metadata.labels[contract.LABEL_REVISION] == first
    ])  # fmt: skip
    # the watch has seen what the API server says: the old pods gone
    wait_for("the timeline to see the old revision gone", lambda: timeline.states and not [
        e for e in timeline.states[-1].values() if e[1] == first])  # fmt: skip
    timeline.stop()
    assert check(status) and status["prefill"]["readyReplicas"] == 2
    assert not [d for d in apps.list_namespaced_deployment(namespace).items if d.metadata.labels.get(contract.LABEL_REVISION) == first]

    new = status["revision"]
    serving_revisions_seen = set()
    for pods in timeline.states:
        serving = {(role, rev) for role, rev, ready in pods.values() if ready}
        revisions_p = {rev for role, rev in serving if role == "prefill"}
        revisions_d = {rev for role, rev in serving if role == "decode"}
        # At every moment some revision that has a ready prefill also has a ready decode.
        if revisions_p and revisions_d:
            assert revisions_p & revisions_d, pods
        # And the model never went dark: the old pair served until the new pair was ready.
        assert revisions_p and revisions_d, f"no servable pair at some point: {pods}"
        serving_revisions_seen |= revisions_p & revisions_d
    assert serving_revisions_seen == {first, new}


def test_delete_garbage_collects_every_child(operator, api_client, custom, namespace) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("gone"))
    wait_ready(custom, namespace, "gone")
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gone")
    apps, core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
    wait_for("children collected", lambda: not apps.list_namespaced_deployment(namespace).items
             and not [s for s in core.list_namespaced_service(namespace).items]
             and not core.list_namespaced_service_account(namespace, label_selector=contract.LABEL_MODEL).items)


# The API server's wording for schema errors; CEL rules carry our own messages verbatim.
SCHEMA_PHRASES = {
    "negative-replicas": "should be greater than or equal to 0",
    "decode-no-accelerator": "should be greater than or equal to 1",
    "unknown-field": ".spec.kvTransfer.leaseSecond: field not declared in schema",
    "wrong-type": ".spec.prefill.replicas: expected numeric",
    "bad-mode": 'Unsupported value: "Sideways"',
    "bad-block-size": "Unsupported value: 100",
    "bad-quantity": "spec.prefill.resources.requests.memory",
    "bad-source": "spec.model.source.uri",
    "port-out-of-range": "should be greater than or equal to 1024",
    "vllm-version-unknown": 'Unsupported value: "0.30.0"',
    "node-selector-bad-value": "spec.decode.nodeSelector.zone in body should match",
    "priority-class-not-a-name": "spec.prefill.priorityClassName in body should match",
    "scheduler-not-a-name": "spec.decode.schedulerName in body should match",
    "image-with-space": "spec.engine.image in body should match",
    "autoscaling-without-metrics": "spec.decode.autoscaling.metrics in body should have at least 1 items",
}


@pytest.mark.parametrize(("case", "patch", "path", "phrase"), INVALID, ids=[c[0] for c in INVALID])
def test_admission_refuses_invalid_manifests(crd_installed, cluster, namespace, tmp_path: Path,
                                             case: str, patch: dict, path: str, phrase: str) -> None:
    manifest = {"apiVersion": f"{GROUP}/{VERSION}", "kind": contract.KIND, "metadata": {"name": "bad", "namespace": namespace},
                "spec": merge({"model": {"name": "m"}}, patch)}  # fmt: skip
    file = tmp_path / "bad.yaml"
    file.write_text(yaml.safe_dump(manifest))
    result = cluster.kubectl("apply", "--server-side", "-f", str(file), check=False)
    assert result.returncode != 0, f"{case} was admitted"
    expected = SCHEMA_PHRASES.get(case, phrase)
    assert expected in result.stderr, result.stderr
    if case not in SCHEMA_PHRASES:  # a CEL rule: reported at our field path
        assert path in result.stderr, result.stderr


@pytest.mark.parametrize(("case", "patch"), VALID_EDGES, ids=[c[0] for c in VALID_EDGES])
def test_admission_accepts_valid_edge_cases(crd_installed, cluster, namespace, tmp_path: Path, case: str, patch: dict) -> None:
    manifest = {"apiVersion": f"{GROUP}/{VERSION}", "kind": contract.KIND, "metadata": {"name": "edge", "namespace": namespace},
                "spec": merge({"model": {"name": "m"}}, patch)}  # fmt: skip
    file = tmp_path / "edge.yaml"
    file.write_text(yaml.safe_dump(manifest))
    result = cluster.kubectl("apply", "--server-side", "--dry-run=server", "-f", str(file), check=False)
    assert result.returncode == 0, result.stderr


def test_unsatisfiable_spec_reports_capacity_and_disturbs_nothing(operator, api_client, custom, namespace) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("fits"))
    wait_ready(custom, namespace, "fits")
    apps = client.AppsV1Api(api_client)

    def fits_deployments() -> dict[str, tuple[str, int]]:
        return {d.metadata.name: (d.metadata.uid, d.metadata.generation)
                for d in apps.list_namespaced_deployment(namespace, label_selector=f"{contract.LABEL_MODEL}=fits").items}

    before = fits_deployments()
    too_big = {"prefill": {"efa": {"count": 32}}, "decode": {"efa": {"count": 32}}}  # p5en has 16
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("huge", too_big))

    def capacity() -> dict | None:
        ready = condition(get_model(custom, namespace, "huge"), "Ready")
        return ready if ready.get("reason") == "InsufficientEFADevices" else None

    ready = wait_for("capacity condition", capacity)
    assert ready["status"] == "False" and "vpc.amazonaws.com/efa" in ready["message"]
    assert operator.alive()
    assert condition(get_model(custom, namespace, "fits"), "Ready")["status"] == "True"
    assert fits_deployments() == before, "the other model's workloads were not touched"


# The resume pass and, with nothing else changing, passes of resync periods (15 s in the e2e) after it.
PASSES_AFTER_RESTART = 3


def _operator_writes(cluster, since: str) -> list[dict]:
    return [
        e for e in cluster.audit_events()
        if e.get("verb") in WRITE_VERBS and e.get("stage") == "ResponseComplete"
        and (e.get("user") or {}).get("username") == OPERATOR_USER
        and e.get("requestReceivedTimestamp", "") > since
    ]  # fmt: skip


def test_restart_and_steady_state_make_no_writes(operator, cluster, api_client, custom, namespace) -> None:
    if not cluster.audit_log:
        pytest.fail("this test counts writes in the API server's audit log: set DISAGG_AUDIT_LOG", pytrace=False)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("steady"))
    wait_ready(custom, namespace, "steady")
    apps = client.AppsV1Api(api_client)

    def children() -> dict[str, tuple[str, str]]:
        return {d.metadata.name: (d.metadata.uid, d.metadata.resource_version) for d in apps.list_namespaced_deployment(namespace).items}

    def settled() -> tuple[dict[str, tuple[str, str]], dict] | None:
        """Trailing events (pods turning Ready, Deployment status) settled: a whole pass of the model ran, with
        nothing queued after it, and neither the Deployments nor the model's status changed across it. The pass
        is one the test asks for (an annotation of its own on the model: an event, which the operator answers
        with a pass and no write), so it comes whether or not a trailing event is still on its way."""
        uids, model = children(), get_model(custom, namespace, "steady")
        passes = model_passes(operator.metrics_port, namespace, "steady")
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "steady",
                                              {"metadata": {"annotations": {"e2e.disagg.dev/settled": str(passes)}}})  # fmt: skip
        wait_for("a pass of the model, then an idle queue", lambda: model_passes(operator.metrics_port, namespace, "steady") > passes
                 and idle(operator.metrics_port), 60, retry_on=(OSError,))  # fmt: skip
        now = get_model(custom, namespace, "steady")
        same = children() == uids and now.get("status") == model.get("status")
        return (uids, now) if same else None

    uids, before = wait_for("the model and its children settled", settled, 120)
    # to the microsecond, as the audit log stamps requests: a write of the settled pass in the same second is not this one's
    mark = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    operator.stop()
    operator.start()
    # Resume handlers, child events, and would-be resync periods: PASSES_AFTER_RESTART whole passes of the model by
    # the new process (its counters start at 0), nothing queued or running after the last.
    wait_for(f"{PASSES_AFTER_RESTART} passes of the model after the restart", lambda: model_passes(operator.metrics_port, namespace, "steady")
             >= PASSES_AFTER_RESTART and idle(operator.metrics_port), 120, retry_on=(OSError,))  # fmt: skip
    assert operator.alive()
    after = children()
    assert after == uids, "no child recreated or rewritten"
    now = get_model(custom, namespace, "steady")
    assert now["status"] == before["status"]
    writes = [e for e in _operator_writes(cluster, mark) if (e.get("objectRef") or {}).get("namespace") == namespace]
    assert writes == [], [(e["verb"], e["objectRef"], e.get("requestObject"), e["requestReceivedTimestamp"]) for e in writes]
