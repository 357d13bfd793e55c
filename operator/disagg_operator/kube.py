"""The only module that talks to the Kubernetes API: server-side apply, owned-children reads, deletes,
status writes. Everything it is asked to do was decided by pure code elsewhere."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable

from kubernetes import client, config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError

from disagg_connector import contract

log = logging.getLogger(__name__)

# Every kind the renderer produces: stale-child cleanup lists exactly these.
MANAGED_KINDS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)
Key = tuple[str, str]  # (kind, name)


def key_of(obj: dict[str, Any]) -> Key:
    return obj["kind"], obj["metadata"]["name"]


USER_AGENT = f"{contract.OPERATOR_NAME}/reconciler"


def load_api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config).

    The user agent names us in the API server's audit log (kopf's own requests say kopf/<version>).
    """
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.ApiClient()
    api.user_agent = USER_AGENT
    return api


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


@dataclass
class Cluster:
    api_client: client.ApiClient
    field_manager: str = contract.FIELD_MANAGER

    @cached_property
    def dynamic(self) -> DynamicClient:
        return DynamicClient(self.api_client)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        resource = self._resource(obj["apiVersion"], obj["kind"])
        result = self.dynamic.server_side_apply(
            resource,
            body=obj,
            name=obj["metadata"]["name"],
            namespace=obj["metadata"]["namespace"],
            field_manager=self.field_manager,
            force_conflicts=True,
        )
        return result.to_dict()

    def owned_children(
        self, namespace: str, model: str, owner_uid: str, kinds: Iterable[tuple[str, str]] = MANAGED_KINDS
    ) -> dict[Key, dict[str, Any]]:
        """Children of one CR: our labels *and* its uid as controller (a same-named object that some
        other CR or person owns is never ours to change)."""
        found: dict[Key, dict[str, Any]] = {}
        selector = _selector(contract.owned_selector(model))
        for api_version, kind in kinds:
            items = self._resource(api_version, kind).get(namespace=namespace, label_selector=selector).to_dict()
            for item in items.get("items") or []:
                owners = item.get("metadata", {}).get("ownerReferences") or []
                if any(o.get("uid") == owner_uid and o.get("controller") for o in owners):
                    item.setdefault("kind", kind)
                    item.setdefault("apiVersion", api_version)
                    found[key_of(item)] = item
        return found

    def pods(self, namespace: str, model: str) -> list[dict[str, Any]]:
        selector = _selector(contract.owned_selector(model))
        items = self._resource("v1", "Pod").get(namespace=namespace, label_selector=selector).to_dict()
        return list(items.get("items") or [])

    def delete(self, objs: Iterable[dict[str, Any]]) -> None:
        for obj in objs:
            resource = self._resource(obj["apiVersion"], obj["kind"])
            meta = obj["metadata"]
            try:
                resource.delete(
                    name=meta["name"],
                    namespace=meta["namespace"],
                    body={"propagationPolicy": "Background", "preconditions": {"uid": meta["uid"]}},
                )
                log.info("deleted stale %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
            except NotFoundError:
                pass

    def get_model(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._model_resource.get(namespace=namespace, name=name).to_dict()
        except NotFoundError:
            return None

    @cached_property
    def _model_resource(self) -> Any:
        return self._resource(f"{contract.API_GROUP}/{contract.API_VERSION}", contract.KIND)

    def write_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch of /status: lists (conditions) are replaced whole, so send all of them."""
        api = client.CustomObjectsApi(self.api_client)
        api.patch_namespaced_custom_object_status(
            contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, name,
            body={"status": status}, field_manager=self.field_manager,
            _content_type="application/merge-patch+json",
        )  # fmt: skip
