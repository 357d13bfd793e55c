"""A DisaggregatedModel as local processes: what to start, with which command line, env, ports and GPUs.

Pure. The model is rendered by the operator's own renderer (`disagg_operator.render.render`); each engine
process gets exactly the rendered `vllm serve` arguments and env of its Deployment's container, after the
kubelet's `$(VAR)` expansion with local values (pod name and UID -> a local name and a fresh UID, pod
IP -> the local host), with these local values in place of the pod's:

- `--port` and `VLLM_NIXL_SIDE_CHANNEL_PORT`: distinct per engine (pods each have their own IP, local
  processes share one), `--host` the local host;
- where the engines publish KV cache events, the ports of `--kv-events-config`'s publisher and replay
  endpoints (and the pod's annotations that name them), distinct per engine for the same reason, with room for
  every data-parallel rank (vLLM adds the global rank to both);
- `CUDA_VISIBLE_DEVICES`: the engine's slice of the GPUs given (accelerator.count each).

An engine that spans pods (parallelism.data more than one pod's accelerators hold: one LeaderWorkerSet
group) runs one process per pod, from the same rendered template through its real `/bin/sh -c` wrapper, with
what LWS gives each pod: `LWS_WORKER_INDEX` 0..pods-1, `LWS_LEADER_ADDRESS` the local host, `LWS_GROUP_SIZE`,
and the labels (set name, group and worker index) from which the router reads the pod's engine and first rank
(in the static endpoints file: `lws`, `group_index`, `worker_index`, `dp_size_local`). Each pod has its own HTTP port and
side-channel base; the leader's `--data-parallel-rpc-port` stays as rendered for the first such group and
is a local port for any further one (leaders in a cluster each have their own IP; here they share one).

Everything else a local run changes is an explicit option, and each one is listed in `LocalPlan.overrides`:
spec fields (transfer mode, backend, which also drops EFA: a workstation has none) are changed *before*
validation and rendering, so the same admission rules apply; engine flags (`--load-format dummy`, a local
model folder, `--enforce-eager`, `--kv-cache-memory-bytes`, ...) and env are added after.

The router is started in static mode (`--static-endpoints`) from the same identities: each engine's NIXL
engine_id is `contract.engine_id(local name, local UID)`, as the pod's would be from its name and UID. With
`router_replicas` N, every router mode runs as N identical processes on ports of their own (the router
Deployment's replicas): each knows only its own in-flight requests and shares with the others only what the
engines publish (their /metrics and KV events).
"""

from __future__ import annotations

import copy
import json
import shlex
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from disagg_connector import contract
from disagg_connector.contract import EngineIdentity

from disagg_operator.api.models import DisaggregatedModel
from disagg_operator.api.validation import parse
from disagg_operator.render import render
from .kube_env import DownwardValues, expand, resolve_env

ENGINE_CONTAINER = "vllm"
ROUTER_CONTAINER = "router"
ROUTER_MODES = ("push", "push-sequential", "pull")
# A peer's router in place of ours, on the same engines: vllm-project/router (`vllm-router`, PyPI), static URLs,
# NIXL. It has no push switch: it dispatches sequentially and, from 0.1.17 on, switches a prefill URL to
# concurrent push once that prefill's answer says `transfer_mode: "push"` (vLLM 0.33.0 says it; 0.26.0 does not).
PEER_ROUTER_MODES = ("vllmrouter-push", "vllmrouter-pull")
# A router mode may name the prefill policy after a colon ("push:prefix-and-load", "vllmrouter-push:cache_aware"),
# so that routers differing only in policy run side by side on the same engines. Ours: `--prefill-policy`
# (issue 19); vllm-router's: its `--prefill-policy` (0.1.17's choices; the decode keeps round robin).
PREFILL_POLICIES = ("prefix-and-load", "least-outstanding")
PEER_POLICIES = ("round_robin", "cache_aware", "power_of_two", "random", "consistent_hash", "sticky_least_loaded")


def split_policy(mode: str) -> tuple[str, str | None]:
    """"push:prefix-and-load" -> ("push", "prefix-and-load"); "push" -> ("push", None)."""
    base, sep, policy = mode.partition(":")
    return base, (policy if sep else None)


class LocalRunError(ValueError):
    """A model or option combination that cannot run locally; the message says what to change."""


