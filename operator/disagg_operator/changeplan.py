"""What a change to a DisaggregatedModel will do, for review before it is applied (`disagg-operator plan`).

Pure: two parsed models in, a `ChangePlan` out. It answers what a GitOps reviewer asks of a diff:

- **A new revision or not, and why.** The revision is the renderer's own (`render(...).revision`); every
  changed spec field is listed, each with whether changing it alone makes a new revision.
- **The rollout steps.** `rollout.next_step`, the arithmetic the planner runs, from the current revision at
  full size, assuming every pod a step creates becomes ready before the next step and every pod a step
  retires is gone by then: the fastest schedule the budgets allow (a real rollout takes the same steps or
  more, never more pods at once). A change of replicas only is one step without a new revision.
- **Peak pods and accelerators per role** during the change (a step's new pods are counted before the old
  ones it retires are gone), and the same for the state before and after.

Roles are the engine roles; the router is a plain Deployment rolled by Kubernetes and holds no accelerator.
Sizes are `spec.<role>.replicas` (an autoscaler's current size is not in a manifest).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

import jinja2

from disagg_connector import contract

from . import resolve, rollout
from .api.models import DEFAULT_VLLM_VERSION, DisaggregatedModel, EngineShape, RoleSpec
from .api.validation import SpecError, parse
from .config import RenderDefaults
from . import gangs
from .render import render

ROLES = tuple(contract.ENGINE_ROLES)
SCHEDULE = ("every pod a step creates is ready, and every pod it retires gone, before the next step: "
            "the fastest schedule the budgets allow")  # fmt: skip
# A rollout of one pod per step on 1000 replicas takes about 2000 steps; more means the arithmetic is stuck.
MAX_STEPS = 10_000
_ABSENT = object()


class RolloutStuck(RuntimeError):
    """rollout.next_step stopped moving before the rollout was done (a bug in the arithmetic)."""


@dataclass(frozen=True)
class FieldChange:
    path: str  # e.g. spec.engine.image
    before: Any  # None: not set
    after: Any
    new_revision_alone: bool | None  # None: the spec is not valid with this change alone


@dataclass(frozen=True)
class Usage:
    """Pods of one role and the accelerators they request (resource name -> devices)."""

    pods: int
    accelerators: Mapping[str, int]


@dataclass(frozen=True)
class Step:
    number: int
    sizes: Mapping[str, Mapping[str, int]]  # role -> revision -> desired pods once the step is done
    during: Mapping[str, Usage]  # role -> the most pods (and accelerators) while the step is carried out


@dataclass(frozen=True)
class ChangePlan:
    namespace: str
    name: str
    current_revision: str | None  # None: a first create
    new_revision: str
    new_revision_made: bool
    changes: tuple[FieldChange, ...]
    budgets: Mapping[str, rollout.Budget]
    steps: tuple[Step, ...]
    current: Mapping[str, Usage]
    final: Mapping[str, Usage]
    peak_pods: Mapping[str, int]
    peak_accelerators: Mapping[str, Mapping[str, int]]
    engines: Mapping[str, EngineShape]  # role -> how one engine of the new model lays out over pods
    gangs: str  # what its gangs need, or whether they will hold on the cluster looked at (gangs.outlook)
    vllm_version: str  # the release the new model's engines run
    vllm_version_kept: bool  # the spec names none: the release the live model runs (its status) is kept
    default_vllm_version: str  # what a new model that names no release runs with this operator
    schedule: str = SCHEDULE

    @property
    def create(self) -> bool:
        return self.current_revision is None

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "create": self.create}, indent=2, sort_keys=True) + "\n"

    def to_text(self) -> str:
        return _template("plan.txt.j2").render(plan=self, roles=ROLES)


class PlanError(ValueError):
    """Two models that are not one model's before and after."""


# --- the spec diff ----------------------------------------------------------------------------------


def _spec_tree(dm: DisaggregatedModel) -> dict[str, Any]:
    """The spec with every default filled in: a field set to its default is no change."""
    return dm.spec.model_dump(by_alias=True, mode="json", exclude_none=True)


