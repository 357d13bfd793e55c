"""A failed fabric preflight on the local control plane: kwok plays the kubelet that reports it, as a real one
does (tests/integration/containers/test_real_node.py runs the rendered preflight from an image under a kubelet):
the init container in restart back-off, its failure in its last state, the message with the file's newline.

hack/kwok/stages.yaml has a stage, pod-preflight-failed, for pods annotated
``disagg.dev/simulate-preflight-failure: "<Reason>: <text>"`` (the preflight's own termination-message
format): their ``preflight`` init container is in back-off after exit code 1 with that message, and the pod
stays Pending and not Ready, as under a kubelet whose preflight fails. Every other pod is untouched
(pod-ready skips only the annotated ones).

The test injects the fault the way a person would: the annotation goes onto the prefill Deployment's pod
template with a field manager of its own, so the pods made from then on fail their preflight. The
DisaggregatedModel must then report ``FabricReady=False`` with the preflight's reason and text, and
``Ready=False`` with the same reason once no good prefill pod is left, while the operator lives on and
leaves the annotation alone: it owns other fields of the Deployment and applies only when those drift.

kwok reads its stages once, at start: after a change of hack/kwok/stages.yaml, restart kwok (stop its
process; ``hack/cluster.sh up`` starts what is not running). ``kwok_fails_annotated_preflight`` checks
first, on two bare pods, that the running kwok has the stage, and says so when it has not.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime, timezone
from typing import Any, Callable

import pytest
from kubernetes import client

from disagg_connector import contract
from disagg_connector.contract.preflight import REASONS, format_termination_message, parse_termination_message

from tests.fixtures.models import REPO, load_example
from tests.fixtures.e2e.operator import OPERATOR_USER
from tests.fixtures.e2e.waiting import condition, pod_ready, wait_for

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
MINIMAL = load_example(REPO / "examples" / "minimal.yaml")
ANNOTATION = f"{contract.API_GROUP}/simulate-preflight-failure"
FAULT_MANAGER = "e2e-fault-injector"
REASON = "EfaDevicesMissing"
TEXT = "expected 2 EFA devices (vpc.amazonaws.com/efa) under /dev/infiniband, found 0"
STALE_KWOK = (
    "the running kwok does not have the pod-preflight-failed stage of hack/kwok/stages.yaml "
    "(kwok reads its stages only at start): restart kwok, e.g. "
    "`kill $(cat ${DISAGG_STATE:-$HOME/.cache/disagg-operator/cluster}/pids/kwok.pid) && hack/cluster.sh up`"
)


def preflight_status(pod: Any) -> Any:
    return next((s for s in pod.status.init_container_statuses or [] if s.name == "preflight"), None)


def bare_pod(name: str, annotations: dict[str, str] | None = None) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations=annotations),
        spec=client.V1PodSpec(
            init_containers=[client.V1Container(name="preflight", image="disagg-preflight:e2e"),
                             client.V1Container(name="after", image="busybox")],
            containers=[client.V1Container(name="vllm", image="vllm:e2e")],
        ),
    )  # fmt: skip


def check_kwok_stage(api_client, namespace: str) -> None:
    """The stage itself, on bare pods: the annotated one fails its preflight, the others turn Ready."""
    core = client.CoreV1Api(api_client)
    message = format_termination_message("NixlBackendUnavailable", "LIBFABRIC backend: fi_getinfo failed (probe)")
    core.create_namespaced_pod(namespace, bare_pod("probe-failing", {ANNOTATION: message}))
    core.create_namespaced_pod(namespace, bare_pod("probe-default"))

    def settled() -> tuple[Any, Any] | None:
        bad, good = (core.read_namespaced_pod(n, namespace) for n in ("probe-failing", "probe-default"))
        if pod_ready(bad):
            pytest.fail(STALE_KWOK, pytrace=False)
        return (bad, good) if preflight_status(bad) and pod_ready(good) else None

    bad, good = wait_for("kwok to act on the probe pods", settled, timeout=60)
    # as a real kubelet shows it between restarts: back-off, the failure in the last state, the file's newline kept
    failing = preflight_status(bad)
    assert failing.state.waiting is not None and failing.state.waiting.reason == "CrashLoopBackOff", failing
    state = failing.last_state.terminated
    assert state is not None and state.exit_code == 1 and state.message == message + "\n", failing
    assert failing.restart_count == 1, failing
    assert parse_termination_message(state.message) == ("NixlBackendUnavailable", "LIBFABRIC backend: fi_getinfo failed (probe)")
    assert bad.status.phase == "Pending" and bad.status.pod_ip, bad.status
    initialized = next(c for c in bad.status.conditions if c.type == "Initialized")
    assert initialized.status == "False"
    after = next(s for s in bad.status.init_container_statuses if s.name == "after")
    assert after.state.waiting is not None, after  # init containers after a failed one never run
    assert all(s.state.waiting is not None for s in bad.status.container_statuses), bad.status.container_statuses
    # the default stages are untouched for everyone else
    assert good.status.phase == "Running" and good.status.pod_ip
    ok = preflight_status(good).state.terminated
    assert ok is not None and ok.exit_code == 0
    # the stage applies once: the failed pod is not rewritten again and again (nor made Ready later)
    version = bad.metadata.resource_version
    marker = core.create_namespaced_pod(namespace, bare_pod("probe-later"))
    wait_for("a later pod Ready", lambda: pod_ready(core.read_namespaced_pod(marker.metadata.name, namespace)), timeout=60)
    again = core.read_namespaced_pod("probe-failing", namespace)
    assert again.metadata.resource_version == version and not pod_ready(again)
    for n in ("probe-failing", "probe-default", "probe-later"):
        core.delete_namespaced_pod(n, namespace)


@pytest.fixture
def kwok_fails_annotated_preflight(cluster, api_client, namespace) -> None:
    """The model test needs the stage: fail early, and say what to do, when the running kwok lacks it."""
    check_kwok_stage(api_client, namespace)


def test_kwok_stage_fails_only_annotated_preflights(cluster, api_client, namespace) -> None:
    check_kwok_stage(api_client, namespace)


def _audit_writes(cluster, user: str, namespace: str, name: str, since: str) -> list[dict]:
    return [
        e for e in cluster.audit_events()
        if e.get("stage") == "ResponseComplete" and e.get("verb") in {"create", "update", "patch", "delete"}
        and (e.get("user") or {}).get("username") == user and e.get("requestReceivedTimestamp", "") > since
        and (e.get("objectRef") or {}).get("resource") == "deployments"
        and (e.get("objectRef") or {}).get("namespace") == namespace and (e.get("objectRef") or {}).get("name") == name
    ]  # fmt: skip


def test_failed_preflight_becomes_fabric_and_ready_condition(
    kwok_fails_annotated_preflight, operator, cluster, api_client, namespace
) -> None:
    assert REASON in REASONS
    custom, apps, core = client.CustomObjectsApi(api_client), client.AppsV1Api(api_client), client.CoreV1Api(api_client)
    name = "fabric"
    manifest = copy.deepcopy(MINIMAL)
    manifest["metadata"] = {"name": name}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)

    def get() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def settled(pred: Callable[[dict[str, Any]], bool]) -> Callable[[], dict[str, Any] | None]:
        def check() -> dict[str, Any] | None:
            obj = get()
            current = (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
            return obj if current and pred(obj) else None

        return check

    obj = wait_for("Ready with a passed preflight", settled(lambda o: condition(o, "Ready").get("status") == "True"
                                                            and condition(o, "FabricReady").get("status") == "True"))
    assert condition(obj, "FabricReady")["reason"] == "PreflightPassed"
    revision = obj["status"]["revision"]
    deployment = contract.engine_deployment_name(name, "prefill", revision)
    good_pods = {p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_MODEL}={name},{contract.LABEL_ROLE}=prefill").items}

    # --- the fault: new prefill pods fail their preflight ---------------------------------------------
    message = format_termination_message(REASON, TEXT)
    mark = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # the audit log's format
    patch = {"spec": {"template": {"metadata": {"annotations": {ANNOTATION: message}}}}}
    cluster.kubectl("patch", "deployment", deployment, "-n", namespace, "--type=merge",
                    f"--field-manager={FAULT_MANAGER}", "-p", json.dumps(patch))  # fmt: skip

    def fabric_failed(o: dict[str, Any]) -> bool:
        c = condition(o, "FabricReady")
        return c.get("status") == "False" and c.get("reason") == REASON

    obj = wait_for("FabricReady=False from the failing preflight", settled(fabric_failed))
    fabric = condition(obj, "FabricReady")
    assert TEXT in fabric["message"], fabric
    degraded = condition(obj, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == REASON and TEXT in degraded["message"], degraded
    # the old prefill pod still serves (maxUnavailable 0), so Ready may still be True here
    failing = [p for p in core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_MODEL}={name},{contract.LABEL_ROLE}=prefill").items
               if p.metadata.name not in good_pods]  # fmt: skip
    assert failing and all(not pod_ready(p) and p.metadata.annotations.get(ANNOTATION) == message for p in failing)
    assert all(p.metadata.labels[contract.LABEL_REVISION] == revision for p in failing), "same revision, new pod template"

    # --- no good prefill left: remove the ReplicaSet of the template without the fault ----------------
    for rs in apps.list_namespaced_replica_set(namespace, label_selector=f"{contract.LABEL_MODEL}={name},{contract.LABEL_ROLE}=prefill").items:
        if ANNOTATION not in (rs.spec.template.metadata.annotations or {}):
            apps.delete_namespaced_replica_set(rs.metadata.name, namespace, propagation_policy="Background")

    def not_ready(o: dict[str, Any]) -> bool:
        c = condition(o, "Ready")
        return c.get("status") == "False" and c.get("reason") == REASON and fabric_failed(o)

    obj = wait_for("Ready=False with the preflight's reason", settled(not_ready))
    ready = condition(obj, "Ready")
    assert TEXT in ready["message"], ready
    assert obj["status"]["prefill"]["readyReplicas"] == 0
    assert operator.alive(), operator.log()[-3000:]

    # --- the operator leaves the annotation alone --------------------------------------------------------
    live = apps.read_namespaced_deployment(deployment, namespace)
    assert live.spec.template.metadata.annotations.get(ANNOTATION) == message, "the operator reverted the annotation"
    owners = {m.manager for m in live.metadata.managed_fields or [] if ANNOTATION in json.dumps(m.fields_v1 or {})}
    assert owners == {FAULT_MANAGER}, owners
    if cluster.audit_log:
        writes = _audit_writes(cluster, OPERATOR_USER, namespace, deployment, mark)
        assert writes == [], [(e["verb"], e["requestReceivedTimestamp"]) for e in writes]

    # A change of a field the operator owns (replicas) makes it apply the Deployment: still kept.
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"prefill": {"replicas": 2}}})
    wait_for("the operator to apply 2 prefill replicas",
             lambda: apps.read_namespaced_deployment(deployment, namespace).spec.replicas == 2)  # fmt: skip
    if cluster.audit_log:
        assert _audit_writes(cluster, OPERATOR_USER, namespace, deployment, mark), "the operator applied the Deployment"
    live = apps.read_namespaced_deployment(deployment, namespace)
    assert live.spec.template.metadata.annotations.get(ANNOTATION) == message, "the operator's apply dropped the annotation"

    def both_failing(o: dict[str, Any]) -> bool:
        return not_ready(o) and o["status"]["prefill"]["updatedReplicas"] == 2

    obj = wait_for("two failing prefill pods, still Ready=False", settled(both_failing))
    assert obj["status"]["prefill"]["readyReplicas"] == 0 and obj["status"]["revision"] == revision
    assert operator.alive(), operator.log()[-3000:]
