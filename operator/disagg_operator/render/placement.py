"""Where P and D pods land: one zone (required by default), one network spine (preferred), optionally
never on one host. KV moves between P and D on every request, so distance is latency."""

from __future__ import annotations

import copy
from typing import Any

from disagg_connector import contract

from ..api.models import DisaggregatedModel, RoleSpec

ZONE_KEY = "topology.kubernetes.io/zone"
HOST_KEY = "kubernetes.io/hostname"


def _engines_selector(model: str, roles: list[str]) -> dict[str, Any]:
    return {
        "matchLabels": {contract.LABEL_MODEL: contract.model_label_value(model)},
        "matchExpressions": [{"key": contract.LABEL_ROLE, "operator": "In", "values": roles}],
    }


def _term(model: str, roles: list[str], key: str) -> dict[str, Any]:
    return {"labelSelector": _engines_selector(model, roles), "topologyKey": key}


def affinity(dm: DisaggregatedModel, role_name: contract.Role) -> dict[str, Any]:
    """The role's own affinity with our terms appended.

    A required pod-affinity term that matches no pod yet is satisfied by the first pod that matches its
    own selector (Kubernetes' rule for the first pod of a group), so the first P or D picks the zone
    and every later one follows it.
    """
    model = dm.metadata.name
    placement = dm.spec.network.placement
    role: RoleSpec = getattr(dm.spec, role_name)
    result: dict[str, Any] = copy.deepcopy(role.affinity) if role.affinity else {}
    engines = list(contract.ENGINE_ROLES)

    def add(kind: str, strength: str, term: dict[str, Any]) -> None:
        section = result.setdefault(kind, {})
        if not isinstance(section, dict):
            return  # a malformed user affinity goes to the API server as written, which says what is wrong
        if strength == "Required":
            field, entry = "requiredDuringSchedulingIgnoredDuringExecution", term
        else:
            field, entry = "preferredDuringSchedulingIgnoredDuringExecution", {"weight": 100, "podAffinityTerm": term}
        terms = section.setdefault(field, [])
        if isinstance(terms, list):
            terms.append(entry)

    if placement.zone != "None":
        add("podAffinity", placement.zone, _term(model, engines, ZONE_KEY))
    if placement.spine != "None":
        add("podAffinity", placement.spine, _term(model, engines, placement.spine_topology_key))
    if placement.separate_hosts:
        other = "decode" if role_name == "prefill" else "prefill"
        add("podAntiAffinity", "Required", _term(model, [other], HOST_KEY))
    return result