def _path_text(keys: tuple[str, ...]) -> str:
    text = "spec"
    for key in keys:
        text += f'["{key}"]' if any(c in key for c in "./ ") else f".{key}"
    return text


def _leaf_changes(before: Any, after: Any, keys: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any, Any]]:
    """(keys, before, after) of every changed leaf; lists compare whole (their order matters to vLLM)."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(before.keys() | after.keys()):
            found += _leaf_changes(before.get(key, _ABSENT), after.get(key, _ABSENT), (*keys, key))
        return found
    return [] if before == after else [(keys, before, after)]


def _with_value(tree: dict[str, Any], keys: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(tree)
    node = out
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is _ABSENT:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return out


def _status_of(current: DisaggregatedModel | None) -> dict[str, Any] | None:
    """The live model's status (--from-cluster): a running model keeps its release (resolve.held_release)."""
    return current.status.model_dump(by_alias=True, exclude_none=True) if current is not None and current.status else None


def _revision(dm: DisaggregatedModel, defaults: RenderDefaults, status: Mapping[str, Any] | None) -> str:
    return render(dm, defaults, status).revision


def _revision_with(current: DisaggregatedModel, spec: dict[str, Any], defaults: RenderDefaults,
                   status: Mapping[str, Any] | None) -> str | None:  # fmt: skip
    doc = {"apiVersion": current.api_version, "kind": current.kind,
           "metadata": {"name": current.metadata.name, "namespace": current.metadata.namespace}, "spec": spec}  # fmt: skip
    try:
        return _revision(parse(doc), defaults, status)
    except (SpecError, ValueError):
        return None


def _changes(current: DisaggregatedModel, new: DisaggregatedModel, defaults: RenderDefaults,
             status: Mapping[str, Any] | None) -> tuple[FieldChange, ...]:  # fmt: skip
    before, after = _spec_tree(current), _spec_tree(new)
    revision = _revision(current, defaults, status)
    changes = []
    for keys, old, value in _leaf_changes(before, after):
        alone = _revision_with(current, _with_value(before, keys, value), defaults, status)
        changes.append(FieldChange(
            path=_path_text(keys), before=None if old is _ABSENT else old, after=None if value is _ABSENT else value,
            new_revision_alone=None if alone is None else alone != revision))  # fmt: skip
    return tuple(changes)


# --- the rollout ------------------------------------------------------------------------------------


def _role(dm: DisaggregatedModel, role: str) -> RoleSpec:
    return getattr(dm.spec, role)


def _usage(engines_by_model: list[tuple[DisaggregatedModel, int]], role: str) -> Usage:
    """The pods and accelerators of so many engines of a role, each model's engines in its own shape."""
    devices: dict[str, int] = {}
    pods = 0
    for dm, engines in engines_by_model:
        spec = _role(dm, role)
        resource = contract.ACCELERATOR_RESOURCES[spec.accelerator.type]
        devices[resource] = devices.get(resource, 0) + engines * spec.shape.accelerators
        pods += engines * spec.shape.pods
    return Usage(pods=pods, accelerators=devices)


def _budgets(new: DisaggregatedModel) -> dict[str, rollout.Budget]:
    return {r: rollout.budget(_role(new, r).replicas, getattr(new.spec.rollout, r).max_surge,
                              getattr(new.spec.rollout, r).max_unavailable) for r in ROLES}  # fmt: skip


def _simulate(
    budgets: Mapping[str, rollout.Budget], start_new: Mapping[str, int], start_old: Mapping[str, int] | None
) -> list[tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, int]]]:
    """[(new before, new after, old before, old after)] per step, pods becoming ready at once."""
    new = {r: rollout.Count(start_new[r], start_new[r]) for r in ROLES}
    old = {"old": {r: rollout.Count(start_old[r], start_old[r]) for r in ROLES}} if start_old else {}
    steps = []
    for _ in range(MAX_STEPS):
        step = rollout.next_step(budgets, new, old, tuple(old))
        new_after = {r: step.new[r] for r in ROLES}
        old_after = {r: step.old["old"][r] for r in ROLES} if old else {r: 0 for r in ROLES}
        new_before = {r: new[r].desired for r in ROLES}
        old_before = {r: old["old"][r].desired for r in ROLES} if old else {r: 0 for r in ROLES}
        if new_after == new_before and old_after == old_before:
            if step.done(budgets):
                return steps
            raise RolloutStuck(f"rollout.next_step stays at new {new_after}, old {old_after} short of {dict(budgets)}")
        steps.append((new_before, new_after, old_before, old_after))
        new = {r: rollout.Count(new_after[r], new_after[r]) for r in ROLES}
        old = {"old": {r: rollout.Count(old_after[r], old_after[r]) for r in ROLES}} if any(old_after.values()) else {}
    raise RolloutStuck(f"no end after {MAX_STEPS} steps")


