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


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (hack/test.sh: -n 2) the e2e tests are one unit of work: one worker runs them all, in
    order, against one cluster and one operator (two operators would fight over the same models), while the
    other workers take the unit and integration tests one by one beside them. The containers' tests are one unit
    of work too: one BuildKit build for the images' tests, and the real node's test compares the host before and
    after, so no runc or buildkitd of theirs may run beside it. Not xdist_group marks with
    --dist loadgroup: xdist 3.8 marks a group by rewriting item._nodeid, which pytest 9.2's nodes no longer read."""
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((scope for scope in ONE_WORKER_SCOPES if nodeid.startswith(scope + "/")), nodeid)

    return OneWorkerScopes(config, log)


E2E_SCOPE = "tests/e2e"
# Each is one unit of work, for one worker: the e2e tests (one cluster), the built images and the real node.
ONE_WORKER_SCOPES = (E2E_SCOPE, "tests/integration/containers")
