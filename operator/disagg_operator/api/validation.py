"""Parse a DisaggregatedModel and report every problem with its field path.

Two layers, one report: pydantic checks types, ranges and unknown fields; the CEL rules attached to the
models (the same ones the API server enforces from the CRD) check what spans several fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from pydantic import BaseModel, ValidationError

from .cel import holds
from .models import ApiModel, DisaggregatedModel


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(ValueError):
    """A DisaggregatedModel that cannot be served as written; `problems` says what to change."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def _loc_to_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "<root>"


def _pydantic_problems(error: ValidationError) -> list[Problem]:
    problems = []
    for item in error.errors(include_url=False):
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field: remove it or check its spelling (fields are camelCase)"
        elif item["type"] == "missing":
            message = "required field is missing"
        problems.append(Problem(_loc_to_path(tuple(item["loc"])), message))
    return problems


def _models_with_paths(model: BaseModel, path: str) -> Iterator[tuple[ApiModel, str]]:
    if isinstance(model, ApiModel):
        yield model, path
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        child_path = f"{path}.{field.alias or name}"
        if isinstance(value, BaseModel):
            yield from _models_with_paths(value, child_path)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _models_with_paths(item, f"{child_path}[{index}]")


def rule_problems(dm: DisaggregatedModel) -> list[Problem]:
    # The root rules see what the API server lets CEL see of metadata: the name.
    root = {"metadata": {"name": dm.metadata.name}}
    problems = [Problem("metadata.name", r.message) for r in dm.cel_rules if not holds(r, root)]
    for model, path in _models_with_paths(dm.spec, "spec"):
        if not model.cel_rules:
            continue
        node = model.model_dump(by_alias=True, mode="json", exclude_none=True)
        for rule in model.cel_rules:
            if not holds(rule, node):
                problems.append(Problem(path + (rule.field_path or ""), rule.message))
    return problems


def parse(obj: Any) -> DisaggregatedModel:
    """A valid DisaggregatedModel, or SpecError listing every problem found."""
    if not isinstance(obj, dict):
        raise SpecError([Problem("<root>", "a DisaggregatedModel must be a YAML/JSON object")])
    try:
        dm = DisaggregatedModel.model_validate(obj)
    except ValidationError as error:
        raise SpecError(_pydantic_problems(error)) from None
    problems = rule_problems(dm)
    if problems:
        raise SpecError(problems)
    return dm
