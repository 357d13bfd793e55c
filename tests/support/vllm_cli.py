"""Ask vLLM itself (0.33.0, or another release with pins in hack/) whether rendered `vllm serve`
command lines are valid.

Runs in the project venv. Each vLLM release lives in its own cached CPU venv (`hack/vllm-env.sh
VERSION`); the judging happens in tests/support/vllm_cli_check.py, run with that venv's python, one
process for a whole batch (importing vLLM takes ~10 s).

    from tests.support.vllm_cli import check_command_lines
    [res] = check_command_lines([{"id": "p", "argv": ["vllm", "serve", "Qwen/Qwen3-32B", ...]}], "0.26.0")
    assert res["ok"], res["error"]

Set DISAGG_VLLM_PYTHON_<VERSION> (dots as underscores, e.g. DISAGG_VLLM_PYTHON_0_26_0) to use an
existing python with that vLLM release instead of the script.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
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


def check_command_lines(items: list[dict[str, Any]], version: str, timeout: float = 900) -> list[dict[str, Any]]:
    """Judge each {"id", "argv"} with vLLM `version`'s parser; returns one result per item, same order.

    A result: {"id", "ok", "error", "stage", "warnings", "parsed"}; see vllm_cli_check.py.
    """
    if not items:
        return []
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run(
        [vllm_python(version), str(CHECK_SCRIPT)],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO),
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"vllm_cli_check.py failed (exit {proc.returncode}):\n{_tail(proc.stderr)}")
    try:
        results = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"vllm_cli_check.py wrote no JSON ({e}):\n{proc.stdout[-2000:]}\n{_tail(proc.stderr)}") from e
    if [r.get("id") for r in results] != [i.get("id") for i in items]:
        raise RuntimeError("vllm_cli_check.py answered for other ids than asked")
    return results
