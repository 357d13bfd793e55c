"""NetworkPolicy of the engines: P and D reach each other for NIXL, only the router reaches vLLM's HTTP and KV
cache event ports."""

from __future__ import annotations

from typing import Any

from disagg_connector import contract

from ..api.models import DisaggregatedModel
from ..resolve import TransferPlan
from .meta import metadata


def _pods(model: str, roles: list[str]) -> dict[str, Any]:
    return {
        "podSelector": {
            "matchLabels": {contract.LABEL_MODEL: contract.model_label_value(model)},
            "matchExpressions": [{"key": contract.LABEL_ROLE, "operator": "In", "values": roles}],
        }
    }


def _side_channel_ports(dm: DisaggregatedModel) -> dict[str, Any]:
    base = dm.spec.kv_transfer.side_channel_port
    ranks = max(dm.spec.prefill.parallelism.data, dm.spec.decode.parallelism.data)
    port: dict[str, Any] = {"protocol": "TCP", "port": base}
    if ranks > 1:
        port["endPort"] = contract.side_channel_port(base, ranks - 1)
    return port


def _kv_events_ports(dm: DisaggregatedModel) -> list[dict[str, Any]]:
    """The publisher and replay ports of every data-parallel rank, where the engines publish KV events."""
    if not dm.spec.publishes_kv_events:
        return []
    ranks = max(dm.spec.prefill.parallelism.data, dm.spec.decode.parallelism.data)
    ports = []
    for base in (contract.KV_EVENTS_PORT, contract.KV_EVENTS_REPLAY_PORT):
        port: dict[str, Any] = {"protocol": "TCP", "port": base}
        if ranks > 1:
            port["endPort"] = contract.kv_events_port(base, ranks - 1)
        ports.append(port)
    return ports


def _all_ports_but(ports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every TCP port except ``ports`` (each a port or a port..endPort range), as ranges."""
    taken = sorted((p["port"], p.get("endPort", p["port"])) for p in ports)
    out, start = [], 1
    for first, last in taken:
        if first > start:
            out.append({"protocol": "TCP", "port": start, "endPort": first - 1})
        start = max(start, last + 1)
    if start <= 65535:
        out.append({"protocol": "TCP", "port": start, "endPort": 65535})
    return out


def engines_network_policy(dm: DisaggregatedModel, plan: TransferPlan) -> dict[str, Any]:
    model = dm.metadata.name
    engines = list(contract.ENGINE_ROLES)
    http = [{"protocol": "TCP", "port": contract.HTTP_PORT}]
    router_only = http + _kv_events_ports(dm)
    peers: dict[str, Any] = {"from": [_pods(model, engines)]}
    if plan.backend == "LIBFABRIC":
        # EFA moves KV over SRD, outside IP: only the ZMQ handshake (side channel) needs a port.
        peers["ports"] = [_side_channel_ports(dm)]
    else:
        # UCX over TCP opens data-plane connections on ephemeral ports: P<->D is open on every port but the
        # router's (vLLM's HTTP, the KV events).
        peers["ports"] = _all_ports_but(router_only)
    ingress = [
        peers,
        {"from": [_pods(model, ["router"])], "ports": router_only},
    ]
    metrics_from = dm.spec.network.network_policy.metrics_from
    if metrics_from:
        ingress.append({"from": [dict(p) for p in metrics_from], "ports": http})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            dm, contract.engines_network_policy_name(model), contract.common_labels(model, "engines")
        ),
        "spec": {
            "podSelector": _pods(model, engines)["podSelector"],
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
