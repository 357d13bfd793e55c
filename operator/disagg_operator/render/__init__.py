"""Pure rendering: a parsed DisaggregatedModel -> every child manifest the operator applies.

No API client and no kopf here: the same function backs the operator, `disagg-operator render` and
the golden tests, so what a reviewer sees is exactly what gets applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from disagg_connector import contract

from ..api.models import DisaggregatedModel
from ..config import RenderDefaults
from ..resolve import TransferPlan, keep_release, plan
from . import engine, gang, gateway, network, router, scaling
from .engine import LWS_API_VERSION, LWS_KIND, LWS_PLURAL
from .gang import POD_GROUP_API_VERSION, POD_GROUP_KIND, POD_GROUP_PLURAL
from .gateway import (HTTP_ROUTE_API_VERSION, HTTP_ROUTE_KIND, HTTP_ROUTE_PLURAL, INFERENCE_POOL_API_VERSION,
                      INFERENCE_POOL_KIND, INFERENCE_POOL_PLURAL)
from .meta import pod_disruption_budget

REVISION_LENGTH = 10
# What to install for a kind the cluster does not serve (status reason KindNotInstalled).
INSTALL_HINTS: dict[str, str] = {**engine.INSTALL_HINTS, **gateway.INSTALL_HINTS}

# Every kind render() produces, with its API version and resource name: the operator watches, writes and
# cleans up exactly these (and its RBAC grants exactly these). A test ties the list to render()'s output.
MANAGED_KINDS: tuple[tuple[str, str, str], ...] = (
    ("apps/v1", "Deployment", "deployments"),
    (LWS_API_VERSION, LWS_KIND, LWS_PLURAL),
    (POD_GROUP_API_VERSION, POD_GROUP_KIND, POD_GROUP_PLURAL),
    ("v1", "Service", "services"),
    ("v1", "ServiceAccount", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "Role", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    ("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    (f"{contract.API_GROUP}/{contract.API_VERSION}", contract.ROLE_KIND, contract.ROLE_PLURAL),
    ("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    (INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND, INFERENCE_POOL_PLURAL),
    (HTTP_ROUTE_API_VERSION, HTTP_ROUTE_KIND, HTTP_ROUTE_PLURAL),
)


@dataclass(frozen=True)
class Rendered:
    objects: list[dict[str, Any]]
    plan: TransferPlan
    revision: str


def revision_of(templates: dict[str, dict[str, Any]], transfer: TransferPlan) -> str:
    """A hash of everything P and D must agree on: both pod templates (image, model, dtype, block
    size, connector, backend, parallelism, ...) and the transfer plan. Replica counts are not in it:
    scaling is not a new revision."""
    payload = json.dumps({"templates": templates, "mode": transfer.mode, "backend": transfer.backend}, sort_keys=True)
    return contract.short_hash(payload, REVISION_LENGTH)


def render(dm: DisaggregatedModel, defaults: RenderDefaults | None = None, status: Mapping[str, Any] | None = None) -> Rendered:
    """`status`: the model's, whose vllmVersion a running model keeps while its spec names no release."""
    defaults = defaults or RenderDefaults()
    dm = keep_release(dm, status)
    transfer = plan(dm.spec)
    templates = {role: engine.pod_template(dm, role, transfer, defaults) for role in contract.ENGINE_ROLES}
    revision = revision_of(templates, transfer)
    objects: list[dict[str, Any]] = []
    for role in contract.ENGINE_ROLES:
        engines = engine.engines(dm, role, templates[role], revision)
        objects += [
            scaling.role_scaler(dm, role),
            engines,
            engine.headless_service(dm, role),
            pod_disruption_budget(dm, role),
        ]
        if engines["kind"] == LWS_KIND:  # at the spec's size; a pass sizes them with the LWS, where served (sizing.sized)
            objects += gang.pod_groups(engines, engines["spec"]["replicas"])
        hpa = scaling.horizontal_pod_autoscaler(dm, role)
        if hpa is not None:
            objects.append(hpa)
    if gang.pairs(dm):  # the same: a pass makes it where served, its minCount from the roles' targets (sizing.sized)
        sizes = {r: getattr(dm.spec, r).replicas for r in contract.ENGINE_ROLES}
        objects.append(gang.pair_pod_group(dm, revision, gang.pair_min_count(dm, sizes)))
    objects += [
        router.service_account(dm),
        router.role(dm),
        router.role_binding(dm),
        router.deployment(dm, transfer, defaults),
        router.service(dm),
        pod_disruption_budget(dm, "router"),
    ]
    if dm.spec.network.network_policy.enabled:
        objects.append(network.engines_network_policy(dm, transfer))
    objects += gateway.objects(dm)  # spec.gateway: where the cluster lacks the CRDs, the dry run says KindNotInstalled
    return Rendered(objects=objects, plan=transfer, revision=revision)
