"""The real `helm` that hack/cluster.sh builds from the helm.sh/helm/v3 Go module, for the chart tests.

Found at $DISAGG_HELM, else $DISAGG_CACHE/bin/helm-<version>/helm with the version of the `helm` line of
hack/cluster.sh's COMPONENTS. Missing helm is a test failure with the command that builds it, never a skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "disagg-operator"
CLUSTER_SH = REPO / "hack" / "cluster.sh"


class HelmMissing(RuntimeError):
    pass


def helm_version() -> str:
    match = re.search(r'^\s*"helm (v\S+) ', CLUSTER_SH.read_text(), re.MULTILINE)
    if not match:
        raise HelmMissing(f"no helm line in the COMPONENTS of {CLUSTER_SH}")
    return match.group(1)


@cache
def helm_binary() -> str:
    explicit = os.environ.get("DISAGG_HELM")
    cache_root = Path(os.environ.get("DISAGG_CACHE") or Path.home() / ".cache" / "disagg-operator")
    path = Path(explicit) if explicit else cache_root / "bin" / f"helm-{helm_version()}" / "helm"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise HelmMissing(
            f"helm not found at {path}: build it with `bash hack/cluster.sh build` (hack/setup.sh does), "
            "or point DISAGG_HELM at a helm v3 binary"
        )
    return str(path)


@cache
def _helm_home() -> dict[str, str]:
    """Private helm cache/config/data dirs: the tests never read or write the user's helm setup."""
    home = Path(tempfile.gettempdir()) / f"disagg-helm-{os.getuid()}"
    dirs = {"HELM_CACHE_HOME": home / "cache", "HELM_CONFIG_HOME": home / "config", "HELM_DATA_HOME": home / "data"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return {k: str(v) for k, v in dirs.items()}


@dataclass
class HelmResult:
    returncode: int
    stdout: str
    stderr: str

    def docs(self) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(self.stdout) if d]


def helm(*args: str, kubeconfig: str | None = None, check: bool = True, timeout: float = 300) -> HelmResult:
    env = {**os.environ, **_helm_home()}
    if kubeconfig:
        env["KUBECONFIG"] = kubeconfig
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env, timeout=timeout)
    result = HelmResult(proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}")
    return result


def values_args(values: dict[str, Any] | None, tmpdir: Path) -> list[str]:
    """`-f <file>` for a values dict (written as YAML into tmpdir)."""
    if not values:
        return []
    fd, name = tempfile.mkstemp(suffix=".yaml", dir=tmpdir)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(values, f)
    return ["-f", name]
