"""`disagg-operator run` with a port it cannot serve exits at once with the port and the flag to change, before
any cluster access (the kubeconfig points at a port nothing listens on); a failed e2e start leaves no process;
one that cannot reach the API server is not healthy; an e2e operator dies with the session that started it."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.fixtures.e2e.waiting import wait_for
from tests.fixtures.models import REPO
from disagg_bench import operator_process
from disagg_bench.operator_process import OperatorProcess
from disagg_bench.ports import free_port

FAIL_WITHIN_S = 5


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the test's length."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.fixture
def nowhere_kubeconfig(tmp_path: Path) -> Path:
    """A cluster that cannot be reached: any API access would hang in retries, not fail fast."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "nowhere",
        "clusters": [{"name": "nowhere", "cluster": {"server": f"https://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "nobody", "user": {"token": "none"}}],
        "contexts": [{"name": "nowhere", "context": {"cluster": "nowhere", "user": "nobody"}}],
    }))  # fmt: skip
    return path


def run_operator(kubeconfig: Path, *args: str) -> tuple[int, str]:
    env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}  # no in-cluster config
    proc = subprocess.Popen([sys.executable, "-m", "disagg_operator.cli", "run", "--standalone", *args], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=FAIL_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"still running after {FAIL_WITHIN_S} s:\n{stderr[-3000:]}")
    return proc.returncode, stderr


def test_taken_metrics_port_exits_at_once_naming_it_and_the_flag(taken_port: int, nowhere_kubeconfig: Path) -> None:
    code, stderr = run_operator(nowhere_kubeconfig, "--metrics-port", str(taken_port), "--metrics-address", "127.0.0.1",
                                "--liveness", f"http://127.0.0.1:{free_port()}/healthz")  # fmt: skip
    assert code != 0
    (line,) = stderr.splitlines()  # one line, no traceback
    assert f"127.0.0.1:{taken_port}" in line and "--metrics-port" in line, line


def test_taken_liveness_port_exits_at_once_naming_it_and_the_flag(taken_port: int, nowhere_kubeconfig: Path) -> None:
    code, stderr = run_operator(nowhere_kubeconfig, "--metrics-port", "0", "--liveness", f"http://0.0.0.0:{taken_port}/healthz")
    assert code != 0
    (line,) = stderr.splitlines()
    assert f"0.0.0.0:{taken_port}" in line and "--liveness" in line, line


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[Any]]:
    """Every process OperatorProcess starts during the test."""
    procs: list[subprocess.Popen[Any]] = []

    class Recorded(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            procs.append(self)

    monkeypatch.setattr(operator_process.subprocess, "Popen", Recorded)
    return procs


def test_e2e_start_that_fails_says_why(
    taken_port: int, nowhere_kubeconfig: Path, tmp_path: Path, started: list[subprocess.Popen[Any]]
) -> None:
    op = OperatorProcess(str(nowhere_kubeconfig), tmp_path)
    op.metrics_port = taken_port
    with pytest.raises(RuntimeError, match=r"(?s)exited with 3.*--metrics-port"):
        op.start(timeout=30)
    assert not op.alive() and [p.returncode for p in started] == [3]


def test_e2e_start_that_never_goes_live_stops_the_process(tmp_path: Path, started: list[subprocess.Popen[Any]]) -> None:
    def hangs(liveness_url: str, metrics_port: int) -> list[str]:  # serves nothing, never exits
        return [sys.executable, "-c", "import time; time.sleep(600)"]

    op = OperatorProcess(str(tmp_path / "no-kubeconfig"), tmp_path, command=hangs)
    with pytest.raises(RuntimeError, match="not live after 1 s"):
        op.start(timeout=1)
    (proc,) = started
    assert proc.returncode is not None and not op.alive()



def test_an_operator_that_cannot_reach_the_api_server_is_not_healthy(nowhere_kubeconfig: Path) -> None:
    """It starts and serves /healthz (the chart's startup, readiness and liveness probes), which answers 500 while
    no API server answers: the pod goes unready and is restarted, never healthy while every request fails (as on
    a real node whose pods had no route to the `kubernetes` Service)."""
    url = f"http://127.0.0.1:{free_port()}/healthz"
    env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(nowhere_kubeconfig), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "disagg_operator.cli", "run", "--standalone", "--liveness", url,
                             "--metrics-port", "0"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip

    def answer() -> int | None:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:  # not serving yet
            return None

    try:
        status = wait_for("the operator's /healthz to answer", answer, timeout=60, retry_on=())
        assert status == 500, status
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "apiserver" in stderr and "failed" in stderr, stderr[-3000:]


# A stand-in operator: answers its liveness URL (the port argv[1]) with 200 and does nothing else.
SERVES_LIVENESS = """
import http.server, sys
class Live(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Live).serve_forever()
"""

# A test session that starts an operator, says its pid, and waits to be killed.
SESSION = """
import sys, threading
from pathlib import Path
from disagg_bench.operator_process import OperatorProcess
def serves(liveness_url, metrics_port):
    return [sys.executable, "-c", sys.argv[2], liveness_url.rsplit(":", 1)[1].split("/")[0]]
op = OperatorProcess("nowhere", Path(sys.argv[1]), command=serves).start(timeout=30)
print(op.proc.pid, flush=True)
threading.Event().wait()
"""


def running(pid: int) -> bool:
    """A process that has not exited (a zombie nobody reaped yet has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_e2e_operator_dies_with_the_session_that_started_it_however_that_ends(tmp_path: Path) -> None:
    """A CI run stopped from outside (SIGKILL to pytest) must not leave its operator reconciling the cluster that
    the next run reuses: two operators then fight over every model."""
    session = subprocess.Popen([sys.executable, "-c", SESSION, str(tmp_path), SERVES_LIVENESS], cwd=REPO,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert session.stdout is not None
        pid = int(session.stdout.readline())
        assert running(pid), "the operator is up while its session lives"
        session.kill()
        session.wait()
        wait_for("the operator to exit once its session was killed", lambda: not running(pid), timeout=30)
    finally:
        session.kill()
