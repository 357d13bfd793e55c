"""Simulated engines on the pod IPs of a DisaggregatedModel, and its router as a local process.

On the local control plane (kwok) pods are Running and Ready without containers, and their IPs are
loopback addresses (hack/cluster.sh): a simulated vLLM engine can listen on each P/D pod's own IP, at the
ports of its annotations, with ``--engine-id`` = ``contract.engine_id(pod name, pod UID)`` and tp/pp/dp from
its annotations: exactly the identity a real vLLM pod gets from the Downward API. A pod of an engine that spans
pods (a LeaderWorkerSet group) runs the data-parallel ranks that ``contract.identities_from_pod`` reads from its
annotations and worker-index label, as its ``vllm serve`` under hybrid load balancing would. The router runs with the
arguments the operator rendered into its Deployment and a token of its own ServiceAccount, so it discovers
those pods through the API server as it would in the cluster.

**KV cache and KV events, as rendered.** The engine takes the KV cache flags of the pod's own ``vllm serve``
command line (:data:`KV_CACHE_FLAGS`: block size, prefix caching, its hash algorithm, ``--kv-events-config``)
and the environment vLLM hashes with (:data:`ENGINE_ENV`, PYTHONHASHSEED) from its container, so a model whose
engines publish KV events gets simulators that publish them at the rendered ports, with the block hashes the
router computes from the pod's annotations. vLLM binds the publisher on every interface of its pod
(``tcp://*:port``); here pods share the machine's ports on their own loopback IPs, so the simulator binds the
pod's IP (``--kv-events-host``).

**preStop, as a kubelet runs it.** kwok runs no container and no hook. When the pod of a running engine
gets its deletionTimestamp, this runs the pod's rendered preStop command (the engines' ``disagg-drain``,
this venv's console script) with ``--host <pod IP>``: it waits until the simulated engine's ``/metrics`` say
it is idle. Then (with ``stop_gone``) it stops the engine, as a kubelet sends SIGTERM only after the hook, and
annotates the pod :data:`PRE_STOP_DONE_ANNOTATION`. kwok holds such a pod (annotated
:data:`ENGINE_ANNOTATION` when its engine started) until that annotation or its deletionTimestamp
(hack/kwok/stages.yaml, ``pod-delete-after-pre-stop``): a pod goes only once its engine has stopped.

Used by ``tests/e2e/test_router_e2e.py`` and by the last step of ``hack/demo.sh`` (``python -m
disagg_bench.vllm_sim.pods``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, watch

from disagg_connector import contract
from disagg_bench.vllm_sim.harness import FAST, Proc, free_port, get_json, http_get, wait_until

# On a pod whose engine this runs (kwok holds it on deletion until PRE_STOP_DONE_ANNOTATION: hack/kwok/stages.yaml).
ENGINE_ANNOTATION = "sim.disagg.dev/engine"
# Written when the pod's preStop returned (value: its exit code).
PRE_STOP_DONE_ANNOTATION = "sim.disagg.dev/pre-stop-done"
ENGINE_CONTAINER = "vllm"
ENGINE_START_SECONDS = 30.0  # a launched simulator listens within this (python start-up, on a busy machine)
# Flags of the rendered `vllm serve` that the simulator takes as they are: its KV cache and KV events.
KV_CACHE_FLAGS = ("--block-size", "--prefix-caching-hash-algo", "--kv-events-config")
KV_CACHE_SWITCHES = ("--enable-prefix-caching", "--no-enable-prefix-caching")
# The container's environment that the simulator reads as vLLM does (its block hashes' seed and form).
ENGINE_ENV = ("PYTHONHASHSEED", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")


def engine_container(pod: dict[str, Any]) -> dict[str, Any] | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == ENGINE_CONTAINER:
            return container
    return None


def pre_stop_command(pod: dict[str, Any]) -> list[str] | None:
    """The exec preStop command of the pod's vllm container, if it has one."""
    container = engine_container(pod) or {}
    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
    return list(command) if command else None


