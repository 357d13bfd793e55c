"""What Argo CD and Flux make of the statuses the operator really writes, on the real API server.

One model's life is recorded at every watch event of the DisaggregatedModel: created, an image change rolled
out to the end, a child the API server refuses, and (on a CRD without its CEL rules, as an older CRD would
be) a spec the operator itself finds invalid. Every recorded object is then judged by the chart's Argo CD
health.lua (in a real Lua 5.1, as Argo CD runs it) and by the real kstatus library (Flux, kubectl-style
waits). The oracle is the test's own timeline and the pod counts in status, not the conditions the script
reads: during a rollout Progressing, Healthy once the new revision alone serves, Degraded with the reason.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import urllib3
import yaml
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from disagg_connector import contract
from disagg_operator.api.crd import CRD_FILE
from disagg_operator.api.validation import parse
from disagg_operator.changeplan import change_plan
from disagg_operator.config import RenderDefaults

from tests.fixtures.models import REPO
from tests.fixtures.gitops import argocd_health, kstatus
from tests.fixtures.e2e.models import model_manifest
from tests.fixtures.e2e.models import create_rolled_out, get_model, pods_of
from tests.fixtures.e2e.waiting import condition, wait_for

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
NAME = "health"
REPLICAS = {"prefill": {"replicas": 2}, "decode": {"replicas": 2}}
NEW_IMAGE = {"engine": {"image": "registry.example/vllm-runtime:0.33.0-patched"}}
REFUSED = {"decode": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}}}
# Push cannot do bidirectional KV reuse: admission refuses it, so only a CRD without its rules lets it in.
INVALID = {"kvTransfer": {"mode": "Push", "bidirectional": True}}


# The scenario's phases are the model's generations: each step of the test is one spec change.
PHASES = {"create": 1, "rollout": 2, "refused": 3}


class ModelRecorder:
    """Every version of one DisaggregatedModel the watch delivers."""

    def __init__(self, api_client, namespace: str, name: str):
        self.events: list[dict[str, Any]] = []
        self._custom = client.CustomObjectsApi(api_client)
        self._watch = watch.Watch()
        self._args = (GROUP, VERSION, namespace, PLURAL)
        self._selector = f"metadata.name={name}"
        self._stopped = False
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(30)

    def _run(self) -> None:
        listed = self._custom.list_namespaced_custom_object(*self._args, field_selector=self._selector)
        self._started.set()
        stream = self._watch.stream(self._custom.list_namespaced_custom_object, *self._args, field_selector=self._selector,
                                    resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=600)  # fmt: skip
        try:
            for event in stream:
                if event["type"] in ("ADDED", "MODIFIED"):
                    self.events.append(copy.deepcopy(event["object"]))
        except urllib3.exceptions.ProtocolError:
            if not self._stopped:
                raise

    def caught_up(self, obj: dict[str, Any]) -> bool:
        """The watch has delivered this version of the object (or a later one)."""
        return any(o["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"] for o in self.events)

    def of(self, phase: str) -> list[dict[str, Any]]:
        return [o for o in self.events if o["metadata"]["generation"] == PHASES[phase]]

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()
        self._thread.join(timeout=10)


def old_pods_remain(obj: dict[str, Any]) -> bool:
    """Pods of another revision still count in status (replicas: every revision; updated: the current one)."""
    status = obj.get("status") or {}
    return any((status.get(r) or {}).get("replicas", 0) > (status.get(r) or {}).get("updatedReplicas", 0)
               for r in contract.ENGINE_ROLES)  # fmt: skip


def judged(obj: dict[str, Any]) -> bool:
    return (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]


def without_cel_rules(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: without_cel_rules(v) for k, v in node.items() if k != "x-kubernetes-validations"}
    if isinstance(node, list):
        return [without_cel_rules(v) for v in node]
    return node


@dataclass(frozen=True)
class Life:
    recorder: ModelRecorder
    first_revision: str
    invalid: dict[str, Any]


def record_a_life(api, namespace: str) -> tuple[ModelRecorder, str]:
    """Create the model, roll out an image change to the end, then have a child refused; every status seen."""
    custom = client.CustomObjectsApi(api)
    recorder = ModelRecorder(api, namespace, NAME)
    try:
        # The first revision all the way out (Progressing Complete), not only Ready (which one pair makes): the create
        # phase ends Healthy before the rollout's spec comes, and the watch has seen it.
        first = create_rolled_out(custom, namespace, model_manifest(NAME, REPLICAS), 180)
        old = first["status"]["revision"]
        wait_for("the watch to catch up", lambda: recorder.caught_up(first))
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME, {"spec": NEW_IMAGE})

        def rolled_out() -> dict[str, Any] | None:
            obj = get_model(custom, namespace, NAME)
            pods = [p for r in contract.ENGINE_ROLES for p in pods_of(api, namespace, NAME, r)]
            done = judged(obj) and obj["status"]["revision"] != old and not old_pods_remain(obj) \
                and not [p for p in pods if p.metadata.labels[contract.LABEL_REVISION] == old] \
                and condition(obj, "Ready").get("status") == "True" and condition(obj, "Progressing").get("status") == "False"
            return obj if done else None

        wait_for("the rollout to finish", rolled_out, 180)
        wait_for("the watch to catch up", lambda: recorder.caught_up(get_model(custom, namespace, NAME)))
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME, {"spec": REFUSED})
        wait_for("ChildRejected", lambda: judged(o := get_model(custom, namespace, NAME))
                 and condition(o, "Ready").get("reason") == "ChildRejected" and recorder.caught_up(o))
    finally:
        recorder.stop()
    return recorder, old


def invalid_spec_status(cluster, api, namespace: str, workdir) -> dict[str, Any]:
    """An older CRD (no CEL rules) lets in a spec the operator refuses itself: status InvalidSpec. The real
    CRD is back before this returns."""
    custom = client.CustomObjectsApi(api)
    crds = [d for d in yaml.safe_load_all((REPO / "crds" / CRD_FILE).read_text()) if d]
    relaxed = workdir / "relaxed.yaml"
    relaxed.write_text(yaml.safe_dump_all([without_cel_rules(d) for d in crds]))
    try:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(relaxed))
        wait_for("the relaxed CRD to admit the spec", lambda: custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, model_manifest("invalid", INVALID)), 60)  # fmt: skip
        return wait_for("InvalidSpec", lambda: judged(o := get_model(custom, namespace, "invalid"))
                        and condition(o, "Ready").get("reason") == "InvalidSpec" and o)
    finally:
        try:
            custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "invalid")
        except ApiException as error:
            if error.status != 404:
                raise
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds" / CRD_FILE))


@pytest.fixture(scope="module")
def life(cluster, operator, tmp_path_factory) -> Iterator[Life]:
    """Runs the scenario once; the tests below judge what it recorded."""
    api = cluster.api_client()
    core = client.CoreV1Api(api)
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        wait_for("default ServiceAccount", lambda: core.read_namespaced_service_account("default", namespace), 30)
        recorder, old = record_a_life(api, namespace)
        yield Life(recorder, old, invalid_spec_status(cluster, api, namespace, tmp_path_factory.mktemp("crd")))
    finally:
        core.delete_namespace(namespace, propagation_policy="Background")


def test_argo_cd_sees_progressing_then_healthy_at_create_and_rollout(life: Life) -> None:
    """Progressing first, Healthy last, nothing else; Progressing wherever the status is not of this spec, old
    pods still count, or Ready is not True. (The status of the pass that deletes the old Deployments leaves
    their pods out before they go; a pass in between counts them again, so Healthy can come twice.)"""
    for phase in ("create", "rollout"):
        objs = life.recorder.of(phase)
        verdicts = [argocd_health(o) for o in objs]
        seen = [(v.status, v.message) for v in verdicts]
        assert {v.status for v in verdicts} == {"Progressing", "Healthy"}, (phase, seen)
        assert verdicts[0].status == "Progressing" and verdicts[-1].status == "Healthy", (phase, seen)
        for obj, verdict in zip(objs, verdicts):
            if not judged(obj) or old_pods_remain(obj) or condition(obj, "Ready").get("status") != "True":
                assert verdict.status == "Progressing", (phase, obj.get("status"), verdict)
    rollout = life.recorder.of("rollout")
    assert any(judged(o) and old_pods_remain(o) for o in rollout), "the rollout was recorded while both revisions ran"
    assert rollout[-1]["status"]["revision"] != life.first_revision


def test_argo_cd_says_degraded_with_the_reason(life: Life) -> None:
    refused = life.recorder.of("refused")
    verdicts = [argocd_health(o) for o in refused]
    assert verdicts[-1].status == "Degraded" and {v.status for v in verdicts} <= {"Progressing", "Degraded"}, verdicts
    assert verdicts[-1].message.startswith("ChildRejected: nothing was changed: Deployment health-decode-"), verdicts[-1]
    assert "nodeSelectorTerms" in verdicts[-1].message
    invalid = argocd_health(life.invalid)
    assert invalid.status == "Degraded" and invalid.message.startswith("InvalidSpec: spec."), invalid
    assert "bidirectional" in invalid.message


def test_the_rollout_peaks_where_disagg_operator_plan_said(life: Life) -> None:
    """`disagg-operator plan`'s peak pods per role for this image change is what the operator reached (pods
    of every revision that are not terminating, as status counts them)."""
    before, after = (parse(model_manifest(NAME, REPLICAS)), parse(model_manifest(NAME, {**REPLICAS, **NEW_IMAGE})))
    planned = change_plan(before, after, RenderDefaults())
    seen = {r: max((o.get("status") or {}).get(r, {}).get("replicas", 0) for o in life.recorder.of("rollout"))
            for r in contract.ENGINE_ROLES}  # fmt: skip
    assert seen == planned.peak_pods, (seen, planned.peak_pods)
    assert life.recorder.of("rollout")[-1]["status"]["revision"] == planned.new_revision


def test_kstatus_reads_create_and_rollout(life: Life) -> None:
    """InProgress while the status is not of this spec or Ready is not True, Current at the end."""
    for phase in ("create", "rollout"):
        objs = [o for o in life.recorder.of(phase) if o.get("status")]
        verdicts = kstatus(objs)
        assert verdicts[-1].status == "Current", (phase, verdicts[-1])
        for obj, verdict in zip(objs, verdicts):
            if not judged(obj) or condition(obj, "Ready").get("status") != "True":
                assert verdict.status == "InProgress", (phase, obj.get("status"), verdict)


def test_kstatus_reads_in_progress_while_the_old_revision_serves(life: Life) -> None:
    """No stale Current during a rollout: while the old revision still runs, the rollout is not done."""
    rolling = [o for o in life.recorder.of("rollout") if judged(o) and condition(o, "Ready").get("status") == "True"
               and (old_pods_remain(o) or condition(o, "Progressing").get("status") == "True")]  # fmt: skip
    assert rolling, "the rollout was recorded while the old revision ran"
    early = [(o["status"], v) for o, v in zip(rolling, kstatus(rolling)) if v.status != "InProgress"]
    assert not early, f"Current for {len(early)} of {len(rolling)} statuses written while the old revision ran: {early[0]}"


def test_kstatus_reads_in_progress_before_the_operator_writes_status(life: Life) -> None:
    """The API server drops status on create; the CRD's default makes the first object the watch
    delivers one the operator has not judged (observedGeneration 0, the schema's other defaults, no
    conditions)."""
    created = life.recorder.of("create")[0]
    status = created.get("status") or {}
    assert status.get("observedGeneration") == 0 and not status.get("conditions"), status
    assert kstatus([created])[0].status == "InProgress"


def test_kstatus_reads_failed_where_no_pass_can_progress(life: Life) -> None:
    refused, invalid = life.recorder.of("refused")[-1], life.invalid
    assert (condition(refused, "Ready").get("reason"), condition(invalid, "Ready").get("reason")) == ("ChildRejected", "InvalidSpec")
    assert [v.status for v in kstatus([refused, invalid])] == ["Failed", "Failed"]
    assert condition(refused, "Stalled").get("reason") == "ChildRejected"


def test_plan_from_cluster_reads_the_live_model(cluster, crd_installed, namespace, tmp_path) -> None:
    """`disagg-operator plan --from-cluster` against the real API server: the live spec (defaulted by the
    CRD, with server metadata and status) is the current state; a model not there yet is a first create."""
    custom = client.CustomObjectsApi(cluster.api_client())
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(NAME, REPLICAS))
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump(model_manifest(NAME, {**REPLICAS, **NEW_IMAGE})))

    def plan() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "disagg_operator.cli", "plan", "-f", str(new), "-n", namespace,
                               "--from-cluster", "-o", "json"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "KUBECONFIG": cluster.kubeconfig})  # fmt: skip

    result = plan()
    assert result.returncode == 0, result.stderr
    planned = json.loads(result.stdout)
    expected = change_plan(parse(model_manifest(NAME, REPLICAS)), parse(model_manifest(NAME, {**REPLICAS, **NEW_IMAGE})),
                           RenderDefaults())  # fmt: skip
    assert (planned["current_revision"], planned["new_revision"]) == (expected.current_revision, expected.new_revision)
    assert [c["path"] for c in planned["changes"]] == ["spec.engine.image"] and planned["peak_pods"] == expected.peak_pods

    new.write_text(yaml.safe_dump(model_manifest("not-there-yet")))
    result = plan()
    assert result.returncode == 0 and json.loads(result.stdout)["create"] is True, result.stderr
    assert f"{namespace}/not-there-yet does not exist in the cluster: planning a first create" in result.stderr
