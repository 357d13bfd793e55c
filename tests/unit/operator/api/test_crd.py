"""The checked-in CRD is the one the models generate, and it is a valid structural CRD."""

from __future__ import annotations

import kubernetes_validate
import yaml

from disagg_operator.api.crd import CRD_FILE, build_crd, build_role_crd, render_crd_yaml

from tests.fixtures.models import REPO

CRD_PATH = REPO / "crds" / CRD_FILE


def test_committed_crd_is_fresh() -> None:
    assert CRD_PATH.read_text() == render_crd_yaml(), (
        "crds/ is stale: run `python -m disagg_operator.api.crd > crds/" + CRD_FILE + "`"
    )


def test_crd_validates_against_kubernetes_schema() -> None:
    documents = list(yaml.safe_load_all(CRD_PATH.read_text()))
    assert [d["spec"]["names"]["kind"] for d in documents] == ["DisaggregatedModel", "DisaggregatedRole"]
    for document in documents:
        kubernetes_validate.validate(document, "1.34", strict=True)


def test_role_crd_has_the_scale_subresource_hpas_use() -> None:
    (version,) = build_role_crd()["spec"]["versions"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}


def _walk(node: object, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}[{index}]")


def test_schema_is_structural() -> None:
    """Rules the API server applies to CRD schemas, checked here so the e2e failure is never the first."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "const" not in node and "title" not in node, path
        if "properties" in node and isinstance(node["properties"], dict) and "type" in node:
            assert node["type"] == "object", path
            assert "additionalProperties" not in node, path
        if "anyOf" in node and isinstance(node["anyOf"], list):
            assert node.get("x-kubernetes-int-or-string") is True, f"{path}: anyOf only for int-or-string"


def test_cel_rules_and_columns_present() -> None:
    version = build_crd()["spec"]["versions"][0]
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    messages = [r["message"] for r in spec_schema["x-kubernetes-validations"]]
    assert any("divide each other" in m for m in messages)
    assert any("TCP speed" in m for m in messages)
    assert {c["name"] for c in version["additionalPrinterColumns"]} >= {"Mode", "Ready", "Prefill", "Decode", "Age"}
    assert version["subresources"] == {"status": {}}
    assert build_crd()["spec"]["names"]["shortNames"] == ["dm", "dmodel"]


def test_router_policies_replace_decode_selection() -> None:
    """The API server prunes the removed decodeSelection from an old manifest; the policies are enums with defaults."""
    router = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]
    props = router["properties"]
    assert "decodeSelection" not in props and not router.get("x-kubernetes-preserve-unknown-fields")
    assert (props["prefillPolicy"]["enum"], props["prefillPolicy"]["default"]) == (["PrefixAndLoad", "LeastOutstanding"], "PrefixAndLoad")
    assert (props["decodePolicy"]["enum"], props["decodePolicy"]["default"]) == (["LeastLoaded", "LeastOutstanding"], "LeastLoaded")
