"""A Cache over plain dicts, for the reconciler's table test (tests/unit/test_reconciler.py)."""

from __future__ import annotations

from typing import Iterable

from disagg_connector import contract
from disagg_operator.state import Key, Obj, controlled_by, key_of



class MemoryCache:
    """The operator's Cache (disagg_operator.cache) over plain dicts: the reconciler's world in its unit tests."""

    def __init__(self, models: Iterable[Obj] = (), objects: Iterable[Obj] = ()):
        self._models = {(m["metadata"]["namespace"], m["metadata"]["name"]): m for m in models}
        self._objects = list(objects)

    def model(self, namespace: str, name: str) -> Obj | None:
        return self._models.get((namespace, name))

    def model_keys(self) -> list[tuple[str, str]]:
        return list(self._models)

    def models_named(self, namespace: str, label: str) -> list[str]:
        return [n for (ns, n) in self._models if ns == namespace and contract.model_label_value(n) == label]

    def _of(self, namespace: str, name: str) -> list[Obj]:
        label = contract.model_label_value(name)
        return [o for o in self._objects if o["metadata"].get("namespace") == namespace
                and (o["metadata"].get("labels") or {}).get(contract.LABEL_MODEL) == label]

    def children(self, namespace: str, name: str, uid: str) -> dict[Key, Obj]:
        return {key_of(o): o for o in self._of(namespace, name) if o["kind"] != "Pod" and controlled_by(o, uid)}

    def pods(self, namespace: str, name: str) -> tuple[Obj, ...]:
        return tuple(o for o in self._of(namespace, name) if o["kind"] == "Pod")