def kv_cache_argv(pod: dict[str, Any], ip: str) -> list[str]:
    """The simulator flags for the KV cache of the pod's rendered ``vllm serve`` (its command and args, also
    behind an engine-spanning pod's ``/bin/sh -c``): each of :data:`KV_CACHE_FLAGS` with its value and the
    prefix caching switch, as given; with ``--kv-events-config``, the publisher bound on the pod's IP."""
    container = engine_container(pod) or {}
    rendered = [*(container.get("command") or []), *(container.get("args") or [])]
    argv: list[str] = []
    for i, arg in enumerate(rendered):
        if arg in KV_CACHE_FLAGS and i + 1 < len(rendered):
            argv += [arg, rendered[i + 1]]
        elif arg in KV_CACHE_SWITCHES:
            argv.append(arg)
    if "--kv-events-config" in argv:
        argv += ["--kv-events-host", ip]
    return argv


def engine_env(pod: dict[str, Any]) -> dict[str, str]:
    """The values of :data:`ENGINE_ENV` that the pod's engine container sets."""
    container = engine_container(pod) or {}
    return {e["name"]: e["value"] for e in container.get("env") or [] if e.get("name") in ENGINE_ENV and "value" in e}


@dataclass
class PreStop:
    """One run of a pod's preStop hook against its simulated engine (monotonic times)."""

    argv: list[str]
    started: float
    stats_at_start: dict[str, Any] | None = None  # the simulator's /sim/stats when its pod got its deletionTimestamp
    proc: subprocess.Popen[str] | None = None
    finished: float | None = None
    returncode: int | None = None
    output: str = ""


@dataclass
class PodEngine:
    proc: Proc
    pod: str
    uid: str
    role: str
    revision: str
    ip: str
    http_port: int
    engine_id: str
    publishes_kv_events: bool = False  # its pod's vllm serve has --kv-events-config (so the simulator publishes)
    vllm_version: str | None = None  # the release its pod runs (its annotation), which the simulator answers as
    final: tuple[dict[str, Any], list[dict[str, Any]]] | None = None  # (stats, events) when it was stopped
    pre_stop: PreStop | None = None  # the pod's preStop, once its pod was deleted
    stopped_at: float | None = None  # monotonic time the engine was stopped

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.http_port}"

    def ready(self) -> bool:
        if not self.proc.alive():
            raise RuntimeError(f"engine for {self.pod} exited:\n{self.proc.log_text()[-3000:]}")
        return http_get(self.url + "/health", timeout=2)[0] == 200

    def _get(self, path: str) -> Any:
        """GET one of the simulator's hooks. An engine is launched when its pod turns Ready (at once on kwok)
        and listens a moment later: until then a refused connection means "not yet", while it runs."""
        deadline = time.monotonic() + ENGINE_START_SECONDS
        while True:
            try:
                return get_json(self.url + path)
            except urllib.error.URLError as e:
                if not isinstance(e.reason, ConnectionRefusedError) or time.monotonic() > deadline:
                    raise
                if not self.proc.alive():
                    raise RuntimeError(f"engine for {self.pod} exited:\n{self.proc.log_text()[-3000:]}") from e
                time.sleep(0.05)

    def stats(self) -> dict[str, Any]:
        """The simulator's /sim/stats: counters, and what it still holds (KV blocks, writes, requests)."""
        if self.final is not None:
            return self.final[0]
        if not self.proc.alive() and self.pre_stop is not None and self.pre_stop.stats_at_start is not None:
            # its pod was being deleted and the engine died on its own before it was stopped: a rank of a retired
            # LeaderWorkerSet group whose leader went first (their collectives fail, as vLLM's do). What it held
            # when the deletion began is the last it said.
            return self.pre_stop.stats_at_start
        return self._get("/sim/stats")

    def counters(self) -> dict[str, int]:
        return self.stats()["counters"]

    def events(self) -> list[dict[str, Any]]:
        if self.final is not None:
            return self.final[1]
        return self._get("/sim/events")["events"]

    def legs(self) -> dict[str, dict[str, Any]]:
        """xid -> the leg_received event of every leg this engine got."""
        return {e["xid"]: e for e in self.events() if e["kind"] == "leg_received"}

    def stop(self) -> None:
        """Keep what it saw, then stop it."""
        if self.final is None and self.proc.alive():
            self.final = (self.stats(), self.events())
            self.stopped_at = time.monotonic()
        self.proc.stop()


