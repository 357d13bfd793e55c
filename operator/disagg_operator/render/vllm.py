"""The vLLM 0.33.0 launch wiring of one prefill or decode engine: command line and environment.

Facts from docs/vllm-protocol.md: P and D run the same connector class (the
compatibility hash includes the transfer mode), kv_role is kv_producer on P and kv_consumer on D, the
engine_id is explicit so a router can address P before dispatch, VLLM_NIXL_SIDE_CHANNEL_HOST is both the
bind and the advertised address (so it must be the pod IP), and the NIXL backend list comes only from
kv_connector_extra_config (no env var overrides it). Where the router's prefill policy reads them, every engine
publishes vLLM's KV cache events and hashes its blocks reproducibly (docs/vllm-protocol.md, "KV events").
"""

from __future__ import annotations

import json
from typing import Any

from disagg_connector import contract

from ..api.models import DisaggregatedModelSpec, EngineShape, RoleSpec
from ..quantity import parse_quantity
from ..resolve import TransferPlan

MODEL_MOUNT_ROOT = "/models"
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
# Env vars that make libfabric use EFA the way NIXL needs it (docs/vllm-protocol.md, "EFA under NIXL").
EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    # shm transfers corrupted GPU buffers under load (Dynamo PR #9712): keep EFA traffic on EFA.
    "FI_EFA_ENABLE_SHM_TRANSFER": "0",
}


def model_reference(spec: DisaggregatedModelSpec) -> str:
    """What vLLM is told to load: a hub id, a path on the mounted PVC, or an s3:// URI."""
    source = spec.model.source
    if source is None:
        return spec.model.name
    scheme, rest = source.uri.split("://", 1)
    if scheme == "hf":
        return rest
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return f"{MODEL_MOUNT_ROOT}/{claim}/{path}".rstrip("/")
    return source.uri  # s3:// is streamed by vLLM's run:ai loader


def served_model_name(spec: DisaggregatedModelSpec) -> str:
    return spec.model.served_model_name or spec.model.name


