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
from .api.validation import SpecError, parse
from .config import RenderDefaults
from .drift import needs_apply, stamped
from .kube import Cluster, key_of
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
        self._dirty: set[tuple[str, str]] = set()
        self._guard = threading.Lock()

    def trigger(self, namespace: str, name: str) -> None:
        """Reconcile the named model, coalescing bursts (e.g. every pod of a rollout turning Ready)."""
        key = (namespace, name)
        with self._guard:
            lock = self._locks[key]
            self._dirty.add(key)
        if not lock.acquire(blocking=False):
            return  # the running pass sees the dirty flag and goes again
        try:
            while True:
                with self._guard:
                    if key not in self._dirty:
                        return
                    self._dirty.discard(key)
                body = self.cluster.get_model(namespace, name)
                if body is None or body["metadata"].get("deletionTimestamp"):
                    return  # children go with the garbage collector
                self.reconcile(body)
        finally:
            lock.release()

    def reconcile(self, body: dict[str, Any]) -> None:
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

        live = self.cluster.owned_children(namespace, name, uid)
        desired = {key_of(obj): stamped(obj) for obj in rendered.objects}
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
        new_status = self._status(rendered, observed, body)
        ready = next(c for c in new_status["conditions"] if c["type"] == "Ready")["status"] == "True"
        if ready and old_engines:
            # The new revision serves on its own now: retire the old pairs (never earlier, never mixed).
            self.cluster.delete(old_engines.values())
            retired = {o["metadata"].get("labels", {}).get(contract.LABEL_REVISION) for o in old_engines.values()}
            observed = status_mod.Observed(
                deployments=[d for d in observed.deployments if key_of(d) not in old_engines],
                pods=[p for p in observed.pods if p["metadata"].get("labels", {}).get(contract.LABEL_REVISION) not in retired],
            )
            new_status = self._status(rendered, observed, body)
        self._write_if_changed(body, new_status)

    def _status(self, rendered: Any, observed: status_mod.Observed, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        router_port = ((body.get("spec") or {}).get("router") or {}).get("service", {}).get("port", contract.ROUTER_PORT)
        return status_mod.compute(
            rendered, observed, name=meta["name"], namespace=meta["namespace"], router_port=router_port,
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
