"""The router's install carries only what the router needs: no operator code, none of its dependencies."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.fixtures.models import REPO

OPERATOR_ONLY = ("kopf", "pydantic", "jinja2", "celpy", "disagg_operator")
CONNECTOR = tomllib.loads((REPO / "connector" / "pyproject.toml").read_text())["project"]


def test_the_connector_distribution_depends_on_nothing_of_the_operators():
    deps = [*CONNECTOR["dependencies"], *CONNECTOR["optional-dependencies"]["router"]]
    names = {d.split("==")[0].lower() for d in deps}
    assert names == {"kubernetes", "pyyaml", "aiohttp", "uvloop", "prometheus-client", "orjson", "pyzmq", "msgspec", "cbor2"}
    assert all("==" in d for d in deps)  # pinned
    operator = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert f"disagg-connector=={CONNECTOR['version']}" in operator["dependencies"]


def test_the_router_runs_with_the_operators_packages_unimportable():
    """A meta-path finder refuses kopf, pydantic, jinja2, cel-python and disagg_operator: the router's whole
    import graph and its command line still work (as in its image, where they are not installed)."""
    code = f"""
import sys, importlib.abc
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPERATOR_ONLY!r}:
            raise ImportError(f"{{name}} is not in the router's install")
sys.meta_path.insert(0, Refuse())
import disagg_connector.router.server, disagg_connector.contract.health, disagg_connector.preflight
from disagg_connector.router.cli import main
sys.argv = ["disagg-router", "--help"]
main()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "--disaggregation-threshold-tokens" in r.stdout
