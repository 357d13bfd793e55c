"""Who sizes an engine role: one writer at a time, and the operator never undoes the others. Pure.

The size of a role lives in its DisaggregatedRole `<model>-<role>` (spec.replicas, the scale subresource),
whose name survives revisions. The rule for what the operator writes there:

- the DisaggregatedRole does not exist yet: it is created with spec.<role>.replicas (clamped to the HPA's
  bounds with autoscaling); or, when the model's status already records a target for the role at this
  generation (someone deleted the DisaggregatedRole), with that target: a size set by `kubectl scale` or
  an HPA survives the role being deleted and recreated, and no serving pod is drained for it;
- with `autoscaling`: the HPA owns the size; the operator keeps whatever is there;
- otherwise: the operator writes spec.<role>.replicas when that field changed since it last wrote it (the
  annotation `disagg.dev/spec-replicas` records the value last written); in between, `kubectl scale` or
  any other scaler of the DisaggregatedRole wins, and the operator keeps its value.

The role's target, which every revision is rolled out to, is the DisaggregatedRole's size after that rule.
"""

from __future__ import annotations

from typing import Any, Mapping

from disagg_connector import contract

from .render.scaling import SPEC_REPLICAS_ANNOTATION, initial_replicas
from .state import Desired, Key, Observed


def scaler_key(desired: Desired, role: str) -> Key:
    return contract.ROLE_KIND, contract.role_scaler_name(desired.ref.name, role)  # type: ignore[arg-type]


def _spec_replicas(obj: Mapping[str, Any] | None) -> int | None:
    value = ((obj or {}).get("spec") or {}).get("replicas")
    return int(value) if value is not None else None


def _recorded_target(desired: Desired, role: str) -> int | None:
    """The role's target as the status last recorded it, if that status is of this spec's generation (a
    spec changed since may have asked for another size: then the spec's wins)."""
    status = desired.previous_status or {}
    target = (status.get(role) or {}).get("targetReplicas")
    if target is None or status.get("observedGeneration") != desired.ref.generation:
        return None
    return int(target)


def role_target(desired: Desired, observed: Observed, role: str) -> int:
    """One engine role's size after the one-writer rule: what every revision is rolled out to."""
    role_spec = getattr(desired.model.spec, role)
    live = observed.children.get(scaler_key(desired, role))
    live_size = _spec_replicas(live)
    if live is None or live_size is None:
        recorded = _recorded_target(desired, role)
        return recorded if recorded is not None else initial_replicas(role_spec)
    last_written = (live.get("metadata", {}).get("annotations") or {}).get(SPEC_REPLICAS_ANNOTATION)
    if role_spec.autoscaling is not None or last_written == str(role_spec.replicas):
        return live_size
    return role_spec.replicas


def targets(desired: Desired, observed: Observed) -> dict[str, int]:
    return {role: role_target(desired, observed, role) for role in contract.ENGINE_ROLES}
