"""The CRD names every condition type the operator writes, from one source: the vocabulary.

Condition.type's description is generated from vocabulary.CONDITION_TYPES (models.condition_types_description);
these tests hold the three copies a reader meets to it: what `disagg-operator crd` prints, crds/, and the chart's
crds/ (a byte copy of crds/, written by the chart sync).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_operator.api import vocabulary
from disagg_operator.api.crd import CRD_FILE, build_crd, render_crd_yaml
from disagg_operator.api.models import Condition, condition_types_description

from tests.fixtures.models import REPO

COPIES = {"crds/": REPO / "crds" / CRD_FILE, "the chart's crds/": REPO / "charts" / "disagg-operator" / "crds" / CRD_FILE}


def _condition_schema(crd: dict[str, Any]) -> dict[str, Any]:
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    return status["properties"]["conditions"]["items"]


def _model_crd(text: str) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(text) if d and d["spec"]["names"]["kind"] == "DisaggregatedModel")


def _named(description: str) -> list[str]:
    """The condition types a description names, in the order it names them."""
    words = description.replace(",", " ").replace("(", " ").split()
    return [w for w in words if w in set(vocabulary.CONDITION_TYPES)]


def test_the_description_is_made_from_the_vocabulary() -> None:
    description = Condition.model_fields["type"].description
    assert description == condition_types_description()
    assert _named(description or "") == list(vocabulary.CONDITION_TYPES)


def test_every_condition_type_is_an_enum_member_on_the_wire_as_written() -> None:
    assert [str(t) for t in vocabulary.ConditionType] == list(vocabulary.CONDITION_TYPES)
    assert all(type(str(t)) is str for t in vocabulary.ConditionType)


def test_the_generated_crd_names_every_condition_type() -> None:
    schema = _condition_schema(build_crd())
    assert _named(schema["properties"]["type"]["description"]) == list(vocabulary.CONDITION_TYPES)


@pytest.mark.parametrize("where", sorted(COPIES))
def test_the_checked_in_crds_name_every_condition_type(where: str) -> None:
    text = COPIES[where].read_text()
    assert text == render_crd_yaml(), f"{where} is stale: disagg-operator crd > crds/{CRD_FILE}; python -m hack.gen.chart_sync"
    schema = _condition_schema(_model_crd(text))
    assert _named(schema["properties"]["type"]["description"]) == list(vocabulary.CONDITION_TYPES)


def test_the_crd_command_prints_every_condition_type() -> None:
    out = subprocess.run([sys.executable, "-m", "disagg_operator.cli", "crd"], capture_output=True, text=True,
                         check=True, timeout=120).stdout  # fmt: skip
    assert out == render_crd_yaml()
    schema = _condition_schema(_model_crd(out))
    assert _named(schema["properties"]["type"]["description"]) == list(vocabulary.CONDITION_TYPES)
