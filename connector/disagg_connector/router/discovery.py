"""Discovery of prefill and decode engines: Kubernetes Pods by label, or a static file.

The table is built from pod objects **as the API returns them** (dicts, camelCase keys), so the same
pure code serves the watch, the relist, the static file and the unit tests:

- a pod counts only if it has the role label (prefill/decode) and the revision label, a UID, a pod IP,
  condition ``Ready=True`` and no ``deletionTimestamp``; its NIXL identity comes from
  :func:`contract.identities_from_pod` (engine_id from name and UID, port = side-channel base + DP rank,
  tp/pp/dp sizes from the annotations);
- a prefill pod yields one backend per DP rank it serves (all N of its engine's, or its share of an engine
  that spans pods): the router pins the prefill leg to the rank with ``X-data-parallel-rank`` = the rank's
  index within the pod and addresses ``<engine_id>_dp<global rank>`` at base + global rank;
  a decode pod is one backend (its API server balances its own DP ranks; D sends its own identity);
- pods that are not (yet) ready are still remembered for the revision's age (see below);
- the pod's transfer-mode annotation (``Push``/``Pull``) decides the protocol of its revision; a revision
  whose pods carry none uses the router's ``--mode``, one whose pods disagree (or carry an unknown value)
  takes no traffic and says why (``mode_conflict``);
- a pod with the draining annotation stays a backend (its in-flight requests finish and are reported) but
  gets no new request;
- an engine that spans pods (one LeaderWorkerSet group, :func:`contract.engine_group`) is usable only when all
  its ranks are: its pods' backends are offered only while every pod of the group is there and serving
  (exactly one per worker index, one revision). When one goes (deleted, terminating, not ready: LWS recreates
  the whole group when one of its pods restarts) all the group's backends leave the snapshot at once, and
  come back when the group is whole again; until then they are ``held_out`` (counted on /health). A pod that
  serves part of an engine's ranks without the labels that name its group is held out for good (warned).
  A one-pod engine (no ``data-parallel-size-local`` below the engine's size) is its own group: as before.

**Order** (of /health and logs; traffic follows ready pairs, see ``pairing``): newest revision first. A
revision's age is the earliest ``creationTimestamp`` of any pod of that revision currently known (ready or
not): the operator creates a revision's pods when it rolls that revision out. Ties break on the revision string. In the static
file, an entry without ``created`` counts as created at its position in the file (later = newer).

**Failures.** The watch runs in a daemon thread with the official ``kubernetes`` client: list, then watch
from the list's resourceVersion; ``410 Gone`` relists; any other error (API outage, expired token) backs
off and retries, keeping the last table until a relist succeeds. Kubeconfig: in-cluster service account,
otherwise ``--kubeconfig`` / ``$KUBECONFIG`` / ``~/.kube/config``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from disagg_connector import contract
from disagg_connector.contract import EngineIdentity
from disagg_connector.contract.health import TRANSFER_MODES, TransferMode

log = logging.getLogger("disagg_router.discovery")


@dataclass(frozen=True)
class Backend:
    """One schedulable target: a decode pod, or one DP rank of a prefill pod."""

    role: str
    revision: str
    pod: str
    uid: str
    host: str
    identity: EngineIdentity
    dp_size: int = 1
    created: float = 0.0
    mode: str | None = None  # the pod's transfer-mode annotation as written (None: none)
    draining: bool = False

    @property
    def key(self) -> str:
        return f"{self.pod}#dp{self.identity.dp_rank}" if self.dp_size > 1 else self.pod

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.identity.http_port}"


def _parse_time(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or f"{meta.get('namespace', '')}/{meta.get('name', '')}")


def backends_from_pod(pod: Mapping[str, Any]) -> list[Backend]:
    """The backends a pod contributes now: [] unless it is a Ready, not terminating P/D pod with an IP."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    role = labels.get(contract.LABEL_ROLE)
    revision = labels.get(contract.LABEL_REVISION)
    name, uid, ip = meta.get("name"), meta.get("uid"), status.get("podIP")
    if role not in contract.ENGINE_ROLES or not revision or not name or not uid:
        return []
    if not ip or not contract.pod_serving(pod):
        return []
    try:
        identities = contract.identities_from_pod(name, uid, ip, meta.get("annotations") or {}, labels)
    except ValueError as e:
        log.warning("pod %s: unreadable NIXL identity annotations (%s); ignored", name, e)
        return []
    if not identities:
        return []
    dp = identities[0].dp_size
    if role == "decode":
        identities = identities[:1]
    created = _parse_time(meta.get("creationTimestamp"))
    annotations = meta.get("annotations") or {}
    mode = annotations.get(contract.ANNOTATION_TRANSFER_MODE) or None
    draining = bool(annotations.get(contract.ANNOTATION_DRAINING))
    return [Backend(role, revision, name, uid, ip, ident, dp, created, mode, draining) for ident in identities]