class PodEngines:
    """Watches a model's P/D pods and runs one simulated engine per Ready pod, on that pod's IP, in the
    pod's own transfer mode (its annotation).

    Engines of deleted pods keep running (in ``gone``) until the caller retires them, once the router no
    longer routes to them and nothing in flight can still need them; with ``stop_gone`` they stop (keeping
    what they saw) as soon as their pod is gone, which a test needs when kwok hands the freed pod IP to
    the next pod of the same node. A pod being deleted first runs its preStop hook (module docstring):
    it is gone once the hook returned, or its grace period passed.
    """

    def __init__(self, api_client: Any, namespace: str, model: str, served_name: str, log_dir: Path,
                 timing: dict[str, float] | None = None, stop_gone: bool = False):  # fmt: skip
        self.stop_gone = stop_gone
        self.core = client.CoreV1Api(api_client)
        self.namespace, self.model, self.served_name = namespace, model, served_name
        self.log_dir, self.timing = log_dir, FAST if timing is None else timing
        self.engines: dict[str, PodEngine] = {}  # pod uid -> engine
        self.gone: set[str] = set()  # uids of deleted pods whose engine still runs
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._selector = f"{contract.LABEL_MODEL}={contract.model_label_value(model)},{contract.LABEL_ROLE} in (prefill,decode)"
        self._hooks: list[threading.Thread] = []
        # The hook program: this venv's console script of the command the operator rendered.
        self._bin = str(Path(sys.executable).parent)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        annotate: PodEngine | None = None
        hook: PodEngine | None = None
        with self.lock:
            known = uid in self.engines
            if kind == "DELETED" or meta.get("deletionTimestamp"):
                if known:
                    self.gone.add(uid)
                    engine = self.engines[uid]
                    command = pre_stop_command(pod)
                    held = command is not None and ENGINE_ANNOTATION in (meta.get("annotations") or {})
                    if kind != "DELETED" and held and engine.pre_stop is None:  # an engine that died: the hook returns at once
                        engine.pre_stop = PreStop(self._hook_argv(command, engine.ip), time.monotonic())  # type: ignore[arg-type]
                        hook = engine
                    elif self.stop_gone and (kind == "DELETED" or not held):
                        engine.stop()
            else:
                ip = (pod.get("status") or {}).get("podIP")
                if known or not ip or not contract.pod_serving(pod):
                    return
                worker = self._is_worker(pod)
                leader = self._leader(pod) if worker else None
                if worker and leader is None:
                    return  # a worker pod before its leader's engine: the next relist (2 s) launches it
                # kwok hands a deleted pod's IP to the next pod of its node at once: that pod's engine is gone.
                for other_uid, other in self.engines.items():
                    if other.ip == ip and other.proc.alive():
                        self.gone.add(other_uid)
                        other.stop()
                self.engines[uid] = annotate = self._launch(pod, ip, leader)
        if annotate is not None:
            self._annotate(annotate.pod, {ENGINE_ANNOTATION: annotate.engine_id})
        if hook is not None:
            thread = threading.Thread(target=self._run_pre_stop, args=(hook,), name=f"pre-stop-{hook.pod}", daemon=True)
            self._hooks.append(thread)
            thread.start()

    def _hook_argv(self, command: list[str], ip: str) -> list[str]:
        """The rendered command, run from this venv, pointed at the engine on the pod's IP."""
        program = shutil.which(command[0], path=self._bin)
        if program is None:
            raise RuntimeError(f"the pod's preStop runs {command[0]}, which is not installed in {self._bin} (pip install -e ./connector)")
        return [program, *command[1:], "--host", ip]

    def _run_pre_stop(self, engine: PodEngine) -> None:
        """The kubelet's part: run the hook to its end, then stop the engine (SIGTERM once the hook returned)
        and let the pod go (the annotation kwok waits for). In that order, as a kubelet removes a pod only once
        its containers exited: kwok hands a gone pod's IP to the next pod of its node at once, and an engine
        still listening there would take that pod's requests."""
        hook = engine.pre_stop
        assert hook is not None
        try:
            if engine.proc.alive():
                try:
                    hook.stats_at_start = get_json(engine.url + "/sim/stats")  # no wait: the hook starts now
                except (OSError, ValueError, AssertionError):
                    pass  # not listening (yet), or dying: the hook will find out too
            hook.proc = subprocess.Popen(hook.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            hook.output, _ = hook.proc.communicate()
            hook.returncode = hook.proc.returncode
            hook.finished = time.monotonic()
            if self.stop_gone:
                engine.stop()
            if not self._stop.is_set():
                self._annotate(engine.pod, {PRE_STOP_DONE_ANNOTATION: str(hook.returncode)})
        except Exception as e:  # noqa: BLE001 - surfaced by check()
            self.errors.append(f"preStop of {engine.pod}: {type(e).__name__}: {e}")

    def _annotate(self, pod: str, annotations: dict[str, str | None]) -> None:
        try:
            self.core.patch_namespaced_pod(pod, self.namespace, {"metadata": {"annotations": annotations}})
        except client.ApiException as e:
            if e.status != 404:  # a pod already gone needs nothing
                self.errors.append(f"annotating {pod}: {e.status} {e.reason}")

    def pre_stop(self, pod: str) -> PreStop | None:
        """The preStop run of the engine of pod ``pod`` (by name), if its pod was deleted."""
        with self.lock:
            return next((e.pre_stop for e in self.engines.values() if e.pod == pod and e.pre_stop is not None), None)

    @staticmethod
    def _is_worker(pod: dict[str, Any]) -> bool:
        """A worker pod of an engine that spans pods (an LWS group's pod other than its leader), as the
        contract reads it (ValueError on a pod that cannot say, surfaced through ``errors``)."""
        meta = pod["metadata"]
        return contract.engine_group(meta["name"], meta.get("labels"), meta.get("annotations")).index > 0

    def _leader(self, pod: dict[str, Any]) -> PodEngine | None:
        """For a worker pod, its leader pod's running engine (None while there is none): the simulator's pods of
        one engine then fail together. Never the engine of a deleted leader pod (an earlier incarnation of the
        group, still draining or not yet stopped): the worker would join a group that is going."""
        name = (pod["metadata"].get("annotations") or {}).get(contract.LWS_LEADER_NAME_ANNOTATION)
        return next((e for uid, e in self.engines.items() if e.pod == name and uid not in self.gone and e.proc.alive()), None)

    def _launch(self, pod: dict[str, Any], ip: str, leader: PodEngine | None = None) -> PodEngine:
        meta = pod["metadata"]
        ann = meta.get("annotations") or {}
        labels = meta["labels"]
        name, uid, role = meta["name"], meta["uid"], labels[contract.LABEL_ROLE]
        http_port = int(ann.get(contract.ANNOTATION_HTTP_PORT, contract.HTTP_PORT))
        side_port = int(ann.get(contract.ANNOTATION_SIDE_CHANNEL_PORT, contract.NIXL_SIDE_CHANNEL_PORT))
        engine_id = contract.engine_id(name, uid)
        revision, release = labels[contract.LABEL_REVISION], ann.get(contract.ANNOTATION_VLLM_VERSION)
        ranks = [i.dp_rank for i in contract.identities_from_pod(name, uid, ip, ann, labels)]
        argv = [
            sys.executable, "-m", "disagg_bench.vllm_sim", "--role", role, "--mode", ann[contract.ANNOTATION_TRANSFER_MODE].lower(),
            "--host", ip, "--port", str(http_port), "--side-channel-port", str(side_port), "--engine-id", engine_id,
            "--served-model-name", self.served_name,
            "--tp-size", ann.get(contract.ANNOTATION_TP_SIZE, "1"), "--pp-size", ann.get(contract.ANNOTATION_PP_SIZE, "1"),
            "--dp-size", ann.get(contract.ANNOTATION_DP_SIZE, "1"),
            "--compat-hash", f"hash-{revision}",  # one NIXL compatibility hash per revision, as in vLLM
        ]  # fmt: skip
        if release:  # every pod the operator renders says it; a hand-made one gets the simulator's default
            argv += ["--vllm-version", release]
        if len(ranks) < int(ann.get(contract.ANNOTATION_DP_SIZE, "1")):  # a pod of an engine that spans pods
            argv += ["--dp-start-rank", str(ranks[0]), "--dp-size-local", str(len(ranks))]
        argv += kv_cache_argv(pod, ip)
        if leader is not None:
            argv += ["--group-leader", leader.url, "--group-leader-engine-id", leader.engine_id]
        for k, v in self.timing.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        env = engine_env(pod)
        if env:  # the container's PYTHONHASHSEED: `env` execs the simulator with it (same pid)
            argv = [shutil.which("env") or "/usr/bin/env", *(f"{k}={v}" for k, v in env.items()), *argv]
        proc = Proc(f"engine-{name}", argv, self.log_dir)
        return PodEngine(proc, name, uid, role, revision, ip, http_port, engine_id, "--kv-events-config" in argv, vllm_version=release)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listed = self.core.list_namespaced_pod(self.namespace, label_selector=self._selector, _preload_content=False)
                doc = json.loads(listed.data)
                with self.lock:  # pods deleted while no watch ran: first, as a new pod may have taken one's IP
                    live = {p["metadata"]["uid"] for p in doc["items"]}
                    went = set(self.engines) - live
                    self.gone |= went
                    if self.stop_gone:
                        for uid in went:
                            self.engines[uid].stop()
                for pod in doc["items"]:
                    self._on_pod("ADDED", pod)
                w = watch.Watch()
                for ev in w.stream(
                    self.core.list_namespaced_pod, self.namespace, label_selector=self._selector,
                    resource_version=doc["metadata"]["resourceVersion"], timeout_seconds=2, _request_timeout=30,
                ):  # fmt: skip
                    self._on_pod(ev["type"], ev["raw_object"])
                    if self._stop.is_set():
                        break
            except Exception as e:  # noqa: BLE001 - surfaced by check()
                self.errors.append(f"{type(e).__name__}: {e}")
                self._stop.wait(0.5)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pod-engines", daemon=True)
        self._thread.start()

    def check(self) -> None:
        assert len(self.errors) < 5, self.errors

    def live(self, role: str | None = None) -> list[PodEngine]:
        with self.lock:
            return [e for uid, e in self.engines.items() if uid not in self.gone and (role is None or e.role == role)]

    def all(self) -> list[PodEngine]:
        with self.lock:
            return list(self.engines.values())

    def serving(self, prefill: int, decode: int) -> list[PodEngine] | None:
        """The live engines if exactly this many per role listen (their pods Ready), else None."""
        self.check()
        engines = self.live()
        counts = (len([e for e in engines if e.role == "prefill"]), len([e for e in engines if e.role == "decode"]))
        return engines if counts == (prefill, decode) and all(e.ready() for e in engines) else None

    def retire_gone(self) -> list[PodEngine]:
        with self.lock:
            retired = [self.engines[uid] for uid in self.gone]
            self.gone.clear()
        for e in retired:
            e.stop()
        return retired

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for e in self.all():
            if e.pre_stop is not None and e.pre_stop.proc is not None and e.pre_stop.proc.poll() is None:
                e.pre_stop.proc.terminate()  # a hook still waiting: the test is over
        for thread in self._hooks:
            thread.join(timeout=10)
        for e in self.all():
            e.stop()  # keeping what it saw: a test reads its engines' events and stats after the model is gone
        # No engine runs for these pods any more: a kubelet's hook would return at once, so kwok need not hold
        # them (a namespace deleted after the test goes at once, not after each pod's grace period).
        for e in self.all():
            self._annotate(e.pod, {ENGINE_ANNOTATION: None})


# --- the router as a local process ------------------------------------------------------------------
@dataclass
class LocalRouter:
    proc: Proc
    port: int
    argv: list[str]
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def health(self) -> dict[str, Any]:
        if not self.proc.alive():
            raise RuntimeError(f"router exited:\n{self.proc.log_text()[-3000:]}")
        status, body = http_get(self.url + "/health", timeout=2)
        assert status == 200, (status, body[:300])
        return json.loads(body)

    def table(self) -> dict[str, tuple[int, int]]:
        """revision -> (prefill, decode) usable backends, as the router's /health shows them."""
        return {rev: (r["prefill"], r["decode"]) for rev, r in self.health()["revisions"].items()}


def router_kubeconfig(kubeconfig: str, token: str, namespace: str, path: Path) -> Path:
    """A kubeconfig with nothing but a token (of the router's own ServiceAccount)."""
    server = yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]["cluster"]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "router",
        "clusters": [{"name": "local", "cluster": server}],
        "users": [{"name": "router", "user": {"token": token}}],
        "contexts": [{"name": "router", "context": {"cluster": "local", "user": "router", "namespace": namespace}}],
    }))  # fmt: skip
    return path


