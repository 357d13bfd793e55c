"""pytest's hooks and fixtures for every test (the helpers themselves live in tests/fixtures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.models import EXAMPLES, load_example


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
