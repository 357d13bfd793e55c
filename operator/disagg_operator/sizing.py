"""Who sizes an engine role: one writer at a time, and the operator never undoes the others. Pure.

The size of a role lives in its DisaggregatedRole `<model>-<role>` (spec.replicas, the scale subresource),
whose name survives revisions. The rule for what the operator writes there:

- the DisaggregatedRole does not exist yet: it is created with spec.<role>.replicas (clamped to the HPA's
  bounds with autoscaling);
- with `autoscaling`: the HPA owns the size; the operator keeps whatever is there;
- otherwise: the operator writes spec.<role>.replicas when that field changed since it last wrote it (the
  annotation `disagg.dev/spec-replicas` records the value last written); in between, `kubectl scale` or
  any other scaler of the DisaggregatedRole wins, and the operator keeps its value.

The role's target, which every revision is rolled out to, is the DisaggregatedRole's size after that rule.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from disagg_connector import contract

from .render.scaling import SPEC_REPLICAS_ANNOTATION
from .state import Desired, Key, Obj, Observed


def scaler_key(desired: Desired, role: str) -> Key:
    return contract.ROLE_KIND, contract.role_scaler_name(desired.ref.name, role)  # type: ignore[arg-type]


def _spec_replicas(obj: Mapping[str, Any] | None) -> int | None:
    if obj is None:
        return None
    value = (obj.get("spec") or {}).get("replicas")
    return int(value) if value is not None else None


def sized_scaler(desired: Desired, observed: Observed, role: str) -> Obj:
    """The DisaggregatedRole to apply: the rendered one, with the size the one-writer rule leaves it."""
    key = scaler_key(desired, role)
    rendered = next(o for o in desired.rendered.objects if (o["kind"], o["metadata"]["name"]) == key)
    live = observed.children.get(key)
    live_size = _spec_replicas(live)
    if live is None or live_size is None:
        return rendered
    role_spec = getattr(desired.model.spec, role)
    last_written = (live.get("metadata", {}).get("annotations") or {}).get(SPEC_REPLICAS_ANNOTATION)
    keep_live = role_spec.autoscaling is not None or last_written == str(role_spec.replicas)
    if not keep_live:
        return rendered
    out = copy.deepcopy(rendered)
    out["spec"]["replicas"] = live_size
    return out


def targets(desired: Desired, observed: Observed) -> dict[str, int]:
    return {role: int(sized_scaler(desired, observed, role)["spec"]["replicas"]) for role in contract.ENGINE_ROLES}