def revision_mode(backends: Iterable[Backend], default: TransferMode) -> tuple[TransferMode | None, str | None]:
    """The protocol of one revision from its pods' annotations: (mode, None), or (None, why not)."""
    announced = {b.pod: b.mode for b in backends if b.mode is not None}
    unknown = sorted(f"{pod}={m!r}" for pod, m in announced.items() if m not in TRANSFER_MODES)
    if unknown:
        return None, f"unknown {contract.ANNOTATION_TRANSFER_MODE} on {', '.join(unknown)} (expected Push or Pull)"
    modes = set(announced.values())
    if len(modes) > 1:
        pods = ", ".join(f"{pod}={m}" for pod, m in sorted(announced.items()))
        return None, f"pods disagree on {contract.ANNOTATION_TRANSFER_MODE}: {pods}"
    return (modes.pop() if modes else default), None  # type: ignore[return-value]


@dataclass(frozen=True)
class RevisionView:
    revision: str
    created: float
    prefill: tuple[Backend, ...]
    decode: tuple[Backend, ...]
    mode: TransferMode | None = "Push"
    mode_conflict: str | None = None
    held_out: tuple[Backend, ...] = ()  # backends of serving pods whose multi-pod engine is incomplete

    @property
    def eligible(self) -> bool:
        """Has a prefill and a decode that may take new requests (ejection is the balancer's business)."""
        return self.mode is not None and any(not b.draining for b in self.prefill) and any(not b.draining for b in self.decode)


@dataclass(frozen=True)
class Snapshot:
    """An immutable view of the table; ``revisions`` is ordered newest first."""

    generation: int
    revisions: tuple[RevisionView, ...] = ()

    def revision(self, name: str) -> RevisionView | None:
        return next((r for r in self.revisions if r.revision == name), None)

    def backends(self) -> list[Backend]:
        return [b for r in self.revisions for b in (*r.prefill, *r.decode)]


@dataclass
class _PodEntry:
    revision: str | None
    created: float
    backends: list[Backend] = field(default_factory=list)
    group: contract.EngineGroup | None = None  # None: its group is unreadable (then never offered)


def _group(pod: Mapping[str, Any]) -> contract.EngineGroup | None:
    meta = pod.get("metadata") or {}
    name = str(meta.get("name") or "")
    try:
        return contract.engine_group(name, meta.get("labels") or {}, meta.get("annotations") or {})
    except ValueError as e:
        log.warning("pod %s: %s; its engine is never offered", name, e)
        return None


def incomplete_groups(entries: Iterable[_PodEntry]) -> set[str]:
    """Keys of the multi-pod engines that are not whole: some worker index without exactly one serving pod
    (one that yields backends), or serving pods that disagree on the group's size, its ranks or revision."""
    serving: dict[str, list[tuple[contract.EngineGroup, _PodEntry]]] = {}
    for e in entries:
        if e.group is not None and e.group.pods > 1 and e.backends:
            serving.setdefault(e.group.key, []).append((e.group, e))
    return {
        key
        for key, members in serving.items()
        if len({(g.pods, e.backends[0].dp_size, e.revision) for g, e in members}) != 1
        or sorted(g.index for g, _ in members) != list(range(members[0][0].pods))
    }


