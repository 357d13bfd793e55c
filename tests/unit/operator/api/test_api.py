"""The API models: defaults, and every refusal names the field and says what to change."""

from __future__ import annotations

import pytest

from disagg_operator.api.validation import SpecError, parse
from disagg_operator.resolve import backend, transfer_mode

from tests.fixtures.models import dm
from tests.fixtures.api_cases import EFA, INVALID, VALID_EDGES


def problems(obj: dict) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as raised:
        parse(obj)
    return [(p.path, p.message) for p in raised.value.problems]


def test_defaults_are_sensible() -> None:
    spec = parse(dm()).spec
    assert spec.engine.block_size == 128
    assert spec.kv_transfer.mode == "Auto" and spec.kv_transfer.side_channel_port == 5600
    assert spec.kv_transfer.lease_seconds > spec.router.request_deadline_seconds
    assert spec.prefill.replicas == 1 and spec.decode.accelerator.count == 1
    assert spec.network.network_policy.enabled
    assert spec.network.placement.zone == "Required" and spec.network.placement.spine == "Preferred"
    assert not spec.network.efa.privileged
    assert (spec.router.prefill_policy, spec.router.decode_policy) == ("PrefixAndLoad", "LeastLoaded")
    assert spec.engine.enable_prefix_caching and spec.publishes_kv_events


# (case id, spec patch, expected field path, a phrase of the message)


@pytest.mark.parametrize(("patch", "path", "phrase"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_spec_names_field_and_fix(patch: dict, path: str, phrase: str) -> None:
    found = problems(dm(patch))
    assert any(p == path and phrase in m for p, m in found), found


@pytest.mark.parametrize("name", ["qwen3.5-small", "3b-chat", "llama-3.1-70b"])
def test_model_name_must_be_a_service_name(name: str) -> None:
    obj = dm()
    obj["metadata"]["name"] = name
    found = problems(obj)
    assert any(p == "metadata.name" and "qwen3-5-small, not qwen3.5-small" in m for p, m in found), found


def test_missing_model_is_reported() -> None:
    obj = dm()
    del obj["spec"]["model"]
    assert ("spec.model", "required field is missing") in problems(obj)


def test_every_problem_is_reported_at_once() -> None:
    found = problems(dm({"kvTransfer": {"mode": "Push", "bidirectional": True, "backend": "UCX"},
                         "prefill": EFA, "decode": EFA}))
    paths = {p for p, _ in found}
    assert {"spec.kvTransfer.mode", "spec.kvTransfer.backend"} <= paths


@pytest.mark.parametrize("patch", [c[1] for c in VALID_EDGES], ids=[c[0] for c in VALID_EDGES])
def test_valid_edge_cases_are_accepted(patch: dict) -> None:
    parse(dm(patch))


@pytest.mark.parametrize(
    ("patch", "mode", "reason"),
    [
        ({}, "Push", "Auto chose push"),
        ({"kvTransfer": {"bidirectional": True}}, "Pull", "bidirectional"),
        ({"decode": {"parallelism": {"pipeline": 2}, "accelerator": {"count": 2}}}, "Pull", "pipeline"),
        ({"decode": {"parallelism": {"context": 2}}}, "Pull", "context parallel"),
        ({"engine": {"enableSleepMode": True}}, "Pull", "sleep mode"),
        ({"kvTransfer": {"mode": "Pull"}}, "Pull", "Pull requested"),
        ({"kvTransfer": {"mode": "Push"}}, "Push", "Push requested"),
        ({"engine": {"vllmVersion": "0.24.0", "image": "example.com/vllm:0.24.0"},
          "prefill": {"parallelism": {"pipeline": 2}, "accelerator": {"count": 2}}}, "Pull", "vLLM 0.24.0"),
    ],
)
def test_mode_selection(patch: dict, mode: str, reason: str) -> None:
    chosen, why = transfer_mode(parse(dm(patch)).spec)
    assert chosen == mode and reason in why


def test_backend_auto_follows_efa() -> None:
    assert backend(parse(dm()).spec)[0] == "UCX"
    assert backend(parse(dm({"prefill": EFA, "decode": EFA})).spec)[0] == "LIBFABRIC"
