"""The only module that talks to the Kubernetes API: server-side apply (real and dry run), a GET by name,
deletes, status writes, Events. Everything it is asked to do was decided by pure code elsewhere; reads of the
model and its children come from the watch-fed cache (cache.py), not from here.

Every request carries a timeout: an API server that stops answering must fail the pass (to be retried
with backoff), never hang a worker.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from typing import Any, Callable

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from disagg_connector import contract

log = logging.getLogger(__name__)

USER_AGENT = f"{contract.OPERATOR_NAME}/reconciler"
# (connect, read) seconds per request: well below a pass's patience, well above a loaded API server's.
REQUEST_TIMEOUT = (5, 30)


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


def error_message(error: ApiException) -> str:
    """The API server's own words (the Status message names the field), else the HTTP reason."""
    try:
        return str(json.loads(error.body or "")["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {error.status} {error.reason}".strip()


SERVES_TTL_SECONDS = 300.0


@dataclass
class Cluster:
    api_client: client.ApiClient
    field_manager: str = contract.FIELD_MANAGER
    _served: dict[tuple[str, str], tuple[bool, float]] = field(default_factory=dict, repr=False)

    @cached_property
    def dynamic(self) -> DynamicClient:
        return DynamicClient(self.api_client)

    def version(self, timeout: float) -> str:
        """The API server's version (GET /version, which every authenticated client may read): it answers."""
        return str(client.VersionApi(self.api_client).get_code(_request_timeout=timeout).git_version)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def serves(self, api_version: str, kind: str) -> bool:
        """Whether the API server's discovery lists the kind. A miss makes the client fetch discovery again, so
        the answer is kept for SERVES_TTL_SECONDS: a kind that comes (a feature gate turned on) is seen then."""
        now = time.monotonic()
        known = self._served.get((api_version, kind))
        if known is not None and now - known[1] < SERVES_TTL_SECONDS:
            return known[0]
        try:
            self._resource(api_version, kind)
            found = True
        except ResourceNotFoundError:
            found = False
        self._served[(api_version, kind)] = (found, now)
        return found

    def list_cluster(self, api_version: str, kind: str) -> list[dict[str, Any]]:
        """Every object of a cluster-scoped kind (an empty list where the kind is not served)."""
        if not self.serves(api_version, kind):
            return []
        return [o.to_dict() for o in self._resource(api_version, kind).get(_request_timeout=REQUEST_TIMEOUT).items]

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply with our field manager; with dry_run the API server validates and admits
        it (schema, quota, RBAC, webhooks) without storing anything."""
        resource = self._resource(obj["apiVersion"], obj["kind"])
        result = self.dynamic.server_side_apply(
            resource,
            body=obj,
            name=obj["metadata"]["name"],
            namespace=obj["metadata"]["namespace"],
            field_manager=self.field_manager,
            force_conflicts=True,
            dry_run="All" if dry_run else None,
            _request_timeout=REQUEST_TIMEOUT,
        )
        return result.to_dict()

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The live object with the name and kind of `obj`, whoever owns it."""
        resource = self._resource(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        try:
            return resource.get(name=meta["name"], namespace=meta["namespace"], _request_timeout=REQUEST_TIMEOUT).to_dict()
        except NotFoundError:
            return None

    def delete(self, obj: dict[str, Any]) -> None:
        """Delete exactly this incarnation (uid precondition); gone already is fine."""
        resource = self._resource(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        try:
            resource.delete(
                name=meta["name"],
                namespace=meta["namespace"],
                body={"propagationPolicy": "Background", "preconditions": {"uid": meta["uid"]}},
                _request_timeout=REQUEST_TIMEOUT,
            )
        except NotFoundError:
            pass

    def scale(self, obj: dict[str, Any], replicas: int) -> None:
        """Resize a Deployment or LeaderWorkerSet through its scale subresource (an older revision, no longer
        rendered)."""
        meta = obj["metadata"]
        self._resource(obj["apiVersion"], obj["kind"]).subresources["scale"].patch(
            body={"spec": {"replicas": replicas}}, name=meta["name"], namespace=meta["namespace"],
            content_type="application/merge-patch+json", field_manager=self.field_manager,
            _request_timeout=REQUEST_TIMEOUT,
        )  # fmt: skip

    def annotate(self, obj: dict[str, Any], annotations: dict[str, str | None]) -> None:
        """Merge-patch annotations of a pod (None removes one); gone already is fine."""
        meta = obj["metadata"]
        try:
            client.CoreV1Api(self.api_client).patch_namespaced_pod(
                meta["name"], meta["namespace"], {"metadata": {"annotations": annotations}},
                field_manager=self.field_manager, _request_timeout=REQUEST_TIMEOUT,
            )  # fmt: skip
        except ApiException as error:
            if error.status != 404:
                raise

    def set_status(self, obj: dict[str, Any], status: dict[str, Any]) -> None:
        """Merge-patch the status subresource of one of our custom children."""
        group, version = obj["apiVersion"].split("/")
        meta = obj["metadata"]
        client.CustomObjectsApi(self.api_client).patch_namespaced_custom_object_status(
            group, version, meta["namespace"], contract.ROLE_PLURAL, meta["name"], body={"status": status},
            field_manager=self.field_manager, _content_type="application/merge-patch+json",
            _request_timeout=REQUEST_TIMEOUT,
        )  # fmt: skip

    def write_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch of /status: lists (conditions) are replaced whole, so send all of them. Returns the
        object as stored (its resourceVersion tells when the cache has caught up)."""
        api = client.CustomObjectsApi(self.api_client)
        return api.patch_namespaced_custom_object_status(
            contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, name,
            body={"status": status}, field_manager=self.field_manager,
            _content_type="application/merge-patch+json", _request_timeout=REQUEST_TIMEOUT,
        )  # fmt: skip


class EventRecorder:
    """Records Events (events.k8s.io/v1) on a model. A repeat of an Event (same model, reason, note and
    related object) within SERIES_SECONDS becomes a count on the first one (its `series`), as client-go's
    recorder aggregates, so a looping failure does not flood. Recording never fails a pass."""

    SERIES_SECONDS = 600.0

    def __init__(self, api_client: client.ApiClient, instance: str, clock: Callable[[], float] = time.time):
        self.api = client.EventsV1Api(api_client)
        self.instance = instance
        self.clock = clock
        self._seen: dict[tuple[str, ...], tuple[str, int, float]] = {}  # key -> (event name, count, first seen)

    @staticmethod
    def _micro_time(at: float) -> str:
        # The client re-serializes a time it recognises with isoformat(), which drops the fraction when it is
        # 0, and the API server's MicroTime then refuses it: never send a whole second.
        at = at if int(at * 1e6) % 1_000_000 else at + 1e-6
        return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def record(self, model: dict[str, Any], event: Any) -> None:
        meta = model["metadata"]
        related = event.related
        key = (meta["uid"], event.reason, event.note, (related or {}).get("metadata", {}).get("name", ""))
        now = self.clock()
        self._seen = {k: v for k, v in self._seen.items() if now - v[2] < self.SERIES_SECONDS}
        try:
            seen = self._seen.get(key)
            if seen is not None and now - seen[2] < self.SERIES_SECONDS:
                name, count, first = seen
                self.api.patch_namespaced_event(name, meta["namespace"], {"series": {
                    "count": count + 1, "lastObservedTime": self._micro_time(now)}}, _request_timeout=REQUEST_TIMEOUT)
                self._seen[key] = (name, count + 1, first)
                return
            body = {
                "apiVersion": "events.k8s.io/v1", "kind": "Event",
                # Named as client-go names Events: the object's name and the time in hex nanoseconds.
                "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
                "eventTime": self._micro_time(now), "reportingController": f"{contract.API_GROUP}/{contract.OPERATOR_NAME}",
                "reportingInstance": self.instance, "action": event.action, "reason": str(event.reason), "type": event.type,
                "note": event.note[:1024],
                "regarding": {"apiVersion": model["apiVersion"], "kind": model["kind"], "name": meta["name"],
                              "namespace": meta["namespace"], "uid": meta["uid"]},
            }  # fmt: skip
            if related is not None:
                rm = related["metadata"]
                body["related"] = {"apiVersion": related.get("apiVersion", "v1"), "kind": related.get("kind", "Pod"),
                                   "name": rm["name"], "namespace": rm.get("namespace", meta["namespace"]), "uid": rm.get("uid")}  # fmt: skip
            created = self.api.create_namespaced_event(meta["namespace"], body, _request_timeout=REQUEST_TIMEOUT)
            self._seen[key] = (created.metadata.name, 1, now)
        except (ApiException, OSError) as error:  # an Event is a courtesy: never worth a failed pass
            log.info("event %s on %s/%s not recorded: %s", event.reason, meta["namespace"], meta["name"], error)
