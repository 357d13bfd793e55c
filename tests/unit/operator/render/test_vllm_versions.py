"""One renderer, several vLLM releases: the effective release, what it changes, where it is published."""

from __future__ import annotations

import pytest

from disagg_connector import contract
from disagg_operator.api.validation import parse
from disagg_operator.config import ENGINE_IMAGE, NEURON_ENGINE_IMAGE
from disagg_operator.render import render
from disagg_operator.resolve import plan

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
