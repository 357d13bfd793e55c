"""What GitOps tools make of a DisaggregatedModel: Argo CD's verdict from the chart's health.lua, run by a
real Lua 5.1 (lupa) set up as Argo CD sets up its VM, and Flux's from the real kstatus library
(`sigs.k8s.io/cli-utils/pkg/kstatus/status.Compute`, a helper binary hack/cluster.sh builds from the Go
module proxy). A missing helper is a test failure that says how to build it, never a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Iterable

from lupa import lua51

REPO = Path(__file__).resolve().parents[2]
HEALTH_LUA = REPO / "charts" / "disagg-operator" / "files" / "argocd-health.lua"
CLUSTER_SH = REPO / "hack" / "cluster.sh"
# Argo CD's health statuses (gitops-engine pkg/health); anything else it turns into Unknown.
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}
# Argo CD runs configured health scripts with SkipOpenLibs and then opens only package, base, table and a
# safe os (argo-cd util/lua/lua.go, runLua); this script must need nothing else, so the test VM has less.
_NOT_IN_ARGO = ("string", "math", "io", "os", "debug", "coroutine", "python", "require", "dofile", "loadfile", "load")


@dataclass(frozen=True)
class Verdict:
    status: str
    message: str


def _argo_vm(obj: dict[str, Any]) -> lua51.LuaRuntime:
    lua = lua51.LuaRuntime(register_eval=False, register_builtins=False)
    lua.execute('debug.setmetatable("", nil)')  # without the string library strings have no methods either
    g = lua.globals()
    for name in _NOT_IN_ARGO:
        g[name] = None
    # JSON as Argo CD hands it over (decodeValue): objects and arrays become tables, null becomes nil.
    g.obj = lua.table_from(json.loads(json.dumps(obj)), recursive=True)
    return lua


def argocd_health(obj: dict[str, Any]) -> Verdict:
    result = _argo_vm(obj).execute(HEALTH_LUA.read_text())
    status, message = result["status"], result["message"]
    assert status in ARGO_STATUSES, f"health.lua returned {status!r}, which Argo CD shows as Unknown"
    assert isinstance(message, str), f"health.lua returned message {message!r}"
    return Verdict(status, message)


class KstatusMissing(RuntimeError):
    pass


@cache
def kstatus_binary() -> str:
    explicit = os.environ.get("DISAGG_KSTATUS")
    path = Path(explicit or subprocess.run(["bash", str(CLUSTER_SH), "path", "kstatus"], check=True,
                                           capture_output=True, text=True).stdout.strip())  # fmt: skip
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise KstatusMissing(f"the kstatus helper is not at {path}: build it with `bash hack/cluster.sh build` "
                             "(hack/setup.sh does)")  # fmt: skip
    return str(path)


def kstatus(objs: Iterable[dict[str, Any]]) -> list[Verdict]:
    """kstatus.Compute of each object, in one run of the helper."""
    lines = "".join(json.dumps(o) + "\n" for o in objs)
    out = subprocess.run([kstatus_binary()], input=lines, capture_output=True, text=True, check=True, timeout=60).stdout
    verdicts = []
    for line in out.splitlines():
        result = json.loads(line)
        assert "error" not in result, f"kstatus.Compute refused an object: {result['error']}"
        verdicts.append(Verdict(result["status"], result.get("message", "")))
    return verdicts
