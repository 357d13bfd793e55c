"""The API documents itself, and the repository stands alone."""

from __future__ import annotations

import re
import subprocess
from typing import Any, Iterator

from disagg_operator.api.crd import build_crd

from tests.fixtures.models import REPO

# The workspace beside a checkout, which a cloner does not have: facts the product needs live in docs/.
OUTSIDE_REPO = re.compile(r"\.\./shared\b|/work/shared\b")


def _properties(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every property under a schema node, with its path (items and map values included)."""
    for name, prop in node.get("properties", {}).items():
        yield f"{path}.{name}", prop
        yield from _properties(prop, f"{path}.{name}")
    for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
        child = node.get(key)
        if isinstance(child, dict):
            yield from _properties(child, path + suffix)


def undocumented(schema: dict[str, Any]) -> list[str]:
    return [path for path, prop in _properties(schema, "") if not prop.get("description", "").strip()]


def test_undocumented_lists_every_property_without_description() -> None:
    schema = {
        "properties": {
            "a": {"description": "has one", "properties": {"b": {"type": "string"}}},
            "c": {"type": "array", "items": {"properties": {"d": {"description": " "}}}},
        }
    }
    assert undocumented(schema) == [".a.b", ".c", ".c[].d"]


# The API server describes these itself (and refuses anything but a type on metadata).
SERVER_DESCRIBED = {".apiVersion", ".kind", ".metadata"}


def test_every_crd_property_has_a_description() -> None:
    """`kubectl explain dm --recursive` shows no empty field, status included."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["properties"]["metadata"] == {"type": "object"}
    missing = [path for path in undocumented(schema) if path not in SERVER_DESCRIBED]
    assert not missing, "write description= on these fields in api/models.py: " + ", ".join(missing)


def _tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    return [name for name in listed.stdout.split("\0") if name]


def test_no_tracked_file_outside_tests_points_outside_the_repository() -> None:
    """The repository stands alone: README, docs, code and chart cite docs/, never the workspace beside it."""
    files = [name for name in _tracked_files() if not name.startswith("tests/")]
    assert "README.md" in files and "docs/contracts.md" in files  # the listing really is this repository
    offenders = []
    for name in files:
        path = REPO / name
        if not path.is_file():  # deleted in the work tree but not yet in the index
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        offenders += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if OUTSIDE_REPO.search(line)]
    assert not offenders, "cite docs/ (contracts.md, vllm-protocol.md) instead of ../shared in: " + ", ".join(offenders)
