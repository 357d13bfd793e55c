"""The scale target of each engine role (a DisaggregatedRole named `<model>-<role>`, across revisions) and,
with `autoscaling`, the HPA that scales it."""

from __future__ import annotations

from typing import Any

from disagg_connector import contract

from ..api.models import DisaggregatedModel, RoleSpec
from .meta import metadata

# On a DisaggregatedRole: the model's spec.<role>.replicas last written into it (planner.py's one-writer rule).
SPEC_REPLICAS_ANNOTATION = f"{contract.API_GROUP}/spec-replicas"


def initial_replicas(role: RoleSpec) -> int:
    if role.autoscaling is None:
        return role.replicas
    return min(max(role.replicas, role.autoscaling.min_replicas), role.autoscaling.max_replicas)


def role_scaler(dm: DisaggregatedModel, role_name: contract.Role) -> dict[str, Any]:
    model = dm.metadata.name
    role: RoleSpec = getattr(dm.spec, role_name)
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
        "kind": contract.ROLE_KIND,
        "metadata": metadata(dm, contract.role_scaler_name(model, role_name), contract.child_labels(model, role_name),
                             {SPEC_REPLICAS_ANNOTATION: str(role.replicas)}),
        "spec": {"replicas": initial_replicas(role)},
    }  # fmt: skip


def horizontal_pod_autoscaler(dm: DisaggregatedModel, role_name: contract.Role) -> dict[str, Any] | None:
    model = dm.metadata.name
    role: RoleSpec = getattr(dm.spec, role_name)
    scaling = role.autoscaling
    if scaling is None:
        return None
    spec: dict[str, Any] = {
        "scaleTargetRef": {
            "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
            "kind": contract.ROLE_KIND,
            "name": contract.role_scaler_name(model, role_name),
        },
        "minReplicas": scaling.min_replicas,
        "maxReplicas": scaling.max_replicas,
        "metrics": [dict(m) for m in scaling.metrics],
    }
    if scaling.behavior:
        spec["behavior"] = dict(scaling.behavior)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(dm, contract.role_scaler_name(model, role_name), contract.child_labels(model, role_name)),
        "spec": spec,
    }
