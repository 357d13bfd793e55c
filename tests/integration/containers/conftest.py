"""The images both modules here run, built once per test session from their Dockerfiles (hack/images.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.images import build_image_tars


@pytest.fixture(scope="session")
def image_tars(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The operator's and router's images, and the engine image's stand-in (hack/node/engine-sim) for the real node."""
    return build_image_tars(tmp_path_factory.mktemp("images"), ("operator", "router", "engine-sim"))
