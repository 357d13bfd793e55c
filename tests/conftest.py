"""Shared fixtures: the examples and a builder for DisaggregatedModel dicts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from disagg_operator.manifests import load_all

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def load_example(path: Path) -> dict[str, Any]:
    (doc,) = load_all(path.read_text())
    return doc


def dm(spec: dict[str, Any] | None = None, name: str = "m", namespace: str = "ns", uid: str | None = "uid-1") -> dict[str, Any]:
    """A valid DisaggregatedModel dict (1 GPU per role, no EFA) with `spec` merged over it."""
    base: dict[str, Any] = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"name": "Qwen/Qwen3-0.6B"}},
    }
    if uid:
        base["metadata"]["uid"] = uid
    merge(base["spec"], spec or {})
    return base


def merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--dashboard-png-dir", type=Path, default=None,
                     help="where the e2e's day-2 test draws the operator dashboard's panels (docs/observability.md)")  # fmt: skip


@pytest.fixture
def dashboard_png_dir(request: pytest.FixtureRequest) -> Path | None:
    """--dashboard-png-dir: a test that can draw a dashboard from its real Prometheus does, into it (None: not asked)."""
    return request.config.getoption("--dashboard-png-dir")


@pytest.fixture(params=EXAMPLES, ids=[p.stem for p in EXAMPLES])
def example(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_example(request.param)