@dataclass(frozen=True)
class Override:
    """One thing a local run does differently from the cluster, shown in every plan and result."""

    target: str
    value: str
    why: str

    def __str__(self) -> str:
        return f"{self.target} = {self.value}  ({self.why})"


@dataclass(frozen=True)
class LocalOptions:
    host: str = "127.0.0.1"
    port_base: int = 18000
    gpus: tuple[str, ...] = ("0",)
    colocate: bool = False
    workdir: str = ".localrun"
    # spec overrides (validated like any spec)
    transfer_mode: Literal["Push", "Pull"] | None = None
    backend: Literal["UCX", "LIBFABRIC"] | None = None
    # engine overrides
    model_path: str | None = None
    load_format: str | None = None
    enforce_eager: bool = False
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    # how to start things
    launcher: tuple[str, ...] = ("vllm",)
    router_command: tuple[str, ...] = (sys.executable, "-m", "disagg_connector.router")
    router_modes: tuple[str, ...] = ()  # () = the rendered router's own mode
    router_replicas: int = 1  # processes per router mode (the router Deployment's replicas)
    peer_router_command: tuple[str, ...] = ("vllm-router",)  # for the PEER_ROUTER_MODES
    # push-sequential: the router with the benchmark's dispatcher (the production router has no such mode)
    baseline_router_command: tuple[str, ...] = (sys.executable, "-m", "disagg_bench.localrun.baseline_router")


@dataclass(frozen=True)
class EngineLaunch:
    role: contract.Role
    index: int
    name: str
    uid: str
    argv: tuple[str, ...]
    env: dict[str, str]
    annotations: dict[str, str]  # the rendered pod's identity annotations, with this process's ports
    gpus: tuple[str, ...]
    secret_names: tuple[str, ...] = ()
    pod: int = 0  # the pod's index in its engine's LWS group (0: the leader, or an engine of one pod)
    pods: int = 1  # pods of this engine
    labels: dict[str, str] = field(default_factory=dict)  # what LWS labels the pod with (its set, group, worker index)

    @property
    def label(self) -> str:
        """role-index, and -pod<k> for a pod of an engine that spans pods."""
        return f"{self.role}-{self.index}" + (f"-pod{self.pod}" if self.pods > 1 else "")

    @property
    def engine_id(self) -> str:
        return contract.engine_id(self.name, self.uid)

    @property
    def host(self) -> str:
        return self.env["VLLM_NIXL_SIDE_CHANNEL_HOST"]

    @property
    def http_port(self) -> int:
        return int(self.annotations[contract.ANNOTATION_HTTP_PORT])

    @property
    def side_channel_port(self) -> int:
        return int(self.annotations[contract.ANNOTATION_SIDE_CHANNEL_PORT])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def identities(self) -> list[EngineIdentity]:
        """The NIXL identities a router reads from this engine's pod (one per DP rank), by the contract."""
        return contract.identities_from_pod(self.name, self.uid, self.host, self.annotations, self.labels)

    def static_entry(self, revision: str) -> dict[str, Any]:
        """This engine in the router's --static-endpoints format (router/discovery.py)."""
        ident = self.identities()[0]
        spans = {  # a pod of an engine that spans pods: its ranks and its group, as LWS labels the pod
            "dp_size_local": int(self.annotations[contract.ANNOTATION_DP_SIZE_LOCAL]),
            "lws": self.labels[contract.LWS_NAME_LABEL],
            "group_index": int(self.labels[contract.LWS_GROUP_INDEX_LABEL]),
            "worker_index": int(self.labels[contract.LWS_WORKER_INDEX_LABEL]),
        } if self.pods > 1 else {}
        return {
            **spans,
            "role": self.role,
            "revision": revision,
            "name": self.name,
            "uid": self.uid,
            "host": self.host,
            "http_port": self.http_port,
            "side_channel_port": self.side_channel_port,
            "tp_size": ident.tp_size,
            "pp_size": ident.pp_size,
            "dp_size": int(self.annotations.get(contract.ANNOTATION_DP_SIZE, "1")),
            "mode": self.annotations[contract.ANNOTATION_TRANSFER_MODE],  # the router follows it, as for pods
            **self._kv_events_entry(),
        }

    def _kv_events_entry(self) -> dict[str, Any]:
        """Where this engine publishes KV events and how it hashes blocks (static entry keys; none without events)."""
        keys = {"kv_events_port": contract.ANNOTATION_KV_EVENTS_PORT, "kv_events_replay_port": contract.ANNOTATION_KV_EVENTS_REPLAY_PORT,
                "kv_hash_seed": contract.ANNOTATION_KV_HASH_SEED, "kv_block_size": contract.ANNOTATION_KV_BLOCK_SIZE}
        return {key: (self.annotations[a] if key == "kv_hash_seed" else int(self.annotations[a]))
                for key, a in keys.items() if a in self.annotations}

    def command_line(self) -> str:
        """The engine as a shell line: its env (the rendered container's and the local values; Secret values
        masked) and argv."""
        env = {k: ("***" if k in self.secret_names else v) for k, v in self.env.items()}
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(self.argv)])


