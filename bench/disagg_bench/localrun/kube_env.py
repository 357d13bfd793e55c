"""What the kubelet does to a container's env and command line, for a container started outside Kubernetes.

Pure functions. `expand` is Kubernetes' `$(VAR)` expansion (k8s.io/kubernetes
third_party/forked/golang/expansion): `$(NAME)` becomes the value of NAME when NAME is defined, stays as
written otherwise; `$$` is a literal `$`; a `$` before anything else, or an unterminated `$(`, stays.
`resolve_env` walks an env list in order the way the kubelet does: a value may refer only to entries
defined before it; Downward API fields come from the local values given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def expand(text: str, env: Mapping[str, str]) -> str:
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != "$" or i + 1 == n:
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":  # escaped
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:  # incomplete reference: kept as written
                out.append("$(")
                i += 2
                continue
            name = text[i + 2 : close]
            out.append(env[name] if name in env else f"$({name})")
            i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


class UnresolvableEnv(ValueError):
    """An env entry whose source does not exist outside a cluster (and was not supplied locally)."""


@dataclass(frozen=True)
class DownwardValues:
    """What the Downward API fields of one pod are, for a process started by hand."""

    pod_name: str
    pod_uid: str
    pod_ip: str
    namespace: str = "default"

    def field(self, path: str) -> str:
        values = {
            "metadata.name": self.pod_name,
            "metadata.uid": self.pod_uid,
            "metadata.namespace": self.namespace,
            "status.podIP": self.pod_ip,
            "status.hostIP": self.pod_ip,
        }
        if path not in values:
            raise UnresolvableEnv(f"Downward API field {path} has no local value")
        return values[path]


def resolve_env(
    entries: list[dict[str, Any]], downward: DownwardValues, secrets: Mapping[str, str]
) -> dict[str, str]:
    """The container's env as a dict, in the kubelet's order. A secretKeyRef takes the value of the
    env var of the same name from `secrets` (a local run passes its own environment); it is an error
    when that is absent and the reference is not optional."""
    env: dict[str, str] = {}
    for entry in entries:
        name = entry["name"]
        if "value" in entry:
            env[name] = expand(str(entry["value"]), env)
            continue
        source = entry.get("valueFrom") or {}
        if "fieldRef" in source:
            env[name] = downward.field(source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if name in secrets:
                env[name] = secrets[name]
            elif not ref.get("optional", False):
                raise UnresolvableEnv(
                    f"env {name} comes from Secret {ref.get('name')} key {ref.get('key')}: "
                    f"export {name} before the local run"
                )
        else:
            raise UnresolvableEnv(f"env {name}: source {sorted(source)} has no local equivalent")
    return env