def _peak(usages: list[Usage]) -> tuple[int, dict[str, int]]:
    devices: dict[str, int] = {}
    for usage in usages:
        for resource, count in usage.accelerators.items():
            devices[resource] = max(devices.get(resource, 0), count)
    return max(u.pods for u in usages), devices


def change_plan(current: DisaggregatedModel | None, new: DisaggregatedModel, defaults: RenderDefaults) -> ChangePlan:
    if current is not None and (current.metadata.namespace, current.metadata.name) != (new.metadata.namespace, new.metadata.name):
        raise PlanError(f"the current model is {current.metadata.namespace}/{current.metadata.name} and the new one "
                        f"{new.metadata.namespace}/{new.metadata.name}: a plan compares one model before and after")  # fmt: skip
    status = _status_of(current)
    rendered = render(new, defaults, status)
    new_revision = rendered.revision
    current_revision = _revision(current, defaults, status) if current is not None else None
    rolls = current is not None and current_revision != new_revision
    sizes_now = {r: _role(current, r).replicas if current is not None else 0 for r in ROLES}
    budgets = _budgets(new)
    simulated = _simulate(budgets, {r: 0 for r in ROLES} if rolls else sizes_now, sizes_now if rolls else None)

    old_model = current if current is not None else new  # old pods exist only when there is a current model
    steps = []
    for number, (new_before, new_after, old_before, old_after) in enumerate(simulated, start=1):
        sizes = {r: {new_revision: new_after[r], **({current_revision: old_after[r]} if rolls else {})} for r in ROLES}
        during = {r: _usage([(new, max(new_before[r], new_after[r])), (old_model, max(old_before[r], old_after[r]))], r)
                  for r in ROLES}  # fmt: skip
        steps.append(Step(number, sizes, during))

    now = {r: _usage([(old_model, sizes_now[r])], r) for r in ROLES}
    final = {r: _usage([(new, budgets[r].target)], r) for r in ROLES}
    peaks = {r: _peak([now[r], final[r], *(s.during[r] for s in steps)]) for r in ROLES}
    return ChangePlan(
        namespace=new.metadata.namespace,
        name=new.metadata.name,
        current_revision=current_revision,
        new_revision=new_revision,
        new_revision_made=rolls,
        changes=_changes(current, new, defaults, status) if current is not None else (),
        budgets=budgets,
        steps=tuple(steps),
        current=now,
        final=final,
        peak_pods={r: peaks[r][0] for r in ROLES},
        peak_accelerators={r: peaks[r][1] for r in ROLES},
        engines={r: _role(new, r).shape for r in ROLES},
        gangs=gangs.outlook(new)[1],
        vllm_version=rendered.plan.vllm_version,
        vllm_version_kept=resolve.held_release(new.spec, status) is not None,
        default_vllm_version=DEFAULT_VLLM_VERSION[new.spec.prefill.accelerator.type],
    )


# --- text -------------------------------------------------------------------------------------------


def _template(name: str) -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("disagg_operator", "templates"),
        undefined=jinja2.StrictUndefined,  # a misspelled field fails the render, never prints nothing
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # plain text for a terminal or a review comment
    )
    env.filters["value"] = lambda v: "(not set)" if v is None else json.dumps(v)
    env.filters["devices"] = lambda d: ", ".join(f"{n} {r}" for r, n in sorted(d.items())) or "no accelerators"
    env.filters["pods"] = lambda n: f"{n} pod" if n == 1 else f"{n} pods"
    return env.get_template(name)