@dataclass(frozen=True)
class RouterLaunch:
    mode: str
    argv: tuple[str, ...]
    port: int
    host: str
    metrics_port: int | None = None  # a peer router's Prometheus listener (ours serves /metrics on `port`)
    replica: int = 0  # of router_replicas processes of this mode

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def label(self) -> str:
        """The mode, and `#<replica>` for every replica but the first."""
        return self.mode + (f"#{self.replica}" if self.replica else "")


@dataclass(frozen=True)
class LocalPlan:
    model: str
    served_model_name: str
    revision: str
    transfer_mode: str
    backend: str
    engines: tuple[EngineLaunch, ...]
    routers: tuple[RouterLaunch, ...]
    static_endpoints_path: str
    overrides: tuple[Override, ...] = field(default_factory=tuple)

    def role(self, role: str) -> list[EngineLaunch]:
        return [e for e in self.engines if e.role == role]

    def static_endpoints(self) -> dict[str, Any]:
        return {"endpoints": [e.static_entry(self.revision) for e in self.engines]}

    def router(self, mode: str) -> RouterLaunch:
        """The (first replica of the) router of `mode`."""
        return self.router_replicas(mode)[0]

    def router_replicas(self, mode: str) -> list[RouterLaunch]:
        """Every replica of the router of `mode`, in replica order."""
        out = [r for r in self.routers if r.mode == mode]
        if not out:
            raise KeyError(mode)
        return out


# --- spec-level overrides ------------------------------------------------------------------------------
def _spec_overrides(doc: dict[str, Any], options: LocalOptions) -> tuple[dict[str, Any], list[Override]]:
    doc = copy.deepcopy(doc)
    spec = doc.setdefault("spec", {})
    overrides: list[Override] = []
    if options.transfer_mode:
        spec.setdefault("kvTransfer", {})["mode"] = options.transfer_mode
        overrides.append(Override("spec.kvTransfer.mode", options.transfer_mode, "transfer mode of this local run"))
    if options.backend:
        spec.setdefault("kvTransfer", {})["backend"] = options.backend
        overrides.append(Override("spec.kvTransfer.backend", options.backend, "NIXL backend of this local run"))
        if options.backend == "UCX":
            for role in contract.ENGINE_ROLES:
                efa = spec.setdefault(role, {}).setdefault("efa", {})
                if efa.get("count", 0):
                    efa["count"] = 0
                    overrides.append(Override(f"spec.{role}.efa.count", "0", "no EFA devices on a local machine"))
    return doc, overrides