def kv_transfer_config(spec: DisaggregatedModelSpec, role: contract.Role, plan: TransferPlan) -> dict[str, Any]:
    """The NIXL connector of the transfer plan; with a CPU tier (spec.<role>.kvCache.cpu), a MultiConnector of it
    and vLLM's OffloadingConnector (docs/vllm-protocol.md, "A CPU tier")."""
    extra: dict[str, Any] = {
        "backends": [plan.backend],
        "kv_lease_duration": spec.kv_transfer.lease_seconds,
    }
    if spec.kv_transfer.bidirectional:
        extra["bidirectional_kv_xfer"] = True
    nixl = {
        "kv_connector": plan.connector,
        "kv_role": KV_ROLE[role],
        "engine_id": contract.engine_id_template(),
        "kv_buffer_device": plan.buffer_device,
        "kv_load_failure_policy": spec.kv_transfer.load_failure_policy.lower(),
        "kv_connector_extra_config": extra,
    }
    cpu = role_cpu_tier_bytes(getattr(spec, role))
    if cpu is None:
        return nixl
    # NIXL first: MultiConnector loads a request's KV from the first child that offers tokens, and a decode must
    # take the prefill's KV over NIXL, never a partial CPU hit. Each child is a whole KVTransferConfig; the engine
    # id is the parent's (MultiConnector hands it to children that name none).
    child = {k: v for k, v in nixl.items() if k != "engine_id"}
    offload = {"kv_connector": contract.OFFLOADING_CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": cpu}}
    return {
        "kv_connector": contract.MULTI_CONNECTOR,
        "kv_role": KV_ROLE[role],
        "engine_id": nixl["engine_id"],
        "kv_load_failure_policy": nixl["kv_load_failure_policy"],
        "kv_connector_extra_config": {"connectors": [child, offload]},
    }


def role_cpu_tier_bytes(role: RoleSpec) -> int | None:
    """The CPU tier of each engine core of the role, in bytes (vLLM's cpu_bytes_to_use), or None."""
    return None if role.kv_cache.cpu is None else int(parse_quantity(role.kv_cache.cpu))


def kv_events_config() -> dict[str, Any]:
    """vLLM's --kv-events-config: a ZMQ publisher and its replay socket on every interface of the pod, at the
    contract's ports (vLLM adds each engine core's data-parallel rank to both)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{contract.KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{contract.KV_EVENTS_REPLAY_PORT}",
        "topic": contract.KV_EVENTS_TOPIC,
    }


def kv_events_args(spec: DisaggregatedModelSpec) -> list[str]:
    """The flags of an engine that publishes KV events: the publisher, and block hashes another process can
    reproduce (sha256 over CBOR; both releases default to sha256 over pickle). The same on 0.26.0 and 0.33.0."""
    if not spec.publishes_kv_events:
        return []
    return [
        "--kv-events-config", json.dumps(kv_events_config(), separators=(",", ":")),
        "--prefix-caching-hash-algo", contract.KV_HASH_ALGO,
    ]  # fmt: skip


def serve_command(spec: DisaggregatedModelSpec, role: contract.Role, plan: TransferPlan) -> list[str]:
    """The full container command line, `vllm serve <model> ...`, before $(VAR) expansion."""
    role_spec: RoleSpec = getattr(spec, role)
    par = role_spec.parallelism
    engine = spec.engine
    argv = [
        "vllm", "serve", model_reference(spec),
        "--port", str(contract.HTTP_PORT),
        "--served-model-name", served_model_name(spec),
        "--tensor-parallel-size", str(par.tensor),
        "--pipeline-parallel-size", str(par.pipeline),
        "--data-parallel-size", str(par.data),
        "--block-size", str(engine.block_size),
        "--dtype", spec.model.dtype,
    ]  # fmt: skip
    if par.context > 1:
        argv += ["--decode-context-parallel-size", str(par.context)]
    if par.expert:
        argv.append("--enable-expert-parallel")
    if spec.model.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", spec.model.kv_cache_dtype]
    if spec.model.max_model_len is not None:
        argv += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.model.source is not None and spec.model.source.uri.startswith("s3://"):
        argv += ["--load-format", "runai_streamer"]
    argv.append("--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching")
    if engine.enable_sleep_mode:
        argv.append("--enable-sleep-mode")
    if engine.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    config = kv_transfer_config(spec, role, plan)
    argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    argv += kv_events_args(spec)
    if role_spec.shape.spans_pods:
        argv += data_parallel_args(role_spec.shape)
    return argv + list(engine.extra_args) + list(role_spec.extra_args)


# The one computed flag of a pod in an engine that spans pods: its first data-parallel rank, its LWS worker
# index x the ranks each pod runs. Kubernetes' $(VAR) expansion cannot multiply, so a shell appends it and
# execs vLLM: "$0" "$@" are the command line as rendered, untouched by the shell.
START_RANK_SCRIPT = 'exec "$0" "$@" --data-parallel-start-rank "$(({index} * {local}))"'


def data_parallel_args(shape: EngineShape) -> list[str]:
    """The flags every pod of an engine that spans pods adds (docs/vllm-protocol.md, "Data parallel across
    pods"): vLLM's hybrid load balancing, where each pod runs an API server for its own ranks (the router
    addresses a rank through the pod that serves it), stated on every pod (vLLM 0.26.0 does not infer it on the
    leader), with the group leader's address from LWS and the startup handshake's port."""
    return [
        "--data-parallel-size-local", str(shape.ranks_per_pod),
        "--data-parallel-address", f"$({contract.LWS_LEADER_ADDRESS_ENV})",
        "--data-parallel-rpc-port", str(contract.DATA_PARALLEL_RPC_PORT),
        "--data-parallel-hybrid-lb",
    ]  # fmt: skip


def with_start_rank(argv: list[str], shape: EngineShape) -> list[str]:
    """`/bin/sh -c <script> <argv>`: the pod's start rank appended from its LWS worker index."""
    script = START_RANK_SCRIPT.format(index=contract.LWS_WORKER_INDEX_ENV, local=shape.ranks_per_pod)
    return ["/bin/sh", "-c", script, *argv]


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def engine_env(spec: DisaggregatedModelSpec, role: contract.Role, plan: TransferPlan) -> list[dict[str, Any]]:
    role_spec: RoleSpec = getattr(spec, role)
    env = [
        # Order matters: $(VAR) expands only variables defined earlier in the list.
        _field_env(contract.ENV_POD_NAME, "metadata.name"),
        _field_env(contract.ENV_POD_UID, "metadata.uid"),
        _field_env(contract.ENV_POD_IP, "status.podIP"),
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": f"$({contract.ENV_POD_IP})"},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(spec.kv_transfer.side_channel_port)},
    ]
    if spec.publishes_kv_events:
        # vLLM's first block hash is hash_fn(PYTHONHASHSEED); unset, 0.26.0 draws it at random per process.
        env.append({"name": "PYTHONHASHSEED", "value": contract.kv_hash_seed(spec.model.name)})
    if role_spec.efa.count > 0:
        env += [{"name": k, "value": v} for k, v in EFA_ENV.items()]
        huge = "0" if spec.network.efa.hugepages == "0" else "1"
        env.append({"name": "FI_EFA_USE_HUGE_PAGE", "value": huge})
    source = spec.model.source
    if source is not None and source.secret_ref is not None and source.uri.startswith("hf://"):
        key = source.secret_ref.key or "HF_TOKEN"
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": source.secret_ref.name, "key": key}}}
        )
    # User env last: role entries override engine entries of the same name.
    user = {e.name: e.value for e in spec.engine.env}
    user.update({e.name: e.value for e in role_spec.env})
    env += [{"name": k, "value": v} for k, v in user.items()]
    return env


def env_from(spec: DisaggregatedModelSpec) -> list[dict[str, Any]]:
    source = spec.model.source
    if source is not None and source.secret_ref is not None and source.uri.startswith("s3://"):
        return [{"secretRef": {"name": source.secret_ref.name}}]
    return []
