"""The operator as a separate process against the e2e cluster, restartable, with its log kept."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OperatorProcess:
    def __init__(self, kubeconfig: str, log_dir: Path, extra_env: dict[str, str] | None = None):
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"operator-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        port = free_port()
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, "PYTHONUNBUFFERED": "1", **self.extra_env}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg_operator.cli", "run", "--standalone",
             "--liveness", f"http://127.0.0.1:{port}/healthz"],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"operator not live after 60 s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
