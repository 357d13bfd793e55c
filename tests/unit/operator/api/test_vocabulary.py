"""One vocabulary: every reason the operator and the data plane can write is declared once
(operator/disagg_operator/api/vocabulary.py), and what generic readers act on agrees with it: the Argo CD
health script's transient set, kstatus's Stalled set, the data plane's own reason lists, docs/reasons.md."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from disagg_connector.contract import preflight
from disagg_connector.contract.health import KVReason
from disagg_operator import status as status_mod
from disagg_operator.api import vocabulary

from tests.fixtures.models import REPO

CAMEL = re.compile(r"^[A-Z][a-z]+(?:[A-Z0-9][a-z0-9]*)+$|^[A-Z][a-z]{3,}$")
# Modules that write reasons into conditions (or make the ones the operator copies into them).
WRITERS = [
    REPO / "operator/disagg_operator/status.py", REPO / "operator/disagg_operator/planner.py",
    REPO / "operator/disagg_operator/executor.py", REPO / "operator/disagg_operator/reconcile.py",
    REPO / "connector/disagg_connector/contract/preflight.py", REPO / "connector/disagg_connector/contract/health.py",
    REPO / "operator/disagg_operator/events.py",
]  # fmt: skip
# CamelCase strings of those modules that are not reasons: API kinds, field values, condition types.
NOT_REASONS = {
    "Deployment", "Pod", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget", "NetworkPolicy",
    "HorizontalPodAutoscaler", "Unknown", "True", "False", "Push", "Pull", "API", "CrashLoopBackOff",
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "PodScheduled", "ReplicaFailure", "Invalid", "Pending",
    "Progressing", "Degraded", "FallbackToLogsOnError", "Error", "GPUs", "Normal", "Warning", "Drain", "Retire",
    "Scale", "Delete", "Plan", "Rollout", "Apply", "Status",
    "SchedulerError", "PersistentVolumeClaim",  # kube-scheduler's PodScheduled reason (read, not written); a kind
    "Active",  # spec.autoscaling.mode
}  # fmt: skip


def _strings(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and CAMEL.match(node.value)}  # fmt: skip


def test_every_reason_written_is_declared() -> None:
    declared = set(vocabulary.BY_NAME) | set(vocabulary.CONDITION_TYPES) | set(vocabulary.EVENT_REASONS)
    for path in WRITERS:
        unknown = _strings(path) - declared - NOT_REASONS
        assert not unknown, f"{path.relative_to(REPO)} writes reasons the vocabulary does not declare: {sorted(unknown)}"


def test_the_data_planes_reasons_are_declared_with_their_condition() -> None:
    for reason in preflight.REASONS:
        assert vocabulary.FABRIC_READY in vocabulary.BY_NAME[reason].conditions, reason
    verdicts = set(KVReason)  # the verdicts' reasons, declared where they are made
    assert verdicts >= {"TransfersFailing", "DeadlinesHit", "ProtocolMismatch", "TransfersSucceeding", "NoTrafficYet"}, verdicts
    for reason in verdicts:
        assert vocabulary.KV_TRANSFER_HEALTHY in vocabulary.BY_NAME[reason].conditions, reason


def test_kstatus_stalled_and_retried_sets_come_from_the_vocabulary() -> None:
    assert set(status_mod.STALLED_REASONS) == {"InvalidSpec", "ChildRejected", "OwnershipConflict", "Forbidden",
                                               "QuotaExceeded", "PodCreationFailed", "KindNotInstalled"}  # fmt: skip
    assert set(status_mod.RETRIED_REASONS) == {"ApiUnavailable", "Conflict", "ApplyFailed"}


def test_the_conditions_a_status_carries_are_declared_in_the_vocabularys_order() -> None:
    """What the status writes on a serving model, not the name status.CONDITION_TYPES is bound to: every type
    declared, in the vocabulary's order, the generic readers' two among them."""
    from disagg_operator.sizing import targets
    from tests.fixtures.world import desired, steady

    world = desired()
    observed = steady(world)
    types = [c["type"] for c in status_mod.compute(world, observed, targets(world, observed), "t1")["conditions"]]
    assert types == [t for t in vocabulary.CONDITION_TYPES if t in types], types
    assert {"Ready", "Progressing", "Degraded", "Reconciling", "Stalled"} <= set(types), types


def test_argo_cds_passing_reasons_are_the_transient_ready_reasons() -> None:
    lua = (REPO / "charts/disagg-operator/files/argocd-health.lua").read_text()
    table = re.search(r"local passing = \{(.*?)\n\}", lua, re.S)
    assert table, "the script's passing table"
    passing = set(re.findall(r"^\s*(\w+) = true", table.group(1), re.M))
    assert passing == set(vocabulary.of_class("transient", vocabulary.READY)), passing


def test_docs_reasons_table_is_generated_from_the_vocabulary() -> None:
    path = REPO / "docs/reasons.md"
    text = path.read_text()
    start = text.index("<!-- generated: vocabulary.markdown_table -->\n") + len("<!-- generated: vocabulary.markdown_table -->\n")
    end = text.index("<!-- end generated -->")
    if os.environ.get("DISAGG_UPDATE_GOLDEN") == "1":
        text = text[:start] + vocabulary.markdown_table() + text[end:]
        path.write_text(text)
        end = text.index("<!-- end generated -->")
    assert text[start:end] == vocabulary.markdown_table(), "docs/reasons.md is stale: regenerate with DISAGG_UPDATE_GOLDEN=1"


def test_crd_names_every_condition_type() -> None:
    from disagg_operator.api.crd import build_crd

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    description = schema["properties"]["status"]["properties"]["conditions"]["description"]
    assert all(t in description for t in vocabulary.CONDITION_TYPES), description


def test_an_events_type_comes_from_its_reason() -> None:
    assert {r: vocabulary.event_type(r) for r in ("Ready", "RolloutStarted", "PodRetired", "Scaled")} == dict.fromkeys(
        ("Ready", "RolloutStarted", "PodRetired", "Scaled"), "Normal")
    for reason in ("DrainTimedOut", "ChildRejected", "Conflict", "CrashLoop", "TransfersFailing", "RouterUnreachable",
                   "SomethingUndeclared"):  # fmt: skip
        assert vocabulary.event_type(reason) == "Warning", reason
