"""What the operator knows of the cluster without asking: kopf's in-memory indexes, fed by one watch per
kind (kopf's "use indexing instead of talking to the cluster API", docs/reconciliation.rst).

handlers.py registers one index per watched kind; each keeps, per (namespace, model label), a slim copy of
every object of that kind carrying our managed-by label (no managedFields, and of a pod only what status
and retirement read). kopf fills every index from its initial listing before any handler runs, and
updates an index before the handlers of the event that changed it, so a pass triggered by an event sees
that event. A steady-state pass therefore reads nothing from the API server.

Workers read the indexes from their own threads. Each read copies one index entry into a list, which
CPython does without letting the event loop thread run in between (a dict's values iterated by a C
loop), so a read never sees an entry half-updated.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Mapping, Protocol

from disagg_connector import contract

from .state import Key, Obj, controlled_by, key_of

MODELS_INDEX = "models"
MODEL_NAMES_INDEX = "model_names"
PODS_INDEX = "pods"
CHILD_INDEX_PREFIX = "children_"

_POD_STATUS_FIELDS = ("phase", "podIP", "conditions", "containerStatuses", "initContainerStatuses")
_POD_META_FIELDS = ("name", "namespace", "uid", "labels", "annotations", "creationTimestamp", "deletionTimestamp",
                    "ownerReferences", "resourceVersion")


def slim(body: Mapping[str, Any]) -> Obj:
    """A child as the planner compares it: everything but managedFields (the largest part, never read)."""
    out = {k: copy.deepcopy(body[k]) for k in ("apiVersion", "kind", "metadata", "spec", "status", "rules", "roleRef",
                                               "subjects") if k in body}
    out.get("metadata", {}).pop("managedFields", None)
    return out


def _slim_pod_spec(spec: Mapping[str, Any]) -> Obj:
    """What decisions read of a pod's spec: its node, its PodGroup, and what its containers ask for (the
    accelerators a partly bound gang holds: gangs.membership)."""
    out: Obj = {"nodeName": spec.get("nodeName")}
    if "schedulingGroup" in spec:
        out["schedulingGroup"] = copy.deepcopy(spec["schedulingGroup"])
    out["containers"] = [{"name": c.get("name"), "resources": copy.deepcopy(c.get("resources") or {})} for c in spec.get("containers") or []]
    return out


def slim_pod(body: Mapping[str, Any]) -> Obj:
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    return {
        "kind": "Pod",
        "metadata": {k: copy.deepcopy(meta[k]) for k in _POD_META_FIELDS if k in meta},
        "spec": _slim_pod_spec(body.get("spec") or {}),
        "status": {k: copy.deepcopy(status[k]) for k in _POD_STATUS_FIELDS if k in status},
    }


def index_key(namespace: str | None, labels: Mapping[str, str]) -> tuple[str, str]:
    return namespace or "", labels.get(contract.LABEL_MODEL, "")


class Cache(Protocol):
    def model(self, namespace: str, name: str) -> Obj | None: ...
    def model_keys(self) -> list[tuple[str, str]]: ...
    def models_named(self, namespace: str, label: str) -> list[str]: ...
    def children(self, namespace: str, name: str, uid: str) -> dict[Key, Obj]: ...
    def pods(self, namespace: str, name: str) -> tuple[Obj, ...]: ...


class IndexCache:
    """The Cache over kopf's indexes; `bind` hands them over from the first handler call (kopf injects
    indexes into handlers only)."""

    def __init__(self) -> None:
        self._indexes: dict[str, Any] = {}
        self._bound = threading.Event()

    def bind(self, indexes: Mapping[str, Any]) -> None:
        if not self._bound.is_set():
            self._indexes = {k: v for k, v in indexes.items() if k in (MODELS_INDEX, MODEL_NAMES_INDEX, PODS_INDEX)
                             or k.startswith(CHILD_INDEX_PREFIX)}
            self._bound.set()

    def _entries(self, index: str, key: tuple[str, str]) -> list[Any]:
        store = self._indexes.get(index, {}).get(key)
        return list(store) if store is not None else []

    def model(self, namespace: str, name: str) -> Obj | None:
        found = self._entries(MODELS_INDEX, (namespace, name))
        return found[0] if found else None

    def model_keys(self) -> list[tuple[str, str]]:
        return list(self._indexes.get(MODELS_INDEX, {}).keys())

    def models_named(self, namespace: str, label: str) -> list[str]:
        return self._entries(MODEL_NAMES_INDEX, (namespace, label))

    def children(self, namespace: str, name: str, uid: str) -> dict[Key, Obj]:
        label = contract.model_label_value(name)
        found: dict[Key, Obj] = {}
        for index in self._indexes:
            if index.startswith(CHILD_INDEX_PREFIX):
                for obj in self._entries(index, (namespace, label)):
                    if controlled_by(obj, uid):  # a same-labelled object some other CR controls is not ours
                        found[key_of(obj)] = obj
        return found

    def pods(self, namespace: str, name: str) -> tuple[Obj, ...]:
        return tuple(self._entries(PODS_INDEX, (namespace, contract.model_label_value(name))))
