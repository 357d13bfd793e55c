"""`disagg-operator plan`: golden plans of every example (as a first create, an image change, and a Push->Pull
change where the example runs push), the rollout arithmetic it reports, and the command's bad-input paths."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_connector import contract
from disagg_operator.api.validation import parse
from disagg_operator.changeplan import ChangePlan, PlanError, change_plan
from disagg_operator.cli import main
from disagg_operator.api.models import DEFAULT_VLLM_VERSION
from disagg_operator.config import ENGINE_REPOSITORY, RenderDefaults
from disagg_operator.render import render

from tests.fixtures.models import EXAMPLES, REPO, dm, load_example, merge

GOLDEN = REPO / "tests" / "golden" / "plan"
DEFAULTS = RenderDefaults()
NEW_IMAGE = {"engine": {"image": "registry.example/vllm-runtime:0.33.0-patched"}}
TO_PULL = {"kvTransfer": {"mode": "Pull"}}


def changed(doc: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    merge(out["spec"], copy.deepcopy(patch))
    return out


def example_changes(path: Path) -> dict[str, tuple[dict[str, Any] | None, dict[str, Any]]]:
    """change id -> (current, new) documents: a first create, an image change, and Push->Pull where the
    example runs push and pull can serve it."""
    doc = load_example(path)
    changes: dict[str, tuple[dict[str, Any] | None, dict[str, Any]]] = {"create": (None, doc), "image": (doc, changed(doc, NEW_IMAGE))}
    if render(parse(doc)).plan.mode == "Push":
        changes["push-to-pull"] = (doc, changed(doc, TO_PULL))
    return changes


def plan_of(current: dict[str, Any] | None, new: dict[str, Any]) -> ChangePlan:
    return change_plan(parse(current) if current else None, parse(new), DEFAULTS)


GOLDEN_CASES = [(path, change) for path in EXAMPLES for change in example_changes(path)]


@pytest.mark.parametrize(("path", "change"), GOLDEN_CASES, ids=[f"{p.stem}-{c}" for p, c in GOLDEN_CASES])
def test_golden(path: Path, change: str) -> None:
    """Reviewed by eye once; regenerate with DISAGG_UPDATE_GOLDEN=1 and review the diff."""
    planned = plan_of(*example_changes(path)[change])
    for suffix, text in (("txt", planned.to_text()), ("json", planned.to_json())):
        golden = GOLDEN / path.stem / f"{change}.{suffix}"
        if os.environ.get("DISAGG_UPDATE_GOLDEN") == "1":
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.read_text() == text, f"{golden} is stale: regenerate with DISAGG_UPDATE_GOLDEN=1"


def test_every_example_has_a_push_to_pull_golden_where_it_runs_push() -> None:
    pushing = {p.stem for p in EXAMPLES if render(parse(load_example(p))).plan.mode == "Push"}
    assert pushing and pushing == {p.parent.name for p in GOLDEN.glob("*/push-to-pull.txt")}


FOUR_BY_FOUR = dm({"prefill": {"replicas": 4}, "decode": {"replicas": 4}})


def test_a_first_create_is_one_step_to_full_size() -> None:
    planned = plan_of(None, FOUR_BY_FOUR)
    assert planned.create and not planned.new_revision_made and planned.changes == ()
    assert [s.sizes for s in planned.steps] == [{r: {planned.new_revision: 4} for r in contract.ENGINE_ROLES}]
    assert planned.peak_pods == {r: 4 for r in contract.ENGINE_ROLES}
    assert planned.current["prefill"].pods == 0 and planned.final["decode"].pods == 4


@pytest.mark.parametrize(("surge", "unavailable", "peak"), [(1, 0, 5), (2, 0, 6), ("50%", 0, 6), (0, 1, 4), ("25%", "25%", 5)])
def test_an_image_change_rolls_within_the_budget(surge: int | str, unavailable: int | str, peak: int) -> None:
    budgets = {r: {"maxSurge": surge, "maxUnavailable": unavailable} for r in contract.ENGINE_ROLES}
    current = changed(FOUR_BY_FOUR, {"rollout": budgets})
    planned = plan_of(current, changed(current, NEW_IMAGE))
    assert planned.new_revision_made and planned.current_revision != planned.new_revision
    assert planned.peak_pods == {r: peak for r in contract.ENGINE_ROLES}
    assert planned.peak_accelerators == {r: {"nvidia.com/gpu": peak} for r in contract.ENGINE_ROLES}
    old, new = planned.current_revision, planned.new_revision
    for step in planned.steps:
        for role in contract.ENGINE_ROLES:
            b = planned.budgets[role]
            assert step.during[role].pods <= b.target + b.surge
            assert sum(step.sizes[role].values()) >= b.target - b.unavailable
        assert step.sizes["prefill"][new] == step.sizes["decode"][new] and step.sizes["prefill"][old] == step.sizes["decode"][old]
    assert planned.steps[-1].sizes == {r: {new: 4, old: 0} for r in contract.ENGINE_ROLES}
    assert [(c.path, c.new_revision_alone) for c in planned.changes] == [("spec.engine.image", True)]


def test_replicas_alone_scale_without_a_new_revision() -> None:
    planned = plan_of(FOUR_BY_FOUR, changed(FOUR_BY_FOUR, {"decode": {"replicas": 6}, "prefill": {"replicas": 2}}))
    assert not planned.new_revision_made and planned.current_revision == planned.new_revision
    assert [(c.path, c.before, c.after, c.new_revision_alone) for c in planned.changes] == [
        ("spec.decode.replicas", 4, 6, False), ("spec.prefill.replicas", 4, 2, False)]
    (step,) = planned.steps
    assert step.sizes == {"prefill": {planned.new_revision: 2}, "decode": {planned.new_revision: 6}}
    assert planned.peak_pods == {"prefill": 4, "decode": 6}  # prefill shrinks from 4, decode grows to 6


def test_a_router_change_moves_no_engine() -> None:
    planned = plan_of(FOUR_BY_FOUR, changed(FOUR_BY_FOUR, {"router": {"replicas": 3}}))
    assert not planned.new_revision_made and planned.steps == ()
    assert [(c.path, c.new_revision_alone) for c in planned.changes] == [("spec.router.replicas", False)]


def test_fields_that_are_valid_only_together_say_so() -> None:
    """accelerator.count must equal the parallel sizes: neither changes alone."""
    bigger = {"prefill": {"parallelism": {"tensor": 2}, "accelerator": {"count": 2}}}
    planned = plan_of(FOUR_BY_FOUR, changed(FOUR_BY_FOUR, bigger))
    assert planned.new_revision_made
    assert [(c.path, c.new_revision_alone) for c in planned.changes] == [
        ("spec.prefill.accelerator.count", None), ("spec.prefill.parallelism.tensor", None)]


def test_accelerators_of_both_revisions_add_up_during_a_rollout() -> None:
    """Prefill from 1 GPU per pod to 2: the old pods keep their GPU until they go."""
    bigger = {"prefill": {"parallelism": {"tensor": 2}, "accelerator": {"count": 2}}}
    planned = plan_of(FOUR_BY_FOUR, changed(FOUR_BY_FOUR, bigger))
    first = planned.steps[0].during["prefill"]
    assert (first.pods, first.accelerators) == (5, {"nvidia.com/gpu": 4 * 1 + 1 * 2})
    assert planned.final["prefill"].accelerators == {"nvidia.com/gpu": 8}
    assert planned.peak_accelerators["prefill"] == {"nvidia.com/gpu": max(
        sum(n * (2 if rev == planned.new_revision else 1) for rev, n in s.sizes["prefill"].items()) for s in planned.steps)}
    assert planned.peak_accelerators["decode"] == {"nvidia.com/gpu": 5}


def test_a_plan_is_of_one_model() -> None:
    with pytest.raises(PlanError, match="ns/m and the new one ns/other"):
        change_plan(parse(dm()), parse(dm(name="other")), DEFAULTS)


def test_json_is_the_plan() -> None:
    planned = plan_of(FOUR_BY_FOUR, changed(FOUR_BY_FOUR, NEW_IMAGE))
    data = json.loads(planned.to_json())
    assert data["peak_pods"] == planned.peak_pods and data["new_revision_made"] is True and data["create"] is False
    assert len(data["steps"]) == len(planned.steps) and data["changes"][0]["path"] == "spec.engine.image"


# --- the command ------------------------------------------------------------------------------------


def write(tmp_path: Path, name: str, *docs: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def test_plan_command_against_a_live_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--current takes `kubectl get -o yaml` output: status and server metadata are ignored."""
    live = {**FOUR_BY_FOUR, "metadata": {**FOUR_BY_FOUR["metadata"], "generation": 7, "resourceVersion": "123",
            "managedFields": [{"manager": "kubectl"}]}, "status": {"phase": "Ready", "revision": "x", "surprise": 1}}  # fmt: skip
    new = write(tmp_path, "new.yaml", changed(FOUR_BY_FOUR, NEW_IMAGE))
    assert main(["plan", "-f", new, "--current", write(tmp_path, "live.yaml", live), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_pods"] == {r: 5 for r in contract.ENGINE_ROLES}
    assert main(["plan", "-f", new, "--current", write(tmp_path, "live.yaml", live)]) == 0
    text = capsys.readouterr().out
    assert "a new revision:" in text and "spec.engine.image: (not set) -> " in text and "makes a new revision" in text


def test_plan_shows_a_kept_release_and_the_rollout_to_the_new_default(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The live model runs 0.33.0 (its status says so) and this operator's default moved to 0.34.0: its unchanged
    manifest plans no change, and naming 0.34.0 plans the rollout."""
    live = {**dm(), "status": {"phase": "Ready", "vllmVersion": "0.33.0"}}
    monkeypatch.setitem(DEFAULT_VLLM_VERSION, "nvidia", "0.34.0")
    monkeypatch.setenv("DISAGG_ENGINE_IMAGE", f"{ENGINE_REPOSITORY}:0.34.0-efa")
    current = write(tmp_path, "live.yaml", live)
    assert main(["plan", "-f", write(tmp_path, "same.yaml", dm()), "--current", current]) == 0
    text = capsys.readouterr().out
    assert "no change to the engines" in text and "vLLM 0.33.0, kept" in text and "spec.engine.vllmVersion to 0.34.0" in text
    assert main(["plan", "-f", write(tmp_path, "new.yaml", dm({"engine": {"vllmVersion": "0.34.0"}})), "--current", current]) == 0
    text = capsys.readouterr().out
    assert "a new revision:" in text and "spec.engine.vllmVersion: (not set) -> \"0.34.0\": makes a new revision" in text
    assert "  vLLM 0.34.0\n" in text


@pytest.mark.parametrize(("files", "message"), [
    ({"new.yaml": []}, "holds no documents"),
    ({"new.yaml": [dm(), dm(name="two")]}, "holds 2 DisaggregatedModels: plan takes one"),
    ({"new.yaml": [dm({"prefill": {"replicas": -1}})]}, "spec.prefill.replicas"),
    ({"new.yaml": [dm()], "live.yaml": [dm(name="other")]}, "a plan compares one model before and after"),
    ({"new.yaml": [dm()], "live.yaml": [dm({"kvTransfer": {"mode": "Sideways"}})]}, "live.yaml#0 (m) is invalid"),
])  # fmt: skip
def test_plan_command_refuses_bad_input_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      files: dict[str, list[dict[str, Any]]], message: str) -> None:
    paths = {name: write(tmp_path, name, *docs) for name, docs in files.items()}
    argv = ["plan", "-f", paths["new.yaml"]] + (["--current", paths["live.yaml"]] if "live.yaml" in paths else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_plan_command_from_a_cluster_without_kubeconfig(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["plan", "-f", write(tmp_path, "new.yaml", dm()), "--from-cluster"]) == 2
    assert "--from-cluster needs a kubeconfig" in capsys.readouterr().err