# --- argv edits ----------------------------------------------------------------------------------------
def drop_flag(argv: list[str], flag: str, takes_value: bool = True) -> list[str]:
    """argv without `flag` (`--flag v`, `--flag=v`, or a bare `--flag` when it takes no value)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = takes_value
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def set_flag(argv: list[str], flag: str, value: str | None) -> list[str]:
    """argv with `flag` set to `value` once (a bare flag when value is None), at the end."""
    return drop_flag(argv, flag, value is not None) + ([flag] if value is None else [flag, value])


def flag_value(argv: list[str] | tuple[str, ...], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _engine_overrides(options: LocalOptions) -> tuple[list[tuple[str, str | None]], list[Override]]:
    flags: list[tuple[str, str | None]] = []
    if options.load_format:
        flags.append(("--load-format", options.load_format))
    if options.enforce_eager:
        flags.append(("--enforce-eager", None))
    if options.kv_cache_memory_bytes is not None:
        flags.append(("--kv-cache-memory-bytes", str(options.kv_cache_memory_bytes)))
    if options.gpu_memory_utilization is not None:
        flags.append(("--gpu-memory-utilization", str(options.gpu_memory_utilization)))
    overrides = [Override("engine flag", f if v is None else f"{f} {v}", "local option") for f, v in flags]
    if options.extra_args:
        overrides.append(Override("engine args", shlex.join(options.extra_args), "local option, appended"))
    if options.model_path:
        overrides.append(Override("engine model", options.model_path, "local model folder instead of the spec's model reference"))
    overrides += [Override("engine env", f"{k}={v}", "local option") for k, v in options.env]
    return flags, overrides


def kv_events_config_on(config: str | None, port: int, replay_port: int) -> str:
    """vLLM's --kv-events-config JSON with its publisher and replay endpoints moved to these ports (same hosts)."""
    if config is None:
        raise LocalRunError("the engine's pod says it publishes KV events, but its command line has no --kv-events-config")
    doc = json.loads(config)

    def moved(endpoint: str, to: int) -> str:
        address, sep, _ = endpoint.rpartition(":")
        return f"{address}{sep}{to}" if sep else endpoint

    doc["endpoint"] = moved(doc["endpoint"], port)
    if doc.get("replay_endpoint"):
        doc["replay_endpoint"] = moved(doc["replay_endpoint"], replay_port)
    return json.dumps(doc, separators=(",", ":"))


