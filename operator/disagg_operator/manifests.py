"""YAML in and out, the way people read manifests: multi-document, no anchors, stable key order."""

from __future__ import annotations

from typing import Any, Iterable

import re

import yaml


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


# YAML 1.2 parsers (kubectl, helm, Argo CD) read "1e10", "0123" and "0o17" as numbers; PyYAML (YAML 1.1)
# does not, and so would leave such strings unquoted. A hash like "8132e40521" or "0109345567" must stay a
# string label.
_NoAliasDumper.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)
_NoAliasDumper.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+)$"), list("-+0123456789")
)


def dump_all(objects: Iterable[dict[str, Any]]) -> str:
    return yaml.dump_all(list(objects), Dumper=_NoAliasDumper, sort_keys=False, width=120)


def load_all(text: str) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]
