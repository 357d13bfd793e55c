"""Reasons are constants, typed: the code names a condition type, a condition reason or an Event reason by an enum
member (vocabulary.ConditionType, Reason, EventReason; the data plane's own in its contract, PreflightReason and
KVReason), never by a bare string, and the members are exactly the strings on the wire as before."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from disagg_connector.contract.health import KVReason
from disagg_connector.contract.preflight import REASONS as PREFLIGHT_REASONS
from disagg_connector.contract.preflight import PreflightReason, format_termination_message, parse_termination_message
from disagg_operator import status as status_mod
from disagg_operator.api import vocabulary
from disagg_operator.api.vocabulary import ConditionType, EventReason, Reason

from tests.fixtures.models import REPO

PRODUCT = [*sorted((REPO / "operator/disagg_operator").rglob("*.py")), *sorted((REPO / "connector/disagg_connector").rglob("*.py"))]

# The strings on the wire before the names became enums: they must not change (alerts, dashboards, Argo CD and
# kstatus readers, and every status already stored match on them).
WIRE_REASONS = (
    "Ready ScaledToZero WaitingForPods RolloutInProgress Scaling Complete AsExpected ReducedCapacity InvalidSpec "
    "ChildRejected OwnershipConflict KindNotInstalled Forbidden QuotaExceeded PodCreationFailed Conflict ApiUnavailable "
    "ApplyFailed InternalError CrashLoop ImagePullFailed InsufficientGPUs InsufficientNeuronDevices InsufficientEFADevices "
    "InsufficientHugepages InsufficientCPU InsufficientMemory Unschedulable PreflightPassed NoPreflightYet PreflightFailed "
    "NixlImportFailed NixlBackendUnavailable EfaDevicesMissing AcceleratorsMissing HugepagesMissing SharedMemoryTooSmall "
    "PodGroups PodGroupsNotServed PodsOutsideGroups PartlyBound GroupUnschedulable TransfersSucceeding TransfersFailing DeadlinesHit ProtocolMismatch "
    "NoTransferCompleted NoTrafficYet NotCheckedYet NoRouterReady RouterStarting RouterUnreachable"
).split()
WIRE_EVENT_REASONS = ("RolloutStarted RolloutStep RolloutComplete Scaled PodDraining PodRetired DrainTimedOut RevisionRetired StreamsMigrated StreamsCut "
                      "AutoscalerRecommends AutoscalerScaled AutoscalerBlocked").split()
WIRE_CONDITION_TYPES = "Ready Progressing Degraded FabricReady KVTransferHealthy GangScheduled Reconciling Stalled".split()
WIRE_PREFLIGHT = "NixlImportFailed NixlBackendUnavailable EfaDevicesMissing AcceleratorsMissing HugepagesMissing SharedMemoryTooSmall".split()
WIRE_KV = "TransfersSucceeding TransfersFailing DeadlinesHit ProtocolMismatch NoTransferCompleted NoTrafficYet".split()

# Calls that carry a reason or a condition type, and the keyword / name a reason is bound to.
CARRIERS = {"condition", "Problem", "ChildProblem", "Event", "Verdict", "PreflightFailure", "unservable", "PassResult",
            "format_termination_message", "_with_failure", "_condition"}  # fmt: skip
NAMES = set(WIRE_REASONS) | set(WIRE_EVENT_REASONS) | set(WIRE_CONDITION_TYPES)


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _bare(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES else None


def _bare_reasons(path: Path) -> list[str]:
    """`file:line "Name"` for each bare reason or condition type in a place that carries one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        values: list[ast.AST] = []
        if isinstance(node, ast.Call):
            values += list(node.args) if _callee(node) in CARRIERS else []
            values += [k.value for k in node.keywords if k.arg in ("reason", "type_", "verb")]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in ("reason", "verb") for t in targets) and node.value is not None:
                values += [n for n in ast.walk(node.value)]
        elif isinstance(node, ast.Tuple) and len(node.elts) == 4 and isinstance(node.elts[1], ast.Constant) \
                and node.elts[1].value in (True, False, None):  # a (type, ok, reason, message) condition
            values += node.elts[:3]
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == 3:
            values += node.value.elts[1:2]  # kv_transfer's (ok, reason, message)
        found += [f"{path.name}:{node.lineno} {v!r}" for v in map(_bare, values) if v]  # type: ignore[attr-defined]
    return found


def test_no_reason_or_condition_type_is_written_as_a_bare_string() -> None:
    assert len(PRODUCT) > 40, f"the scan found only {len(PRODUCT)} product modules under {REPO}"
    found = [hit for path in PRODUCT if path.name != "vocabulary.py" for hit in _bare_reasons(path)]
    assert not found, "use the vocabulary's members (Reason.X, EventReason.X, ConditionType.X):\n" + "\n".join(found)


def test_the_scan_sees_a_bare_reason(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('def f():\n    reason = "Conflict"\n    return condition("Ready", False, "CrashLoop", "", 1, {}, "")\n')
    assert len(_bare_reasons(sample)) == 3


def test_the_strings_on_the_wire_are_unchanged() -> None:
    assert [r.value for r in Reason] == WIRE_REASONS
    assert [r.value for r in EventReason] == WIRE_EVENT_REASONS
    assert [t.value for t in ConditionType] == WIRE_CONDITION_TYPES == list(vocabulary.CONDITION_TYPES)
    assert [r.value for r in PreflightReason] == WIRE_PREFLIGHT == list(PREFLIGHT_REASONS)
    assert [r.value for r in KVReason] == WIRE_KV


def test_the_data_planes_reasons_are_the_vocabularys() -> None:
    for made in (*PreflightReason, *KVReason):
        assert Reason(made) == made and Reason(made).value == made.value


@given(st.sampled_from([*Reason, *EventReason, *ConditionType, *PreflightReason, *KVReason]))
def test_a_member_writes_as_its_string(member: str) -> None:
    value = member.value  # type: ignore[attr-defined]
    assert member == value and hash(member) == hash(value)
    assert str(member) == f"{member}" == value and type(str(member)) is str
    assert json.dumps({"reason": member}) == json.dumps({"reason": value})


def test_a_misspelt_member_fails_where_it_is_named() -> None:
    with pytest.raises(AttributeError):
        Reason.CRASHLOOP  # noqa: B018
    with pytest.raises(AttributeError):
        EventReason.ROLLOUT_STARTING  # noqa: B018
    with pytest.raises(ValueError):
        Reason("CrashLooping")


def test_a_reason_without_its_line_of_doc_fails_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vocabulary, "REASONS", vocabulary.REASONS[:-1])
    with pytest.raises(ImportError, match="RouterUnreachable"):
        vocabulary._check()


def test_a_status_carries_plain_strings() -> None:
    status = status_mod.unservable(Reason.INVALID_SPEC, "spec.x: wrong", "fix it", 3, None, "2025-01-01T00:00:00Z")
    for c in status["conditions"]:
        assert type(c["type"]) is str and type(c["reason"]) is str, c
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Reconciling", "Stalled"]
    assert {c["reason"] for c in status["conditions"]} == {"InvalidSpec"}
    assert "InvalidSpec" in yaml.safe_dump(status)


def test_the_preflight_message_round_trips_its_reason() -> None:
    for reason in PreflightReason:
        line = format_termination_message(reason, "what  to\nchange")
        assert line == f"{reason.value}: what to change"
        assert parse_termination_message(line) == (reason, "what to change")
    with pytest.raises(ValueError):
        format_termination_message("NixlMissing", "x")  # type: ignore[arg-type]
