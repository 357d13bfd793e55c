"""The layering is a test, not a convention: import-linter checks the contracts in .importlinter (the product
and the workshop) and .importlinter-tests (the tests), each contract is shown to catch the import it forbids,
and the README's Layout lists the same layers."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.models import REPO

LINT = str(Path(sys.executable).with_name("lint-imports"))
CONFIG = configparser.ConfigParser()
CONFIG.read(REPO / ".importlinter")
TESTS_CONFIG = REPO / ".importlinter-tests"
CONTRACTS = [section.split(":")[-1] for section in CONFIG.sections() if section.startswith("importlinter:contract:")]
PACKAGES = {"operator": "disagg_operator", "connector": "disagg_connector", "bench": "disagg_bench"}

# contract -> (file, a line that breaks it): one forbidden import for each contract.
BREAKS = {
    "data-plane-independent": ("connector/disagg_connector/router/stats.py", "from disagg_operator.api import models"),
    "operator-sees-the-contract": ("operator/disagg_operator/state.py", "from disagg_connector.router import discovery"),
    "workshop-outside": ("operator/disagg_operator/cli.py", "from disagg_bench.localrun import plan"),
    "operator-layers": ("operator/disagg_operator/rollout.py", "from . import planner  # a decision reading its caller"),
    "pure-core": ("operator/disagg_operator/status.py", "from .kube import Cluster  # a pure module doing I/O"),
    "kopf-in-one-place": ("operator/disagg_operator/kube.py", "import kopf"),
    "render-builders": ("operator/disagg_operator/render/network.py", "from . import engine  # one builder on another"),
    "api-layers": ("operator/disagg_operator/api/cel.py", "from . import models"),
    "data-plane-layers": ("connector/disagg_connector/drain.py", "from disagg_connector.router import config"),
    "contract-pure": ("connector/disagg_connector/contract/vllm_pd.py", "import aiohttp  # I/O in the wire protocol"),
    "router-layers": ("connector/disagg_connector/router/legs.py", "from . import outcomes  # a leg keeping the books"),
    "bench-outside-tests": ("bench/disagg_bench/ports.py", "from tests.fixtures import models  # the workshop reading the tests"),
}


def lint(root: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(root / folder) for folder in PACKAGES)}
    only = [arg for contract in contracts for arg in ("--contract", contract)]
    return subprocess.run([LINT, str(REPO / ".importlinter"), "--no-cache", *only], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def lint_tests(root: Path) -> subprocess.CompletedProcess[str]:
    """.importlinter-tests over the tests package found under `root`."""
    return subprocess.run([LINT, str(TESTS_CONFIG), "--no-cache"], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_contracts_are_kept() -> None:
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(CONTRACTS)} kept, 0 broken" in result.stdout


def test_no_test_module_imports_another_or_a_conftest() -> None:
    result = lint_tests(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("path", "line", "imported"), [
    ("unit/operator/test_events.py", "from tests.unit.operator.test_planner import NOW", "tests.unit.operator.test_planner"),
    ("integration/router/test_router_http.py", "from tests.unit.connector.router.test_router_discovery import test_no_conditions_is_not_ready",
     "tests.unit.connector.router.test_router_discovery"),
    ("e2e/test_events.py", "from tests.e2e.test_operator import custom", "tests.e2e.test_operator"),
    ("unit/operator/render/test_render.py", "from tests.conftest import example", "tests.conftest"),
    ("e2e/test_operator.py", "from tests.e2e.conftest import Cluster", "tests.e2e.conftest"),
    ("fixtures/planner.py", "from tests.unit.operator import test_status", "tests.unit.operator.test_status"),
], ids=["unit-from-unit", "integration-from-unit", "e2e-from-e2e", "unit-from-conftest", "e2e-from-e2e-conftest",
        "fixtures-from-unit"])  # fmt: skip
def test_a_test_module_importing_another_breaks_the_tests_contract(path: str, line: str, imported: str, tmp_path: Path) -> None:
    """On a copy of tests/ (its Python files only): kept as it is, broken by one import of a test module or a conftest."""
    shutil.copytree(REPO / "tests", tmp_path / "tests", ignore=lambda folder, names: [
        n for n in names if not n.endswith(".py") and not (Path(folder) / n).is_dir() or n == "__pycache__"])  # fmt: skip
    assert lint_tests(tmp_path).returncode == 0
    target = tmp_path / "tests" / path
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    result = lint_tests(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout + result.stderr
    assert f"{imported}:" in result.stdout.split("Broken contracts", 1)[1], result.stdout


def test_every_contract_has_a_breaking_import() -> None:
    assert sorted(BREAKS) == sorted(CONTRACTS)


@pytest.mark.parametrize("contract", sorted(BREAKS))
def test_a_forbidden_import_breaks_its_contract(contract: str, tmp_path: Path) -> None:
    for folder, package in PACKAGES.items():
        shutil.copytree(REPO / folder / package, tmp_path / folder / package, ignore=shutil.ignore_patterns("__pycache__"))
    path, line = BREAKS[contract]
    target = tmp_path / path
    assert lint(tmp_path, contract).returncode == 0  # the copy keeps it, until the line goes in
    target.write_text(target.read_text() + f"\n{line}\n")
    result = lint(tmp_path, contract)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout + result.stderr


def _layers(contract: str) -> list[set[str]]:
    raw = CONFIG[f"importlinter:contract:{contract}"]["layers"].strip().splitlines()
    return [set(re.split(r"\s*[|:]\s*", layer.strip())) for layer in raw]


def _readme_layers(folder: str) -> list[set[str]]:
    """The module groups the README's Layout lists under ``folder/``, in order: one indented line each."""
    block = (REPO / "README.md").read_text().split("## Layout", 1)[1].split("```")[1]
    layers: list[set[str]] = []
    inside = False
    for line in block.splitlines():
        if not line.startswith(" "):
            inside = line.startswith(f"{folder}/")
            continue
        names = re.match(r"^  (\w+(?:\.py|/)(?: \w+(?:\.py|/))*)(?:\s{2,}|$)", line)
        if inside and names:
            layers.append({name.removesuffix(".py").removesuffix("/") for name in names.group(1).split()})
    return layers


@pytest.mark.parametrize(("folder", "contract"), [("operator/disagg_operator", "operator-layers"),
                                                  ("connector/disagg_connector", "data-plane-layers")])  # fmt: skip
def test_the_readme_layout_lists_the_layers(folder: str, contract: str) -> None:
    assert _readme_layers(folder) == _layers(contract)
