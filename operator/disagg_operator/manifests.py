"""YAML in and out, the way people read manifests: multi-document, no anchors, stable key order."""

from __future__ import annotations

from typing import Any, Iterable

import yaml


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_all(objects: Iterable[dict[str, Any]]) -> str:
    return yaml.dump_all(list(objects), Dumper=_NoAliasDumper, sort_keys=False, width=120)


def load_all(text: str) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]
