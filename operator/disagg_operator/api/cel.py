"""Cross-field rules written once, in CEL, and enforced twice: by the API server and by us.

Each rule is attached to the pydantic model it constrains (`cel_rules`). The CRD generator copies it into
that node's `x-kubernetes-validations`, so the API server refuses a bad object at admission; the
operator and `disagg-operator validate` evaluate the very same expression with cel-python, so a spec that
slipped past admission (an older CRD, a dry run without a cluster) gets the same message. There is no
second, hand-written copy of any rule to drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import celpy


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


@lru_cache(maxsize=None)
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def holds(rule: CelRule, node: dict[str, Any]) -> bool:
    """Evaluate a rule against a node as the API server would see it (JSON, defaults applied)."""
    result = _program(rule.rule).evaluate({"self": celpy.json_to_cel(node)})
    if isinstance(result, Exception):  # celpy returns evaluation errors as values
        raise ValueError(f"CEL rule {rule.rule!r} failed to evaluate: {result}")
    return bool(result)
