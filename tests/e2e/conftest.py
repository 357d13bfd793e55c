"""e2e fixtures: a real Kubernetes control plane for the tests in tests/e2e.

By default the session brings up the local control plane built from Go modules
(``hack/cluster.sh up``: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kwok with fake p5en/trn2/CPU nodes and the LeaderWorkerSet
controller, all on 127.0.0.1). If it
is already running it is reused. One session at a time per cluster (its state
dir): a second waits for the first to end.

Environment:
  DISAGG_E2E_USE_KUBECONFIG=1  use the cluster that KUBECONFIG (or ~/.kube/config)
                               points at; nothing is started or stopped. The
                               audit log is then taken from DISAGG_AUDIT_LOG if set.
  DISAGG_E2E_KEEP_CLUSTER=1    never stop the local control plane at session end.
                               Default: stop it only if this session started it.
  DISAGG_STATE / DISAGG_CACHE  passed through to hack/cluster.sh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from tests.fixtures.e2e.cluster import CLUSTER_SH, one_session_per_cluster
from tests.fixtures.e2e.operator import service_account_kubeconfig

REPO = Path(__file__).resolve().parents[2]
E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/e2e carries the ``e2e`` marker (one worker runs them all: tests/conftest.py)."""
    for item in items:
        if E2E_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _cluster_env() -> dict[str, str]:
    """`hack/cluster.sh env` as a dict (KUBECONFIG, PATH addition, DISAGG_AUDIT_LOG)."""
    out = subprocess.run(
        ["bash", str(CLUSTER_SH), "env"], check=True, capture_output=True, text=True
    ).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            env[key] = value
    return env


def _cached_kubectl(env: dict[str, str]) -> str | None:
    """The kubectl that hack/cluster.sh built, if it is there (else kubectl from PATH). ENV: `_cluster_env()`."""
    exe = Path(env.get("PATH", "").split(":")[0]) / "kubectl"
    return str(exe) if exe.is_file() and os.access(exe, os.X_OK) else None


@dataclass
class Cluster:
    """Handle on the cluster the e2e session runs against."""

    kubeconfig: str
    audit_log: str | None
    kubectl_path: str | None = None
    local: bool = True
    started_here: bool = False
    _clients: list = field(default_factory=list, repr=False)

    def api_client(self):
        """A new ``kubernetes.client.ApiClient`` configured from ``kubeconfig``.

        Clients made here are closed at session end.
        """
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        api = client.ApiClient(cfg)
        self._clients.append(api)
        return api

    def token_api_client(self, token: str):
        """An ApiClient that talks to the same server with a bearer token only."""
        from kubernetes import client

        base = self.api_client().configuration
        cfg = client.Configuration()
        cfg.host = base.host
        cfg.ssl_ca_cert = base.ssl_ca_cert
        cfg.verify_ssl = base.verify_ssl
        cfg.api_key = {"authorization": token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        api = client.ApiClient(cfg)
        self._clients.append(api)
        return api

    def kubectl(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        exe = self.kubectl_path or "kubectl"
        return subprocess.run(
            [exe, f"--kubeconfig={self.kubeconfig}", *args],
            check=check,
            capture_output=True,
            text=True,
            **kw,
        )

    def audit_events(self) -> list[dict]:
        """All audit events written so far (one JSON object per line)."""
        if not self.audit_log:
            raise RuntimeError("no audit log for this cluster (set DISAGG_AUDIT_LOG)")
        events = []
        path = Path(self.audit_log)
        if not path.exists():
            return events
        with path.open() as f:
            for line in f:
                line = line.strip()
                if line:
                    events.append(json.loads(line))
        return events

    def close(self) -> None:
        for api in self._clients:
            try:
                api.close()
            except Exception:  # pragma: no cover - best effort
                pass
        self._clients.clear()


def _run_cluster_sh(pytestconfig: pytest.Config, *args: str, check: bool = True) -> int:
    """Run hack/cluster.sh with its progress visible even under output capture."""
    capman = pytestconfig.pluginmanager.getplugin("capturemanager")
    cmd = ["bash", str(CLUSTER_SH), *args]
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print(f"\n[e2e] {' '.join(cmd)}", file=sys.stderr, flush=True)
            rc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr).returncode
    else:
        rc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr).returncode
    if check and rc != 0:
        pytest.fail(f"{' '.join(cmd)} failed with exit code {rc}", pytrace=False)
    return rc


@pytest.fixture(scope="session")
def cluster(pytestconfig: pytest.Config) -> Iterator[Cluster]:
    if _truthy("DISAGG_E2E_USE_KUBECONFIG"):
        kubeconfig = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
        kubeconfig = kubeconfig.split(os.pathsep)[0]
        if not Path(kubeconfig).exists():
            pytest.fail(f"DISAGG_E2E_USE_KUBECONFIG=1 but {kubeconfig} does not exist", pytrace=False)
        c = Cluster(
            kubeconfig=kubeconfig,
            audit_log=os.environ.get("DISAGG_AUDIT_LOG") or None,
            kubectl_path=_cached_kubectl(_cluster_env()),
            local=False,
        )
        yield c
        c.close()
        return

    env = _cluster_env()  # paths only: the same before and after `up`
    with one_session_per_cluster(Path(env["DISAGG_STATE"])):
        yield from _local_cluster(pytestconfig, env)


def _local_cluster(pytestconfig: pytest.Config, env: dict[str, str]) -> Iterator[Cluster]:
    already_up = (
        subprocess.run(["bash", str(CLUSTER_SH), "status"], capture_output=True).returncode == 0
    )
    if not already_up:
        _run_cluster_sh(pytestconfig, "up")
    c = Cluster(
        kubeconfig=env["KUBECONFIG"],
        audit_log=env.get("DISAGG_AUDIT_LOG"),
        kubectl_path=_cached_kubectl(env),
        local=True,
        started_here=not already_up,
    )
    try:
        yield c
    finally:
        c.close()
        if c.started_here and not _truthy("DISAGG_E2E_KEEP_CLUSTER"):
            _run_cluster_sh(pytestconfig, "down", check=False)


@pytest.fixture
def api_client(cluster: Cluster):
    """A fresh admin ApiClient for one test."""
    return cluster.api_client()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A throw-away namespace, deleted (with everything in it) after the test."""
    from kubernetes import client

    api = client.CoreV1Api(cluster.api_client())
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    # Pods are refused until the serviceaccount controller has made "default".
    deadline = time.monotonic() + 30
    while True:
        try:
            api.read_namespaced_service_account("default", name)
            break
        except client.ApiException as e:
            if e.status != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    try:
        yield name
    finally:
        try:
            api.delete_namespace(name, propagation_policy="Background")
        except client.ApiException as e:  # pragma: no cover - already gone
            if e.status != 404:
                raise


# --- the operator under test ------------------------------------------------------------------------

from disagg_connector import contract  # noqa: E402
from disagg_operator.api.crd import CRD_FILE  # noqa: E402

from disagg_bench.operator_process import OperatorProcess  # noqa: E402


@pytest.fixture(scope="session")
def crd_installed(cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds" / CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{contract.PLURAL}.{contract.API_GROUP}")


@pytest.fixture(scope="session")
def operator(cluster, crd_installed, tmp_path_factory) -> Iterator[OperatorProcess]:
    workdir = tmp_path_factory.mktemp("operator")
    proc = OperatorProcess(str(service_account_kubeconfig(cluster, workdir / "kubeconfig")), workdir)
    proc.start()
    yield proc
    proc.stop()


