"""Generate the DisaggregatedModel CRD from the pydantic models.

pydantic writes JSON Schema; the API server wants a *structural* OpenAPI v3 schema. The conversion is
mechanical: inline every $ref, turn `Optional[X]` (anyOf X|null) into plain X (absent = unset), drop
titles, `default: null` and `additionalProperties: false` (unknown fields are refused by the API
server's strict field validation instead). CEL rules arrive already attached by `ApiModel`.

`python -m disagg_operator.api.crd > crds/disagg.dev_disaggregatedmodels.yaml` regenerates the file;
tests/unit/operator/api/test_crd.py fails when the checked-in copy is stale.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from disagg_connector import contract

from .models import (
    DisaggregatedModel,
    DisaggregatedModelSpec,
    DisaggregatedModelStatus,
    DisaggregatedRoleSpec,
    DisaggregatedRoleStatus,
)
from .vocabulary import READY

CRD_FILE = f"{contract.API_GROUP}_{contract.PLURAL}.yaml"

_DROP_KEYS = {"title"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    ref = node.pop("$ref", None)
    if ref is not None:
        target = copy.deepcopy(defs[ref.rsplit("/", 1)[-1]])
        target.update(node)  # siblings of $ref (default, description) win
        node = target
    any_of = node.get("anyOf")
    if any_of and not node.get("x-kubernetes-int-or-string"):
        branches = [b for b in any_of if b.get("type") != "null"]
        if len(branches) == 1:  # Optional[X] -> X
            del node["anyOf"]
            merged = dict(branches[0])
            merged.update(node)
            node = merged
            if node.get("default", ...) is None:
                del node["default"]
            return _structural(node, defs)
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if "const" in node:  # OpenAPI v3.0 has no const
        node["enum"] = [node.pop("const")]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if not isinstance(node.get(exclusive, True), bool):  # JSON Schema 2020 -> OpenAPI v3.0
            node[bound] = node[exclusive]
            node[exclusive] = True
    result: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS or key == "$defs":
            continue
        if key == "properties":
            result[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf"):
            result[key] = _structural(value, defs)
        else:
            result[key] = value
    return result


def openapi_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")  # type: ignore[attr-defined]
    return _structural(raw, raw.get("$defs", {}))


def _status_schema() -> dict[str, Any]:
    schema = openapi_schema(DisaggregatedModelStatus)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    # The API server drops status on create; this default makes a model the operator has not judged yet read
    # as such (observedGeneration 0 < metadata.generation) to kstatus and Argo CD, even while no operator runs.
    schema["default"] = {"observedGeneration": 0}
    return schema


def _ready_column(condition: str) -> str:
    return f'.status.conditions[?(@.type=="{condition}")].status'


PRINTER_COLUMNS = [
    {"name": "Mode", "type": "string", "jsonPath": ".status.transferMode"},
    {"name": "Ready", "type": "string", "jsonPath": _ready_column(READY)},
    {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefill.readyReplicas"},
    {"name": "Decode", "type": "integer", "jsonPath": ".status.decode.readyReplicas"},
    {"name": "Router", "type": "integer", "jsonPath": ".status.router.readyReplicas"},
    {"name": "Backend", "type": "string", "jsonPath": ".status.backend", "priority": 1},
    {"name": "vLLM", "type": "string", "jsonPath": ".status.vllmVersion", "priority": 1},
    {"name": "Revision", "type": "string", "jsonPath": ".status.revision", "priority": 1},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _crd(kind: str, plural: str, singular: str, short_names: tuple[str, ...], description: str,
         subresources: dict[str, Any], columns: list[dict[str, Any]], spec: dict[str, Any], status: dict[str, Any],
         validations: list[dict[str, str]] | None = None) -> dict[str, Any]:  # fmt: skip
    schema: dict[str, Any] = {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    if validations:
        schema["x-kubernetes-validations"] = validations
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{contract.API_GROUP}", "labels": {contract.LABEL_NAME: contract.OPERATOR_NAME}},
        "spec": {
            "group": contract.API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": list(short_names),
                "categories": ["all", "disagg"],
            },
            "versions": [
                {
                    "name": contract.API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def build_crd() -> dict[str, Any]:
    return _crd(
        contract.KIND, contract.PLURAL, contract.SINGULAR, contract.SHORT_NAMES,
        "A prefill/decode disaggregated vLLM service with NIXL KV transfer (push or pull) and its router.",
        {"status": {}}, PRINTER_COLUMNS, openapi_schema(DisaggregatedModelSpec), _status_schema(),
        [r.to_schema() for r in DisaggregatedModel.cel_rules],
    )  # fmt: skip


ROLE_PRINTER_COLUMNS = [
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Current", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Revision", "type": "string", "jsonPath": ".status.revision", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_role_crd() -> dict[str, Any]:
    """DisaggregatedRole: one engine role's size under a name that survives revisions, with the scale
    subresource that kubectl scale, HPAs and KEDA use."""
    scale = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
             "labelSelectorPath": ".status.selector"}  # fmt: skip
    return _crd(
        contract.ROLE_KIND, contract.ROLE_PLURAL, contract.ROLE_SINGULAR, contract.ROLE_SHORT_NAMES,
        "The size of one engine role (prefill or decode) of a DisaggregatedModel, named <model>-<role> across "
        "revisions: scale it with kubectl scale, an HPA or KEDA.",
        {"status": {}, "scale": scale}, ROLE_PRINTER_COLUMNS,
        openapi_schema(DisaggregatedRoleSpec), openapi_schema(DisaggregatedRoleStatus),
    )  # fmt: skip


def render_crd_yaml() -> str:
    header = "# Generated by `python -m disagg_operator.api.crd` from disagg_operator/api/models.py. Do not edit.\n"
    return header + yaml.safe_dump_all([build_crd(), build_role_crd()], sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render_crd_yaml())