class EndpointTable:
    """Pods -> backends, grouped by revision. Mutated only on the event loop (or a single thread)."""

    def __init__(self, default_mode: TransferMode = "Push") -> None:
        self.default_mode = default_mode
        self._pods: dict[str, _PodEntry] = {}
        self._incomplete: set[str] = set()  # multi-pod engines held out, for logging their comings and goings
        self._generation = 0
        self._snapshot = Snapshot(0)
        self.synced = False
        self.listeners: list[Callable[[], None]] = []  # called after every change of the table

    @staticmethod
    def _entry(pod: Mapping[str, Any]) -> _PodEntry:
        meta = pod.get("metadata") or {}
        revision = (meta.get("labels") or {}).get(contract.LABEL_REVISION)
        backends = backends_from_pod(pod)
        return _PodEntry(revision, _parse_time(meta.get("creationTimestamp")), backends, _group(pod) if backends else None)

    def engine_keys(self, key: str) -> set[str]:
        """The keys of every backend of the engine that backend ``key`` serves: its pod's ranks, and for an engine that
        spans pods every pod of its group (they fail together: their ranks run collectives at every step). A request
        whose attempt failed on one avoids them all. Just ``key`` when no pod lists it any more."""
        entry = next((e for e in self._pods.values() if any(b.key == key for b in e.backends)), None)
        if entry is None:
            return {key}
        if entry.group is None or entry.group.pods == 1:
            return {b.key for b in entry.backends}
        return {b.key for e in self._pods.values() if e.group is not None and e.group.key == entry.group.key for b in e.backends}

    def replace(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A full list (relist or static file): the new truth."""
        self._pods = {pod_key(p): self._entry(p) for p in pods}
        self.synced = True
        self._changed()

    def apply(self, event_type: str, pod: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED)."""
        key = pod_key(pod)
        if event_type == "DELETED":
            if self._pods.pop(key, None) is None:
                return
        elif event_type in ("ADDED", "MODIFIED"):
            self._pods[key] = self._entry(pod)
        else:
            return
        self._changed()

    def _changed(self) -> None:
        self._generation += 1
        incomplete = incomplete_groups(self._pods.values())
        for key in sorted(incomplete - self._incomplete):
            log.info("engine %s is incomplete: its ranks are held out until all its pods serve", key)
        for key in sorted(self._incomplete - incomplete):
            whole = any(e.group is not None and e.group.key == key and e.backends for e in self._pods.values())
            log.info("engine %s is %s", key, "whole again: its ranks are offered" if whole else "without a serving pod")
        self._incomplete = incomplete
        by_rev: dict[str, dict[str, Any]] = {}
        for entry in self._pods.values():
            if not entry.revision:
                continue
            rev = by_rev.setdefault(entry.revision, {"created": entry.created, "prefill": [], "decode": [], "held_out": []})
            rev["created"] = min(rev["created"], entry.created)
            offered = entry.group is not None and (entry.group.pods == 1 or entry.group.key not in incomplete)
            for b in entry.backends:
                rev[b.role if offered else "held_out"].append(b)
        views = [
            RevisionView(
                name,
                r["created"],
                tuple(sorted(r["prefill"], key=lambda b: b.key)),
                tuple(sorted(r["decode"], key=lambda b: b.key)),
                *revision_mode((*r["prefill"], *r["decode"]), self.default_mode),
                tuple(sorted(r["held_out"], key=lambda b: b.key)),
            )
            for name, r in by_rev.items()
        ]
        views.sort(key=lambda v: (v.created, v.revision), reverse=True)
        self._snapshot = Snapshot(self._generation, tuple(views))
        for listener in self.listeners:
            listener()

    def snapshot(self) -> Snapshot:
        return self._snapshot


# --- static file ------------------------------------------------------------------------------------
_KV_EVENT_FIELDS = (
    ("kv_events_port", contract.ANNOTATION_KV_EVENTS_PORT),
    ("kv_events_replay_port", contract.ANNOTATION_KV_EVENTS_REPLAY_PORT),
    ("kv_hash_seed", contract.ANNOTATION_KV_HASH_SEED),
    ("kv_block_size", contract.ANNOTATION_KV_BLOCK_SIZE),
)


def pods_from_static(doc: Any) -> list[dict[str, Any]]:
    """Static entries -> pod dicts, so the static mode runs the same code as the watch.

    Format (YAML or JSON)::

        endpoints:
          - {role: prefill, revision: r1, name: p0, uid: u0, host: 127.0.0.1, http_port: 8000,
             side_channel_port: 5600, tp_size: 1, pp_size: 1, dp_size: 1, ready: true,
             created: "2024-01-01T00:00:00Z", mode: Push, draining: false,
             dp_size_local: 2, lws: m-decode-r1, group_index: 0, worker_index: 1,
             kv_events_port: 5700, kv_events_replay_port: 5800, kv_hash_seed: "42", kv_block_size: 16}

    ``uid`` defaults to the name. An engine's NIXL id is ``contract.engine_id(name, uid)``, as a pod's: start
    the engine with that id (an entry naming an ``engine_id`` of its own is refused). ``mode`` and
    ``draining`` stand for the pod annotations of the same meaning. An engine that spans entries (pods)
    names its ranks per entry, ``dp_size_local``, and its group as LWS labels its pods: ``lws`` (the set's
    name), ``group_index`` (default 0) and ``worker_index`` (the entry's first rank is worker_index x
    dp_size_local). ``kv_events_port``, ``kv_events_replay_port`` (bases, + the global DP rank as vLLM offsets
    them), ``kv_hash_seed`` and ``kv_block_size`` stand for the KV-event annotations (contract.py).
    """
    entries = doc.get("endpoints", []) if isinstance(doc, Mapping) else (doc or [])
    pods = []
    for i, e in enumerate(entries):
        name = str(e["name"])
        if "engine_id" in e:
            raise ValueError(f"static entry {name}: no engine_id here; start the engine with contract.engine_id(name, uid)")
        annotations = {
            contract.ANNOTATION_TP_SIZE: str(e.get("tp_size", 1)),
            contract.ANNOTATION_PP_SIZE: str(e.get("pp_size", 1)),
            contract.ANNOTATION_DP_SIZE: str(e.get("dp_size", 1)),
            contract.ANNOTATION_SIDE_CHANNEL_PORT: str(e.get("side_channel_port", contract.NIXL_SIDE_CHANNEL_PORT)),
            contract.ANNOTATION_HTTP_PORT: str(e.get("http_port", contract.HTTP_PORT)),
        }
        if e.get("mode"):
            annotations[contract.ANNOTATION_TRANSFER_MODE] = str(e["mode"])
        if e.get("draining"):
            annotations[contract.ANNOTATION_DRAINING] = "static"
        if e.get("dp_size_local"):
            annotations[contract.ANNOTATION_DP_SIZE_LOCAL] = str(e["dp_size_local"])
        for field_name, annotation in _KV_EVENT_FIELDS:
            if e.get(field_name) is not None:
                annotations[annotation] = str(e[field_name])
        labels = {contract.LABEL_ROLE: e["role"], contract.LABEL_REVISION: str(e.get("revision", "static"))}
        if e.get("lws"):
            labels[contract.LWS_NAME_LABEL] = str(e["lws"])
            labels[contract.LWS_GROUP_INDEX_LABEL] = str(e.get("group_index", 0))
        if e.get("worker_index") is not None:
            labels[contract.LWS_WORKER_INDEX_LABEL] = str(e["worker_index"])
        pod = {
            "metadata": {
                "name": name,
                "uid": str(e.get("uid", name)),
                "labels": labels,
                "annotations": annotations,
                "creationTimestamp": e.get("created", i),
            },
            "status": {
                "podIP": e.get("host", "127.0.0.1"),
                "conditions": [{"type": "Ready", "status": "True" if e.get("ready", True) else "False"}],
            },
        }
        pods.append(pod)
    return pods


def load_static(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        doc = yaml.safe_load(text)
    return pods_from_static(doc)


class StaticDiscovery:
    """Reads the file at start and whenever its mtime/size changes; a bad file keeps the last table."""

    def __init__(self, path: str, table: EndpointTable, poll_seconds: float = 0.5, on_error: Callable[[], None] | None = None):
        self.path, self.table, self.poll = path, table, poll_seconds
        self._stamp: tuple[float, int] | None = None
        self._task: asyncio.Task[None] | None = None
        self._on_error = on_error

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            if self._stamp is not None or not self.table.synced:
                log.warning("static endpoints %s unreadable (%s); keeping the last table", self.path, e)
            self._stamp = None
            return
        stamp = (st.st_mtime, st.st_size)
        if stamp == self._stamp:
            return
        try:
            pods = load_static(self.path)
        except Exception as e:
            log.warning("static endpoints %s invalid (%s); keeping the last table", self.path, e)
            if self._on_error:
                self._on_error()
            return
        self._stamp = stamp
        self.table.replace(pods)
        log.info("static endpoints loaded: %s", _describe(self.table.snapshot()))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll)
            self._reload()

    async def start(self) -> None:
        self._reload()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()


def _describe(snap: Snapshot) -> str:
    return ", ".join(f"{r.revision}: {len(r.prefill)}P/{len(r.decode)}D" for r in snap.revisions) or "empty"


# --- Kubernetes -------------------------------------------------------------------------------------
class KubernetesDiscovery:
    """List+watch of Pods by label selector in one namespace, in a daemon thread.

    Events are handed to the event loop with ``call_soon_threadsafe``; the table is never touched from the
    thread. ``api_client`` may be injected (tests); otherwise it is built from in-cluster config or a
    kubeconfig.
    """

    WATCH_SECONDS = 240

    def __init__(
        self,
        namespace: str,
        selector: str,
        table: EndpointTable,
        kubeconfig: str | None = None,
        api_client: Any = None,
        on_error: Callable[[], None] | None = None,
        on_event: Callable[[], None] | None = None,
    ) -> None:
        self.namespace, self.selector, self.table = namespace, selector, table
        self.kubeconfig = kubeconfig
        self._api_client = api_client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_error, self._on_event = on_error, on_event
        self._watch: Any = None

    def api_client(self) -> Any:
        """The ``kubernetes`` ApiClient the watch uses (built on first use), for the router's other API calls."""
        self._client()
        return self._api_client

    def _client(self) -> Any:
        from kubernetes import client, config

        if self._api_client is None:
            try:
                config.load_incluster_config()
                self._api_client = client.ApiClient()
            except config.ConfigException:
                self._api_client = config.new_client_from_config(config_file=self.kubeconfig or os.environ.get("KUBECONFIG"))
        return client.CoreV1Api(self._api_client)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        while not self._stop.is_set():
            try:
                api = self._client()
                resp = api.list_namespaced_pod(
                    self.namespace, label_selector=self.selector, _preload_content=False, _request_timeout=(10, 60)
                )
                doc = json.loads(resp.data)
                rv = (doc.get("metadata") or {}).get("resourceVersion")
                self._post(self.table.replace, doc.get("items") or [])
                self._post(lambda: log.info("pods listed: %s", _describe(self.table.snapshot())))
                backoff = 0.5
                while not self._stop.is_set():
                    w = watch.Watch()
                    self._watch = w
                    for ev in w.stream(
                        api.list_namespaced_pod,
                        self.namespace,
                        label_selector=self.selector,
                        resource_version=rv,
                        allow_watch_bookmarks=True,
                        timeout_seconds=self.WATCH_SECONDS,
                        _request_timeout=(10, self.WATCH_SECONDS + 30),
                    ):
                        if self._stop.is_set():
                            break
                        if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                            self._post(self.table.apply, ev["type"], ev["raw_object"])
                            if self._on_event:
                                self._post(self._on_event)
                    rv = w.resource_version or rv
            except Exception as e:  # API outage, DNS, TLS, token: keep the last table and retry
                if self._stop.is_set():  # stop() closed the watch under us: the end, not a failure
                    return
                if isinstance(e, ApiException) and e.status == 410:
                    log.info("watch expired (410 Gone); relisting")
                    continue
                why = f"API error {e.status}: {e.reason}" if isinstance(e, ApiException) else f"{type(e).__name__}: {e}"
                self._failed(why, backoff)
                backoff = min(backoff * 2, 30.0)

    def _failed(self, why: str, backoff: float) -> None:
        log.warning("pod discovery failed (%s); keeping the last table, retrying in %.1fs", why, backoff)
        if self._on_error and self._loop:
            self._post(self._on_error)
        self._stop.wait(backoff)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pod-discovery", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