def replace_flag(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def start_router(apps: client.AppsV1Api, namespace: str, model: str, kubeconfig: Path, log_dir: Path,
                 host: str = "127.0.0.1", port: int | None = None) -> LocalRouter:  # fmt: skip
    """The router with the arguments the operator rendered (only --port replaced, --host and --kubeconfig added).
    On a router pod's own IP and port the operator reaches its /health, as it would in a cluster."""
    deploy = apps.read_namespaced_deployment(contract.router_name(model), namespace)
    (container,) = deploy.spec.template.spec.containers
    assert container.command == ["disagg-router"], container.command
    rendered = list(container.args)
    assert rendered[rendered.index("--namespace") + 1] == namespace
    port = port or free_port()
    args = replace_flag(rendered, "--port", str(port)) + ["--host", host, "--kubeconfig", str(kubeconfig)]
    argv = [sys.executable, "-m", "disagg_connector.router", *args]
    return LocalRouter(Proc("router", argv, log_dir), port, rendered, host)



def start_pod_router(cluster: Any, namespace: str, model: str, log_dir: Path) -> LocalRouter:
    """The model's router as its (kwok) pod would run it: the operator's rendered arguments, on the pod's own IP
    and port, with a token of the router's own ServiceAccount (so RBAC is the chart's and the operator's)."""
    core, apps = client.CoreV1Api(cluster.api_client()), client.AppsV1Api(cluster.api_client())
    (router_pod,) = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=router").items
    token = cluster.kubectl("create", "token", contract.router_name(model), "-n", namespace, "--duration=1h").stdout.strip()
    return start_router(apps, namespace, model, router_kubeconfig(cluster.kubeconfig, token, namespace, log_dir / "rk"),
                        log_dir, host=router_pod.status.pod_ip, port=contract.ROUTER_PORT)  # fmt: skip


# What a simulator still works on, from its /sim/stats: requests queued or running, a decode waiting for its
# KV, a prefill's KV write under way. (KV blocks a prefill still holds are leases: a live request's decode
# takes them before the router lets go of the prefill; the rest expire, as in vLLM, and no decode reads them:
# checked by the decode side's counters below.)
BUSY = {"decode": ("active", "waiting_for_kv"), "prefill": ("active", "pushing")}
# KV a decode took that was no longer (or never) meant for it: a read after the lease, a wrong-shaped KV.
# (A failed handshake or load is not counted: kwok makes a pod Ready the moment it is bound, with a freed IP,
# so a router may try a pod whose simulated engine is not up yet; it retries elsewhere, as the zero failed
# requests show. A real engine is Ready only once it serves.)
KV_TROUBLE = ("notifications_after_expiry", "kv_wrong")


def at_deletion(engine: Any) -> dict[str, Any]:
    """A retired engine's /sim/stats as its pod got its deletionTimestamp (the harness reads them before it runs
    the pod's preStop, which waits for the engine to be idle); its last stats when no preStop ran."""
    return engine.pre_stop.stats_at_start if engine.pre_stop and engine.pre_stop.stats_at_start else engine.stats()


def assert_idle_when_deleted(retired: list[Any]) -> None:
    """Drained means idle: what each simulator held the moment its pod was deleted (before its preStop ran)."""
    for engine in retired:
        seen = at_deletion(engine)
        busy = {k: seen[k] for k in BUSY[engine.role]}
        assert not any(busy.values()), f"{engine.pod} was deleted with work in flight: {busy} {seen['in_flight']}"


def assert_no_kv_trouble(engines: list[Any]) -> None:
    for engine in engines:
        counters = engine.counters()
        assert not any(counters.get(k) for k in KV_TROUBLE), (engine.pod, {k: counters.get(k) for k in KV_TROUBLE})

# --- the demo's last step ---------------------------------------------------------------------------
async def _stream(url: str, body: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, (r.status, await r.text())
            events = [e[len("data: "):] for e in (await r.read()).decode().split("\n\n") if e.startswith("data: ")]
            return {k.lower(): v for k, v in r.headers.items()}, events


def demo(kubeconfig: str, namespace: str, model: str, token: str) -> None:
    """Engines on the model's pod IPs, its router, one streaming completion: the answer and both legs' timings."""
    api = config.new_client_from_config(config_file=kubeconfig)
    custom, apps = client.CustomObjectsApi(api), client.AppsV1Api(api)
    dm = custom.get_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, model)
    status = dm["status"]
    served = dm["spec"]["model"].get("servedModelName") or dm["spec"]["model"]["name"]
    with tempfile.TemporaryDirectory(prefix="demo-router-") as tmp:
        log_dir = Path(tmp)
        engines = PodEngines(api, namespace, model, served, log_dir)
        router: LocalRouter | None = None
        try:
            engines.start()
            running = wait_until(lambda: engines.serving(status["prefill"]["readyReplicas"], status["decode"]["readyReplicas"]), 60,
                                 what="simulated engines on the pods' IPs")  # fmt: skip
            for e in running:
                print(f"  simulated {e.role:7} engine on pod {e.pod} at {e.ip}:{e.http_port} (engine_id {e.engine_id})")
            router = start_router(apps, namespace, model, router_kubeconfig(kubeconfig, token, namespace, log_dir / "kubeconfig"), log_dir)
            wait_until(lambda: any(r["readyPairs"] for r in router.health()["revisions"].values()), 60, what="router with a ready pair")
            # long enough to be disaggregated (spec.router.disaggregationThresholdTokens decides below it)
            prompt = " ".join(["Why does pushing the KV cache shorten the time to first token?"] * 40)
            body = {"model": served, "prompt": prompt, "max_tokens": 12, "stream": True}
            t0 = time.perf_counter()
            headers, events = asyncio.run(_stream(router.url, body))
            elapsed = (time.perf_counter() - t0) * 1e3
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]" and json.loads(e)["choices"])
            xid = headers["x-request-id"]
            print(f"\n  POST {router.url}/v1/completions (stream, {len(prompt)}-byte prompt) -> {served}, revision {status['revision']}, mode {status['transferMode']}")
            print(f"  answer ({len(events) - 1} chunks, {elapsed:.1f} ms):{text}")
            print(f"  router Server-Timing: {headers.get('server-timing')}")
            for e in running:
                evs = [ev for ev in e.events() if ev.get("xid") == xid]
                if evs:
                    got = evs[0]["t"]
                    marks = ", ".join(f"{ev['kind']} +{(ev['t'] - got) * 1e3:.1f} ms" for ev in evs[1:])
                    print(f"  {e.role} leg on {e.pod}: received, {marks}")
        finally:
            if router is not None:
                router.proc.stop()
            engines.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description="The demo's last step: a streaming completion through the router to simulated engines on the pods' IPs.")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--model", required=True)
    ap.add_argument("--token", required=True, help="a token of the router's ServiceAccount (kubectl create token)")
    a = ap.parse_args()
    demo(a.kubeconfig, a.namespace, a.model, a.token)


if __name__ == "__main__":
    main()
