"""Cross-field rules written once, in CEL, and enforced twice: by the API server and by us.

Each rule is attached to the pydantic model it constrains (`cel_rules`). The CRD generator copies it into
that node's `x-kubernetes-validations`, so the API server refuses a bad object at admission; the
operator and `disagg-operator validate` evaluate the very same expression with cel-python, so a spec that
slipped past admission (an older CRD, a dry run without a cluster) gets the same message. There is no
second, hand-written copy of any rule to drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any

import celpy
from celpy import celtypes

from ..quantity import parse_quantity


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` entry.

    `field_path` is relative to the node the rule sits on (".kvTransfer.mode"), as the API server wants
    it; the message says what to change, because it is all the user sees.
    """

    rule: str
    message: str
    field_path: str | None = None
    reason: str = "FieldValueInvalid"

    def to_schema(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message, "reason": self.reason}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


class Quantity(celtypes.StringType):
    """A Kubernetes quantity as the API server's CEL quantity library sees it (compared by value)."""

    @property
    def value(self) -> Decimal:
        return parse_quantity(str(self))


def _is_quantity(text: celtypes.StringType) -> celtypes.BoolType:
    try:
        parse_quantity(str(text))
    except ValueError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _compare_to(left: Quantity, right: Quantity) -> celtypes.IntType:
    a, b = left.value, right.value
    return celtypes.IntType((a > b) - (a < b))


# The part of the Kubernetes CEL libraries our rules use (the API server has them built in; cel-python
# does not): the strings extension's replace/split and the quantity library. Each is tested against the
# API server's own verdict by the e2e admission cases.
KUBERNETES_FUNCTIONS = {
    "replace": lambda text, old, new: celtypes.StringType(str(text).replace(str(old), str(new))),
    "split": lambda text, sep: celtypes.ListType([celtypes.StringType(p) for p in str(text).split(str(sep))]),
    "quantity": lambda text: Quantity(str(text)),
    "isQuantity": _is_quantity,
    "compareTo": _compare_to,
}


@lru_cache(maxsize=None)
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule), functions=KUBERNETES_FUNCTIONS)


# The API server names a property that is a CEL reserved word `__<word>__` in rules (apiserver/pkg/cel/escaping.go):
# a rule reads a Gateway reference's namespace as `__namespace__`, and an unescaped one is refused as too costly.
CEL_RESERVED = frozenset({"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function",
                          "if", "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"})


def _escaped(node: Any) -> Any:
    if isinstance(node, dict):
        return {(f"__{k}__" if k in CEL_RESERVED else k): _escaped(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_escaped(v) for v in node]
    return node


def holds(rule: CelRule, node: dict[str, Any]) -> bool:
    """Evaluate a rule against a node as the API server would see it (JSON, defaults applied, reserved words
    escaped; map keys too here, which the API server leaves alone: no rule reads a map key that is a reserved word)."""
    result = _program(rule.rule).evaluate({"self": celpy.json_to_cel(_escaped(node))})
    if isinstance(result, Exception):  # celpy returns evaluation errors as values
        raise ValueError(f"CEL rule {rule.rule!r} failed to evaluate: {result}")
    return bool(result)
