"""One idempotent reconcile of a DisaggregatedModel: parse -> render -> apply drifted children ->
compute status -> retire old revisions once the new one is ready -> write status if it changed.

Called from every trigger (create, update, resume, a child's event). Safe to run any number of times:
an unchanged world makes no write at all.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any, Callable

from disagg_connector import contract

from . import status as status_mod
from .api.models import DisaggregatedModel
from .api.validation import SpecError, parse
from .config import RenderDefaults
from .drift import needs_apply, stamped
from .kube import MANAGED_KINDS, Cluster, key_of

DEPLOYMENTS_ONLY = tuple(k for k in MANAGED_KINDS if k[1] == "Deployment")
from .render import render

log = logging.getLogger(__name__)


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    def __init__(self, cluster: Cluster, defaults: RenderDefaults, now: Callable[[], str] = utc_now):
        self.cluster = cluster
        self.defaults = defaults
        self.now = now
        # One reconcile per model at a time; triggers that arrive meanwhile fold into one more pass.
        self._locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
        # Pending passes per model: True = full (every child kind), False = Deployments and status only.
        self._dirty: dict[tuple[str, str], bool] = {}
        self._guard = threading.Lock()

    def trigger(self, namespace: str, name: str, full: bool = True) -> None:
        """Reconcile the named model, coalescing bursts (e.g. every pod of a rollout turning Ready).

        `full=False` is for pod events: a pod changing says nothing about Services or RBAC, so the pass
        reads only Deployments and Pods (3 reads instead of 9) to refresh status and retire revisions.
        """
        key = (namespace, name)
        with self._guard:
            lock = self._locks[key]
            self._dirty[key] = self._dirty.get(key, False) or full
        if not lock.acquire(blocking=False):
            return  # the running pass sees the dirty flag and goes again
        try:
            while True:
                with self._guard:
                    if key not in self._dirty:
                        return
                    pass_full = self._dirty.pop(key)
                body = self.cluster.get_model(namespace, name)
                if body is None or body["metadata"].get("deletionTimestamp"):
                    return  # children go with the garbage collector
                self.reconcile(body, full=pass_full)
        finally:
            lock.release()

    def reconcile(self, body: dict[str, Any], full: bool = True) -> None:
        meta = body["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        generation = meta.get("generation")
        previous = body.get("status")
        try:
            dm = parse({k: body[k] for k in ("apiVersion", "kind", "spec") if k in body} | {"metadata": _slim(meta)})
            rendered = render(dm, self.defaults)
        except SpecError as error:
            log.warning("DisaggregatedModel %s/%s is invalid: %s", namespace, name, error)
            self._write_if_changed(body, status_mod.invalid_status([str(p) for p in error.problems], generation, previous, self.now()))
            return
        except ValueError as error:  # a spec admission would have refused (CRD bypassed or older)
            self._write_if_changed(body, status_mod.invalid_status([str(error)], generation, previous, self.now()))
            return

        kinds = MANAGED_KINDS if full else DEPLOYMENTS_ONLY
        live = self.cluster.owned_children(namespace, name, uid, kinds)
        listed = {kind for _, kind in kinds}
        desired = {key_of(obj): stamped(obj) for obj in rendered.objects if obj["kind"] in listed}
        for key, obj in desired.items():
            if needs_apply(obj, live.get(key)):
                log.info("applying %s %s/%s", key[0], namespace, key[1])
                live[key] = self.cluster.apply(obj)

        stale = {key: obj for key, obj in live.items() if key not in desired}
        old_engines = {k: o for k, o in stale.items() if _is_engine_deployment(o)}
        self.cluster.delete(o for k, o in stale.items() if k not in old_engines)

        observed = status_mod.Observed(
            deployments=[o for k, o in live.items() if (k[0] == "Deployment" and k not in stale) or k in old_engines],
            pods=self.cluster.pods(namespace, name),
        )
        new_status = self._status(dm, rendered, observed, body)
        ready = next(c for c in new_status["conditions"] if c["type"] == "Ready")["status"] == "True"
        if ready and old_engines:
            # The new revision serves on its own now: retire the old pairs (never earlier, never mixed).
            self.cluster.delete(old_engines.values())
            retired = {o["metadata"].get("labels", {}).get(contract.LABEL_REVISION) for o in old_engines.values()}
            observed = status_mod.Observed(
                deployments=[d for d in observed.deployments if key_of(d) not in old_engines],
                pods=[p for p in observed.pods if p["metadata"].get("labels", {}).get(contract.LABEL_REVISION) not in retired],
            )
            new_status = self._status(dm, rendered, observed, body)
        self._write_if_changed(body, new_status)

    def _status(self, dm: DisaggregatedModel, rendered: Any, observed: status_mod.Observed, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        return status_mod.compute(
            rendered, observed, name=meta["name"], namespace=meta["namespace"], router_port=dm.spec.router.service.port,
            generation=meta.get("generation"), previous_status=body.get("status"), now=self.now(),
        )  # fmt: skip

    def _write_if_changed(self, body: dict[str, Any], new_status: dict[str, Any]) -> None:
        old = body.get("status") or {}
        if all(old.get(k) == v for k, v in new_status.items()):
            return
        meta = body["metadata"]
        self.cluster.write_status(meta["namespace"], meta["name"], new_status)


def _slim(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in ("name", "namespace", "uid", "generation") if meta.get(k) is not None}


def _is_engine_deployment(obj: dict[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return obj["kind"] == "Deployment" and labels.get(contract.LABEL_ROLE) in contract.ENGINE_ROLES
