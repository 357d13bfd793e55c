"""Day-2 status on the real API server: Ready means serving, and a size set by hand survives its role.

- A DisaggregatedRole scaled by hand and then deleted comes back at that size: no serving pod is drained or
  deleted for it (kubectl scale's promise, `status.<role>.targetReplicas`).
- A rollout that cannot finish (the new revision's decode fits no node: a bad change) leaves the old
  revision serving: Ready stays True and `kubectl wait --for=condition=Ready` passes, Progressing says what
  holds the rollout up; undoing the change brings the model back to its old revision, Complete.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client

from disagg_connector import contract

from tests.fixtures.e2e.models import model_manifest
from tests.fixtures.e2e.models import get_model, pods_of, wait_ready
from tests.fixtures.e2e.waiting import condition, pod_ready, wait_for

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL


def test_a_role_deleted_after_kubectl_scale_keeps_its_size(operator, cluster, api_client, namespace) -> None:
    custom = client.CustomObjectsApi(api_client)
    name = "keep"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name))
    wait_ready(custom, namespace, name)
    role = contract.role_scaler_name(name, "decode")
    cluster.kubectl("scale", f"{contract.ROLE_PLURAL}/{role}", "--replicas=3", "-n", namespace)
    wait_for("3 ready decodes", lambda: len([p for p in pods_of(api_client, namespace, name, "decode") if pod_ready(p)]) == 3, 120)
    wait_for("the target recorded", lambda: get_model(custom, namespace, name)["status"]["decode"].get("targetReplicas") == 3)
    before = {p.metadata.uid for p in pods_of(api_client, namespace, name, "decode")}
    old_uid = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, contract.ROLE_PLURAL, role)["metadata"]["uid"]

    cluster.kubectl("delete", f"{contract.ROLE_PLURAL}/{role}", "-n", namespace, "--wait=true")

    def recreated_with_status() -> dict[str, Any] | None:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, contract.ROLE_PLURAL, role)
        # Its status comes with the pass after the one that recreated it: by then any drain would be marked.
        return obj if obj["metadata"]["uid"] != old_uid and (obj.get("status") or {}).get("replicas") == 3 else None

    again = wait_for("the role recreated, its status written", recreated_with_status, 60)
    assert again["spec"]["replicas"] == 3, again["spec"]
    pods = pods_of(api_client, namespace, name, "decode")
    assert {p.metadata.uid for p in pods} == before, "no decode pod was replaced"
    assert not [p.metadata.name for p in pods if contract.ANNOTATION_DRAINING in (p.metadata.annotations or {})
                or p.metadata.deletion_timestamp], "no serving decode is drained"  # fmt: skip
    assert get_model(custom, namespace, name)["status"]["decode"]["targetReplicas"] == 3


def test_ready_stays_true_while_a_bad_rollout_cannot_finish(operator, cluster, api_client, namespace) -> None:
    custom = client.CustomObjectsApi(api_client)
    name = "held"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name))
    first = wait_ready(custom, namespace, name)["status"]["revision"]
    nowhere = {"spec": {"decode": {"nodeSelector": {"example.com/pool": "does-not-exist"}}}}
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, nowhere)

    def held_up() -> dict[str, Any] | None:
        obj = get_model(custom, namespace, name)
        status = obj.get("status") or {}
        progressing = condition(obj, "Progressing")
        judged = status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("revision") != first
        return obj if judged and progressing.get("status") == "True" and "Unschedulable" in progressing.get("message", "") else None

    obj = wait_for("the rollout held up by an unschedulable decode", held_up, 120)
    ready = condition(obj, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Ready"), ready
    assert condition(obj, "Progressing")["reason"] == "RolloutInProgress"
    assert condition(obj, "Stalled")["status"] == "False"
    waited = cluster.kubectl("wait", "--for=condition=Ready", f"{PLURAL}/{name}", "-n", namespace, "--timeout=30s", check=False)
    assert waited.returncode == 0, waited.stderr
    assert [p.metadata.labels[contract.LABEL_REVISION] for p in pods_of(api_client, namespace, name, "decode") if pod_ready(p)] == [first]

    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"decode": {"nodeSelector": None}}})

    def back() -> dict[str, Any] | None:
        obj = get_model(custom, namespace, name)
        status = obj.get("status") or {}
        done = (status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("revision") == first
                and condition(obj, "Progressing").get("reason") == "Complete")  # fmt: skip
        return obj if done else None

    obj = wait_for("back at the old revision, rolled out", back, 120)
    assert condition(obj, "Ready")["status"] == "True"
