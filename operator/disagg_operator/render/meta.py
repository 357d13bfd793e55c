"""Object metadata shared by every child: names come from contract, owner references from the CR."""

from __future__ import annotations

from typing import Any

from disagg_connector import contract

from ..api.models import DisaggregatedModel


def owner_references(dm: DisaggregatedModel) -> list[dict[str, Any]]:
    """Owned by the CR so the garbage collector removes every child when the CR goes.

    A CR that was never stored (the `render` CLI) has no uid; its children are printed without owner.
    """
    if not dm.metadata.uid:
        return []
    return [
        {
            "apiVersion": dm.api_version,
            "kind": dm.kind,
            "name": dm.metadata.name,
            "uid": dm.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def metadata(
    dm: DisaggregatedModel,
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": dm.metadata.namespace, "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    owners = owner_references(dm)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def pod_disruption_budget(dm: DisaggregatedModel, role: contract.Role) -> dict[str, Any]:
    """At most one pod of a role is voluntarily evicted at a time (node drains, upgrades)."""
    model = dm.metadata.name
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(dm, contract.pdb_name(model, role), contract.child_labels(model, role)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": contract.selector_labels(model, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
