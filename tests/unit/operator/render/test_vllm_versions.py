"""One renderer, several vLLM releases: the effective release, what it changes, where it is published."""

from __future__ import annotations

import pytest

from disagg_connector import contract
from disagg_operator.api.models import DEFAULT_VLLM_VERSION
from disagg_operator.api.validation import parse
from disagg_operator.config import ENGINE_IMAGE, ENGINE_REPOSITORY, NEURON_ENGINE_IMAGE, DefaultsError, RenderDefaults
from disagg_operator.render import render
from disagg_operator.resolve import held_release, plan

from tests.fixtures.models import EXAMPLES, dm, load_example

NEURON = {"accelerator": {"type": "neuron", "count": 16}, "parallelism": {"tensor": 64}}


@pytest.mark.parametrize(
    ("patch", "version"),
    [
        ({}, "0.33.0"),
        ({"prefill": NEURON, "decode": NEURON}, "0.24.0"),
        ({"engine": {"vllmVersion": "0.26.0", "image": "vllm/vllm-openai:v0.26.0"}}, "0.26.0"),
    ],
)
def test_effective_version_is_the_spec_or_the_default_image(patch: dict, version: str) -> None:
    assert plan(parse(dm(patch)).spec).vllm_version == version


def test_default_images_are_tagged_with_their_release() -> None:
    assert ENGINE_IMAGE.endswith(":0.33.0-efa") and NEURON_ENGINE_IMAGE.endswith(":0.24.0-neuron")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_engine_pods_publish_their_release(path) -> None:
    rendered = render(parse(load_example(path)))
    engines = [o for o in rendered.objects if o["kind"] == "Deployment"
               and o["metadata"]["labels"].get(contract.LABEL_ROLE) in contract.ENGINE_ROLES]  # not a gateway's picker
    versions = {o["spec"]["template"]["metadata"]["annotations"][contract.ANNOTATION_VLLM_VERSION] for o in engines}
    assert versions == {rendered.plan.vllm_version}
    assert rendered.plan.vllm_version == ("0.24.0" if path.stem.startswith("trn2") else "0.33.0")


def test_a_release_change_is_a_new_revision() -> None:
    image = {"image": "example.com/vllm:x"}
    revisions = {render(parse(dm({"engine": {**image, "vllmVersion": v}}))).revision for v in contract.VLLM_VERSIONS}
    assert len(revisions) == len(contract.VLLM_VERSIONS)


@pytest.mark.parametrize(
    ("version", "transfer_mode", "pipelined_push"),
    [("0.24.0", False, False), ("0.26.0", False, True), ("0.33.0", True, True)],
)
def test_protocol_differences(version: str, transfer_mode: bool, pipelined_push: bool) -> None:
    protocol = contract.VllmProtocol(version)
    assert protocol.returns_transfer_mode is transfer_mode
    assert protocol.push_with_prefill_pipeline is pipelined_push


# --- An operator upgrade that moves the default release rolls no running model ---------------------------------

MOVED = RenderDefaults(engine_image=f"{ENGINE_REPOSITORY}:0.34.0-efa")  # the chart of an operator whose default is 0.34.0


def engine_images(rendered) -> set[str]:
    return {c["image"] for o in rendered.objects if o["kind"] == "Deployment" and o["metadata"]["labels"].get(contract.LABEL_ROLE)
            in contract.ENGINE_ROLES for c in o["spec"]["template"]["spec"]["containers"]}  # fmt: skip


@pytest.fixture
def default_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """This operator's code with its default NVIDIA release moved to 0.34.0 (the dict every module reads)."""
    monkeypatch.setitem(DEFAULT_VLLM_VERSION, "nvidia", "0.34.0")


