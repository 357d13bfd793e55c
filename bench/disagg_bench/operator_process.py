"""The operator as a separate process against the e2e cluster, restartable, with its log kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, Callable
from disagg_bench.ports import free_port

REPO = Path(__file__).resolve().parents[2]


# util-linux's, in every Linux base image; the start's parent-death signal (a pytest worker starts operators from its
# main thread, which lives as long as the worker: the signal is sent when the thread that started it ends)
SETPRIV = shutil.which("setpriv") or "setpriv"

# e2e runs resync often enough to be seen within a test (production default: 300 s).
E2E_RESYNC_SECONDS = 15


def default_command(liveness_url: str, metrics_port: int, resync_seconds: float = E2E_RESYNC_SECONDS) -> list[str]:
    return [sys.executable, "-m", "disagg_operator.cli", "run", "--standalone", "--liveness", liveness_url,
            "--metrics-port", str(metrics_port), "--metrics-address", "127.0.0.1",
            "--resync-seconds", str(resync_seconds)]  # fmt: skip


class OperatorProcess:
    """`command` gets the liveness URL and a free metrics port to serve and returns the argv (default: a
    standalone operator); the chart's e2e passes the chart Deployment's own command line instead."""

    def __init__(
        self,
        kubeconfig: str,
        log_dir: Path,
        extra_env: dict[str, str] | None = None,
        command: Callable[[str, int], list[str]] = default_command,
    ):
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.extra_env = extra_env or {}
        self.command = command
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"operator-{id(self):x}-{self.starts}.log"

    def start(self, timeout: float = 60) -> "OperatorProcess":
        """Started and live, or RuntimeError with its log; a failed start leaves no process behind."""
        self.starts += 1
        url = f"http://127.0.0.1:{free_port()}/healthz"
        venv_bin = str(Path(sys.executable).parent)  # console scripts (disagg-operator) of this venv
        env = {**os.environ, **self.extra_env, "KUBECONFIG": self.kubeconfig, "PYTHONUNBUFFERED": "1",
               "PATH": f"{venv_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"}  # fmt: skip
        self._log = self.log_path.open("wb")
        try:
            # it dies with the process that started it, however that one ends: a test session killed from outside
            # (a CI run stopped by hand) would otherwise leave an operator reconciling the cluster the next one reuses
            argv = [SETPRIV, "--pdeathsig", "TERM", "--", *self.command(url, self.metrics_port)]
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
            self._wait_live(url, timeout)
        except BaseException:  # a timeout, an early exit, or the test interrupted: stop what was started
            self.stop()
            raise
        return self

    def _wait_live(self, url: str, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"operator not live after {timeout:g} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log:
            self._log.close()
        self.proc, self._log = None, None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
