"""Ask vLLM itself (0.33.0, or another release with pins in hack/) whether rendered `vllm serve`
command lines are valid.

Runs in the project venv. Each vLLM release lives in its own cached CPU venv (`hack/vllm-env.sh
VERSION`); the judging happens in tests/support/vllm_cli_check.py, run with that venv's python, one
process per release for the whole session (importing vLLM takes 20-40 s).

    from tests.support.vllm_cli import check_command_lines
    [res] = check_command_lines([{"id": "p", "argv": ["vllm", "serve", "Qwen/Qwen3-32B", ...]}], "0.26.0")
    assert res["ok"], res["error"]

Set DISAGG_VLLM_PYTHON_<VERSION> (dots as underscores, e.g. DISAGG_VLLM_PYTHON_0_26_0) to use an
existing python with that vLLM release instead of the script.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENV_SCRIPT = REPO / "hack" / "vllm-env.sh"
CHECK_SCRIPT = Path(__file__).resolve().with_name("vllm_cli_check.py")
# The releases CI judges every rendered line with: one per pin file (hack/vllm-env-VERSION.requirements.txt),
# i.e. the operator's target and the release the GPU runs use.
CHECKED_VERSIONS = tuple(
    sorted(p.name.removeprefix("vllm-env-").removesuffix(".requirements.txt") for p in ENV_SCRIPT.parent.glob("vllm-env-*.requirements.txt"))
)


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


@functools.lru_cache(maxsize=None)
def vllm_python(version: str) -> str:
    """Path of the python of vLLM `version`'s venv; builds the venv on first use (cached per session)."""
    override = os.environ.get("DISAGG_VLLM_PYTHON_" + version.replace(".", "_"))
    if override:
        return override
    proc = subprocess.run(
        ["bash", str(ENV_SCRIPT), version],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{ENV_SCRIPT} failed (exit {proc.returncode}):\n{_tail(proc.stderr)}")
    path = lines[-1].strip()
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{ENV_SCRIPT} printed {path!r}, which is not an executable")
    return path


class _Checker:
    """vllm_cli_check.py --serve with one release's python: started at the first batch, kept for the session
    (importing vLLM takes 20-40 s, judging a line milliseconds; a dozen tests ask), one batch at a time. Its
    log (stderr) goes to a file, so nothing it prints can fill a pipe and stall it."""

    def __init__(self, version: str) -> None:
        self.log = Path(tempfile.mkstemp(prefix=f"vllm-cli-check-{version}-", suffix=".log")[1])
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([vllm_python(version), str(CHECK_SCRIPT), "--serve"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=str(REPO))  # fmt: skip
        self.lock = threading.Lock()

    def judge(self, items: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps(items) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise self._gone("took no batch") from None
            # One answer line per batch: between batches nothing is buffered, so select() on the pipe is exact.
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                self.stop()
                raise RuntimeError(f"vllm_cli_check.py did not answer within {timeout:g} s:\n{_tail(self.log.read_text())}")
            line = self.proc.stdout.readline()
            if not line:
                raise self._gone("answered nothing")
            return json.loads(line)

    def _gone(self, what: str) -> RuntimeError:
        self.stop()
        return RuntimeError(f"vllm_cli_check.py {what} (exit {self.proc.returncode}):\n{_tail(self.log.read_text())}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_CHECKERS: dict[str, _Checker] = {}


@atexit.register
def _stop_checkers() -> None:
    for checker in _CHECKERS.values():
        checker.stop()


def check_command_lines(items: list[dict[str, Any]], version: str, timeout: float = 900) -> list[dict[str, Any]]:
    """Judge each {"id", "argv"} with vLLM `version`'s parser; returns one result per item, same order.

    A result: {"id", "ok", "error", "stage", "warnings", "parsed"}; see vllm_cli_check.py.
    """
    if not items:
        return []
    checker = _CHECKERS.get(version)
    if checker is None or checker.proc.poll() is not None:
        checker = _CHECKERS[version] = _Checker(version)
    try:
        results = checker.judge(items, timeout)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"vllm_cli_check.py wrote no JSON ({e}):\n{_tail(checker.log.read_text())}") from e
    if [r.get("id") for r in results] != [i.get("id") for i in items]:
        raise RuntimeError("vllm_cli_check.py answered for other ids than asked")
    return results