def test_a_model_that_names_no_release_keeps_the_one_it_runs_when_the_default_moves(default_moved: None) -> None:
    model = parse(dm())
    with pytest.MonkeyPatch.context() as before:  # the operator before the upgrade rendered it, and wrote its status
        before.setitem(DEFAULT_VLLM_VERSION, "nvidia", "0.33.0")
        running = render(model)
    assert running.plan.vllm_version == "0.33.0"
    status = {"vllmVersion": running.plan.vllm_version, "revision": running.revision}

    kept = render(model, MOVED, status)
    assert (kept.plan.vllm_version, kept.revision) == ("0.33.0", running.revision), "the upgrade rolled the model"
    assert engine_images(kept) == {f"{ENGINE_REPOSITORY}:0.33.0-efa"}
    # A new model (no status yet) starts on the new default, on the new default's image.
    new = render(model, MOVED)
    assert new.plan.vllm_version == "0.34.0" and engine_images(new) == {MOVED.engine_image}
    # Naming the new release is how a running model moves: a new revision, the same as a new model's.
    moved = render(parse(dm({"engine": {"vllmVersion": "0.34.0"}})), MOVED, status)
    assert moved.revision == new.revision != running.revision


def test_a_model_that_names_its_release_keeps_its_image_when_the_default_moves(default_moved: None) -> None:
    pinned = parse(dm({"engine": {"vllmVersion": "0.33.0"}}))
    with pytest.MonkeyPatch.context() as before:
        before.setitem(DEFAULT_VLLM_VERSION, "nvidia", "0.33.0")
        running = render(pinned)
    after = render(pinned, MOVED, {"vllmVersion": "0.33.0"})
    assert after.revision == running.revision and engine_images(after) == {f"{ENGINE_REPOSITORY}:0.33.0-efa"}


@pytest.mark.parametrize(
    ("patch", "status", "held"),
    [
        ({}, None, None),  # a new model
        ({}, {"phase": "Ready"}, None),  # last written by an operator before status.vllmVersion
        ({}, {"vllmVersion": "0.26.0"}, "0.26.0"),
        ({"engine": {"vllmVersion": "0.34.0"}}, {"vllmVersion": "0.26.0"}, None),  # the spec's release wins
        ({"prefill": NEURON, "decode": NEURON}, {"vllmVersion": "0.33.0"}, None),  # moved to neuron: not a neuron release
        ({}, {"vllmVersion": "0.24.0"}, None),  # moved off neuron: the operator has no NVIDIA 0.24.0 image
        ({"engine": {"image": "example.com/vllm:0.24"}}, {"vllmVersion": "0.24.0"}, "0.24.0"),  # with its own image
        ({}, {"vllmVersion": "9.9.9"}, None),  # a release this operator does not know
    ],
)
def test_which_release_is_held(patch: dict, status: dict | None, held: str | None) -> None:
    model = parse(dm(patch))
    assert held_release(model.spec, status) == held
    assert render(model, RenderDefaults(), status).plan.vllm_version == (held or plan(model.spec).vllm_version)


def test_a_release_named_alone_gets_the_operators_image_of_it() -> None:
    defaults = RenderDefaults(engine_images={"0.34.0": "registry.example.com/vllm-runtime:0.34.0-efa-2"})
    assert engine_images(render(parse(dm({"engine": {"vllmVersion": "0.34.0"}})), defaults)) == {defaults.engine_images["0.34.0"]}
    assert engine_images(render(parse(dm({"engine": {"vllmVersion": "0.26.0"}})), defaults)) == {f"{ENGINE_REPOSITORY}:0.26.0-efa"}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("not json", "is not JSON"),
        ('["0.34.0"]', "must be a JSON object"),
        ('{"0.34.0": ""}', "must be a JSON object"),
        ('{"0.35.0": "x/y:1"}', "names 0.35.0"),
    ],
)
def test_bad_engine_images_are_refused_saying_what_to_change(raw: str, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_ENGINE_IMAGES", raw)
    with pytest.raises(DefaultsError, match=says):
        RenderDefaults.from_env()
