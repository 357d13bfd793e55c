"""The layering is a test, not a convention: import-linter checks the contracts in .importlinter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO

LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{root / 'operator'}:{root / 'connector'}"}
    return subprocess.run([LINT, "--config", str(REPO / ".importlinter"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_contracts_are_kept() -> None:
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def test_a_pure_module_that_imports_the_client_breaks_a_contract(tmp_path: Path) -> None:
    for package in ("operator", "connector"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    status = tmp_path / "operator" / "disagg_operator" / "status.py"
    status.write_text(status.read_text() + "\nfrom .kube import Cluster  # a pure module doing I/O\n")
    result = lint(tmp_path)
    assert result.returncode != 0 and "pure" in result.stdout and "BROKEN" in result.stdout, result.stdout