# --- the plan ------------------------------------------------------------------------------------------
def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    for c in _pod_template(deployment)["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise LocalRunError(f"rendered {deployment['kind']} {deployment['metadata']['name']} has no container {name!r}")


def _deployments(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each role's workload: a Deployment, or a LeaderWorkerSet for an engine that spans pods (a gateway's endpoint
    picker, of no role, runs only in a cluster)."""
    out = {}
    for obj in objects:
        role = obj["metadata"].get("labels", {}).get(contract.LABEL_ROLE)
        if obj["kind"] in ("Deployment", "LeaderWorkerSet") and role:
            out[role] = obj
    return out


def _pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return workload["spec"]["template"]


class _Ports:
    def __init__(self, base: int) -> None:
        self.next = base

    def take(self, n: int = 1) -> int:
        first = self.next
        self.next += n
        if self.next > 65536:
            raise LocalRunError("ports run past 65535 from --port-base: choose a lower base")
        return first


# UCX between two processes on one GPU: NIXL 1.5.1 leaves cuda_ipc's zero-copy GET off, so pull's READ falls
# back to software emulation over TCP loopback (0.4 GB/s against push's WRITE at ~72 GB/s); with it on, READ
# runs at WRITE's speed (74 GB/s, bench/results). NIXL PR #2208 makes the same change inside NIXL.
SHARED_GPU_UCX_ENV = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": ("on", "UCX on one GPU: pull's READ zero-copy over cuda_ipc, as push's WRITE"),
    "UCX_PROTO_EMULATION_ENABLE": ("n", "UCX on one GPU: a fallback to emulated transfers fails loudly instead of crawling"),
}


def _shared_gpu_ucx_env(backend: str, gpus: Mapping[tuple[str, int, int], tuple[str, ...]],
                        given: Mapping[str, str]) -> dict[str, tuple[str, str]]:  # fmt: skip
    """The UCX settings that make pull fair when a prefill and a decode engine share a GPU (and the user did
    not set them): one GPU must not measure a transport artefact instead of pull."""
    prefill = {g for key, ids in gpus.items() if key[0] == "prefill" for g in ids}
    decode = {g for key, ids in gpus.items() if key[0] == "decode" for g in ids}
    if backend != "UCX" or not prefill & decode:
        return {}
    return {k: v for k, v in SHARED_GPU_UCX_ENV.items() if k not in given}


def _assign_gpus(dm: DisaggregatedModel, options: LocalOptions) -> dict[tuple[str, int, int], tuple[str, ...]]:
    """Each pod's GPUs, keyed (role, engine, pod), in order prefill 0..n, decode 0..n (an engine that spans pods:
    its pods in order); wrapping onto used GPUs only if colocate."""
    wanted = []
    for role in contract.ENGINE_ROLES:
        spec = getattr(dm.spec, role)
        if spec.accelerator.type != "nvidia":
            raise LocalRunError(
                f"spec.{role}.accelerator.type is {spec.accelerator.type}: local runs start vLLM on NVIDIA GPUs only"
            )
        wanted += [((role, i, k), spec.accelerator.count) for i in range(spec.replicas) for k in range(spec.shape.pods)]
    need = sum(n for _, n in wanted)
    gpus = list(options.gpus)
    if not gpus:
        raise LocalRunError("no GPUs given: pass --gpus, e.g. --gpus 0,1")
    if need > len(gpus) and not options.colocate:
        raise LocalRunError(
            f"the engines need {need} GPUs ({', '.join(f'{r}-{i}' + (f'-pod{k}' if k else '') + f': {n}' for (r, i, k), n in wanted)}) and {len(gpus)} "
            "are given: pass more with --gpus, lower the replicas or parallelism, or --colocate to share GPUs"
        )
    if any(n > len(gpus) for _, n in wanted):
        raise LocalRunError(f"one engine needs more GPUs than the {len(gpus)} given (--gpus)")
    out: dict[tuple[str, int, int], tuple[str, ...]] = {}
    cursor = 0
    for key, n in wanted:
        if cursor + n > len(gpus):
            cursor = 0  # colocate: start again from the first GPU
        out[key] = tuple(gpus[cursor : cursor + n])
        cursor += n
    if need > len(gpus) and options.kv_cache_memory_bytes is None:
        raise LocalRunError(
            "engines share GPUs (--colocate): each vLLM engine's memory profiling would count the other's "
            "allocations; pass --kv-cache-memory-bytes so that both can start"
        )
    return out


def _check_model_reference(dm: DisaggregatedModel, options: LocalOptions) -> None:
    source = dm.spec.model.source
    if options.model_path is None and source is not None and source.uri.startswith("pvc://"):
        raise LocalRunError(
            f"spec.model.source {source.uri} is a volume inside the cluster: pass --model-path with a local copy"
        )


def local_plan(
    doc: dict[str, Any],
    options: LocalOptions,
    new_uid: Callable[[], str] = lambda: str(uuid.uuid4()),
    secrets: Mapping[str, str] | None = None,
) -> LocalPlan:
    """The local processes of one DisaggregatedModel document. Raises SpecError or LocalRunError.

    `secrets`: where env entries from Kubernetes Secrets take their values (by env var name; a local run
    passes its own environment)."""
    doc, overrides = _spec_overrides(doc, options)
    dm = parse(doc)
    _check_model_reference(dm, options)
    rendered = render(dm)
    deployments = _deployments(rendered.objects)
    flags, engine_overrides = _engine_overrides(options)
    overrides += engine_overrides
    gpus = _assign_gpus(dm, options)
    shared_gpu_env = _shared_gpu_ucx_env(rendered.plan.backend, gpus, dict(options.env))
    overrides += [Override("engine env", f"{k}={v}", why) for k, (v, why) in shared_gpu_env.items()]
    ports = _Ports(options.port_base)
    router_modes = options.router_modes or (rendered.plan.mode.lower(),)
    for mode in router_modes:
        base, policy = split_policy(mode)
        if base not in ROUTER_MODES + PEER_ROUTER_MODES:
            raise LocalRunError(f"router mode {mode!r}: choose from {', '.join(ROUTER_MODES + PEER_ROUTER_MODES)}")
        if policy is not None and policy not in (PEER_POLICIES if base in PEER_ROUTER_MODES else PREFILL_POLICIES):
            raise LocalRunError(f"router mode {mode!r}: unknown prefill policy {policy!r}")
        if base in PEER_ROUTER_MODES and base.split("-")[1] != rendered.plan.mode.lower():
            raise LocalRunError(f"router mode {mode!r} needs engines in {base.split('-')[1]} mode; these are {rendered.plan.mode}")
    if options.router_replicas < 1:
        raise LocalRunError("router replicas: at least 1")
    replicas = range(options.router_replicas)
    router_ports = {(mode, k): ports.take() for mode in router_modes for k in replicas}
    peer_metrics_ports = {(mode, k): ports.take() for mode in router_modes for k in replicas
                          if split_policy(mode)[0] in PEER_ROUTER_MODES}
    secrets = dict(secrets or {})

    engines = []
    rpc_port_rendered_taken = False
    for role in contract.ENGINE_ROLES:
        role_spec = getattr(dm.spec, role)
        deployment = deployments[role]
        container = _container(deployment, ENGINE_CONTAINER)
        template = _pod_template(deployment)
        template_annotations = template["metadata"]["annotations"]
        pods = role_spec.shape.pods
        for index in range(role_spec.replicas):
            rpc_port: int | None = None
            if pods > 1 and rpc_port_rendered_taken:  # another group's leader already has the rendered port
                rpc_port = ports.take()
                overrides.append(Override(f"{role}-{index} --data-parallel-rpc-port", str(rpc_port),
                                          "leaders of two LWS groups share one host here; in a cluster each has its own IP"))
            rpc_port_rendered_taken = rpc_port_rendered_taken or pods > 1
            for pod in range(pods):
                name = f"{deployment['metadata']['name']}-local-{index}" + (f"-{pod}" if pod else "")
                uid = new_uid()
                http_port = ports.take()
                side_port = ports.take(role_spec.parallelism.data)
                annotations = {**template_annotations, contract.ANNOTATION_HTTP_PORT: str(http_port),
                               contract.ANNOTATION_SIDE_CHANNEL_PORT: str(side_port)}
                events_ports: tuple[int, int] | None = None
                if contract.ANNOTATION_KV_EVENTS_PORT in annotations:  # the engines publish KV events
                    events_ports = (ports.take(role_spec.parallelism.data), ports.take(role_spec.parallelism.data))
                    annotations[contract.ANNOTATION_KV_EVENTS_PORT] = str(events_ports[0])
                    annotations[contract.ANNOTATION_KV_EVENTS_REPLAY_PORT] = str(events_ports[1])
                entries = container.get("env", [])
                # LWS adds its env to every container of the group's pods (before the template's own entries)
                lws_env = {contract.LWS_LEADER_ADDRESS_ENV: options.host, contract.LWS_WORKER_INDEX_ENV: str(pod),
                           "LWS_GROUP_SIZE": str(pods)} if pods > 1 else {}
                labels = {contract.LWS_NAME_LABEL: deployment["metadata"]["name"], contract.LWS_GROUP_INDEX_LABEL: str(index),
                          contract.LWS_WORKER_INDEX_LABEL: str(pod)} if pods > 1 else {}
                env = {**lws_env, **resolve_env(entries, DownwardValues(name, uid, options.host, dm.metadata.namespace), secrets)}
                secret_names = tuple(e["name"] for e in entries if "secretKeyRef" in (e.get("valueFrom") or {}))
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[role, index, pod])
                env.update({k: v for k, (v, _) in shared_gpu_env.items()})
                env.update(dict(options.env))
                command = [expand(a, env) for a in container["command"]]
                args = [expand(a, env) for a in container["args"]]
                # `/bin/sh -c SCRIPT vllm serve ...` (an engine that spans pods) or `vllm serve ...`: the shell
                # and its script stay as rendered; the local edits go to vLLM's own command line
                shell = command[:3] if command[:2] == ["/bin/sh", "-c"] else []
                argv = [*command[len(shell):], *args]
                if options.model_path:
                    argv[2] = options.model_path
                argv = set_flag(argv, "--port", str(http_port))
                argv = set_flag(argv, "--host", options.host)
                if rpc_port is not None:
                    argv = set_flag(argv, "--data-parallel-rpc-port", str(rpc_port))
                if events_ports is not None:
                    argv = set_flag(argv, "--kv-events-config", kv_events_config_on(flag_value(argv, "--kv-events-config"), *events_ports))
                for flag, value in flags:
                    argv = set_flag(argv, flag, value)
                argv = [*shell, *options.launcher, *argv[1:], *options.extra_args]
                engines.append(EngineLaunch(role, index, name, uid, tuple(argv), env, annotations, gpus[role, index, pod],
                                            secret_names, pod=pod, pods=pods, labels=labels))

    static_path = f"{options.workdir}/endpoints.json"
    router_container = _container(deployments["router"], ROUTER_CONTAINER)
    routers = []
    if options.router_replicas > 1:
        overrides.append(Override("router replicas", str(options.router_replicas),
                                  "router processes per mode, each with its own in-flight counts, sharing the engines"))
    for (mode, replica), port in router_ports.items():
        dispatch, policy = split_policy(mode)
        if dispatch in PEER_ROUTER_MODES:
            metrics_port = peer_metrics_ports[mode, replica]
            argv = peer_router_argv(engines, options.host, port, metrics_port, policy)
            routers.append(RouterLaunch(mode, (*options.peer_router_command, *argv), port, options.host, metrics_port, replica))
            if replica == 0:
                overrides.append(Override(f"router ({mode})", shlex.join(options.peer_router_command),
                                          "a peer's router in place of ours, on the same engines, under test"))
            continue
        argv = list(router_container["args"])
        for flag in ("--namespace", "--selector"):
            argv = drop_flag(argv, flag)
        argv = set_flag(argv, "--static-endpoints", static_path)
        argv = set_flag(argv, "--port", str(port))
        argv = set_flag(argv, "--host", options.host)
        if dispatch != rendered.plan.mode.lower():
            argv = set_flag(argv, "--mode", dispatch)
            if replica == 0:
                overrides.append(Override("router --mode", dispatch, "dispatch mode under test"))
        if policy is not None:
            argv = set_flag(argv, "--prefill-policy", policy)
            if replica == 0:
                overrides.append(Override(f"router ({mode}) --prefill-policy", policy, "routing policy under test"))
        command = options.baseline_router_command if dispatch == "push-sequential" else options.router_command
        routers.append(RouterLaunch(mode, (*command, *argv), port, options.host, replica=replica))

    return LocalPlan(
        model=dm.metadata.name,
        served_model_name=flag_value(engines[0].argv, "--served-model-name") or dm.spec.model.name,
        revision=rendered.revision,
        transfer_mode=rendered.plan.mode,
        backend=rendered.plan.backend,
        engines=tuple(engines),
        routers=tuple(routers),
        static_endpoints_path=static_path,
        overrides=tuple(overrides),
    )


def peer_router_argv(engines: list[EngineLaunch], host: str, port: int, metrics_port: int, prefill_policy: str | None = None) -> list[str]:
    """vllm-router's P/D command line for these engines (static URLs; vllm-router 0.1.17's flags): NIXL, round
    robin (its default, cache_aware, would favour engines by prompt prefix) unless `prefill_policy` names the
    prefill's (the decode's stays round robin), its worker check every second instead of 30 (it opens its port
    only once every engine is healthy); everything else its defaults (concurrency limit 32768, so its request
    queue stays unused here; cache_aware's thresholds: cache 0.3, balance abs 64 / rel 1.5)."""
    if any(e.pods > 1 for e in engines):
        raise LocalRunError("vllm-router is planned for engines of one pod each (static URLs, one per engine)")
    argv = ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for e in engines:
        argv += ["--prefill", e.url] if e.role == "prefill" else ["--decode", e.url]
    policy = ["--policy", "round_robin"] + (["--prefill-policy", prefill_policy] if prefill_policy else [])
    return argv + ["--host", host, "--port", str(port), *policy,
                   "--prometheus-host", host, "--prometheus-port", str(metrics_port),
                   "--worker-startup-check-interval", "1", "--log-level", "info"]


def describe(plan: LocalPlan) -> str:
    """The plan as a person reads it: every process with its command line, then the overrides."""
    lines = [f"# {plan.model}: revision {plan.revision}, {plan.transfer_mode} via {plan.backend}"]
    for e in plan.engines:
        ranks = e.identities()
        dp = (f", DP ranks {ranks[0].dp_rank}-{ranks[-1].dp_rank} of {ranks[0].dp_size}"
              + (f" (LWS worker {e.pod} of {e.pods})" if e.pods > 1 else "")) if ranks[0].dp_size > 1 else ""
        lines.append(f"# {e.label}: engine_id {e.engine_id}, GPUs {','.join(e.gpus)}, "
                     f"http {e.http_port}, side channel {e.side_channel_port}{dp}")
        lines.append(e.command_line())
    for r in plan.routers:
        lines.append(f"# router ({r.label}) on {r.url}")
        lines.append(shlex.join(r.argv))
    lines.append(f"# static endpoints ({plan.static_endpoints_path}):")
    lines.append(json.dumps(plan.static_endpoints(), indent=1))
    lines.append("# local overrides:" if plan.overrides else "# local overrides: none")
    lines += [f"#   {o}" for o in plan.overrides]
    return "\n".join(lines)
