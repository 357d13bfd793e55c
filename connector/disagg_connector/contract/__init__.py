"""The contract between the operator, the vLLM pods and the router: names, labels, ports, NIXL identity.

One source of truth. The operator imports this module to render children; the router imports it to
discover and address pods. Nothing here talks to an API or imports the operator: pure functions only.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping

API_GROUP = "disagg.dev"
API_VERSION = "v1alpha1"
KIND = "DisaggregatedModel"
PLURAL = "disaggregatedmodels"
SINGULAR = "disaggregatedmodel"
SHORT_NAMES = ("dm", "dmodel")

# The scale target of one engine role: its name survives revisions (kubectl scale, HPA, KEDA point at it).
ROLE_KIND = "DisaggregatedRole"
ROLE_PLURAL = "disaggregatedroles"
ROLE_SINGULAR = "disaggregatedrole"
ROLE_SHORT_NAMES = ("dmrole",)

OPERATOR_NAME = "disagg-operator"
FIELD_MANAGER = OPERATOR_NAME

Role = Literal["prefill", "decode", "router"]
ENGINE_ROLES: tuple[Role, Role] = ("prefill", "decode")

# --- labels ---------------------------------------------------------------------------------------
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_MODEL = f"{API_GROUP}/model"
LABEL_ROLE = f"{API_GROUP}/role"
LABEL_REVISION = f"{API_GROUP}/revision"
APP_NAME = "disaggregated-model"

# --- annotations on P and D pods: the NIXL identity a router needs before dispatch -----------------
ANNOTATION_TP_SIZE = f"{API_GROUP}/tensor-parallel-size"
ANNOTATION_PP_SIZE = f"{API_GROUP}/pipeline-parallel-size"
ANNOTATION_DP_SIZE = f"{API_GROUP}/data-parallel-size"  # the engine's, over all its pods
# The data-parallel ranks one pod of a multi-pod engine serves: [start, start + local). Absent: the pod
# serves every rank of its engine (start 0, local = size), the one-pod case.
ANNOTATION_DP_START_RANK = f"{API_GROUP}/data-parallel-start-rank"
ANNOTATION_DP_SIZE_LOCAL = f"{API_GROUP}/data-parallel-size-local"
# An engine that spans pods is one LeaderWorkerSet group: LWS gives each pod its index in the group (label
# and env) and the leader's address (env). A pod's first rank is its index x the ranks each pod serves.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # 0: the group's leader
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # the LeaderWorkerSet's name, on every pod of its groups
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # the group (one engine) within the LWS
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
LWS_LEADER_NAME_ANNOTATION = "leaderworkerset.sigs.k8s.io/leader-name"  # on a worker: its group's leader pod
# Gangs (docs/gang-scheduling.md): the chart's admission policy puts each pod labelled LABEL_GANG in a PodGroup
# the operator makes: a pod of an LWS group (GANG_LWS_GROUP) in the one named after its group's leader pod,
# `<LWS name>-<group index>`; a pod of a one-pod engine (GANG_PAIR) in the one its LABEL_POD_GROUP names, its
# revision's pair_pod_group_name.
LABEL_GANG, GANG_LWS_GROUP, GANG_PAIR = f"{API_GROUP}/gang", "lws-group", "pair"
LABEL_POD_GROUP = f"{API_GROUP}/pod-group"
# vLLM's data-parallel startup handshake, on the group's leader (its default, --data-parallel-rpc-port).
DATA_PARALLEL_RPC_PORT = 29550
ANNOTATION_SIDE_CHANNEL_PORT = f"{API_GROUP}/nixl-side-channel-port"
ANNOTATION_HTTP_PORT = f"{API_GROUP}/http-port"
ANNOTATION_TRANSFER_MODE = f"{API_GROUP}/transfer-mode"
# The vLLM release the engine runs (spec.engine.vllmVersion): what its NIXL protocol answers differ in.
ANNOTATION_VLLM_VERSION = f"{API_GROUP}/vllm-version"
# KV cache events (docs/vllm-protocol.md, "KV events"), on engine pods only where the engines publish them: the
# ports of vLLM's ZMQ publisher and of its replay socket (each + the global data-parallel rank), the seed vLLM's
# block hashes start from (PYTHONHASHSEED) and the block size they are computed over, all that a router needs to
# subscribe and to hash a prompt as the engine does.
ANNOTATION_KV_EVENTS_PORT = f"{API_GROUP}/kv-events-port"
ANNOTATION_KV_EVENTS_REPLAY_PORT = f"{API_GROUP}/kv-events-replay-port"
ANNOTATION_KV_HASH_SEED = f"{API_GROUP}/kv-hash-seed"
ANNOTATION_KV_BLOCK_SIZE = f"{API_GROUP}/kv-block-size"
# Set by the operator on a P or D pod it is about to remove (value: RFC 3339 time it was marked). The
# router sends such a pod no new request and reports its in-flight count; the operator deletes the pod
# once every router reports zero, or once the leg deadline plus the KV lease has passed since the mark.
ANNOTATION_DRAINING = f"{API_GROUP}/draining"

# --- commands of the data-plane package the operator renders into engine pods -----------------------
# The vllm container's preStop (disagg_connector.drain): waits until the engine is idle, then returns.
DRAIN_COMMAND = "disagg-drain"

# --- ports ----------------------------------------------------------------------------------------
HTTP_PORT = 8000
HTTP_PORT_NAME = "http"
NIXL_SIDE_CHANNEL_PORT = 5600
NIXL_PORT_NAME = "nixl"
ROUTER_PORT = 8000
# vLLM's KV event publisher (ZMQ PUB) and its replay socket (ZMQ ROUTER), one each per engine core at base + its
# global data-parallel rank. With NIXL's default 5600 and at most MAX_DATA_PARALLEL_SIZE ranks the three ranges
# [5600, 5664), [5700, 5764), [5800, 5864) are disjoint and clear of HTTP_PORT and DATA_PARALLEL_RPC_PORT
# (tests/unit/operator/render/test_kv_events_render.py); admission refuses a moved side channel that overlaps them.
KV_EVENTS_PORT = 5700
KV_EVENTS_REPLAY_PORT = 5800
KV_EVENTS_PORT_NAME, KV_EVENTS_REPLAY_PORT_NAME = "kv-events", "kv-replay"
KV_EVENTS_TOPIC = "kv-events"
# The block hash both vLLM releases offer whose bytes another language can reproduce (CBOR, not pickle).
KV_HASH_ALGO = "sha256_cbor"
# The most data-parallel ranks the API admits for one engine (spec.<role>.parallelism.data).
MAX_DATA_PARALLEL_SIZE = 64
# GAIE's endpoint picker protocol: ext-proc gRPC on 9002, its gRPC health service on 9003, metrics on 9090.
LWEPP_GRPC_PORT, LWEPP_HEALTH_PORT, LWEPP_METRICS_PORT = 9002, 9003, 9090

# --- vLLM releases the operator renders for --------------------------------------------------------
VLLM_VERSIONS = ("0.24.0", "0.26.0", "0.33.0", "0.34.0")


@dataclass(frozen=True)
class VllmProtocol:
    """What a router or launcher must know of one vLLM release's P/D protocol (docs/vllm-versions.md)."""

    version: str

    @property
    def returns_transfer_mode(self) -> bool:
        """Prefill's kv_transfer_params carry `transfer_mode` ("push"/"pull") from 0.33.0 on."""
        return _version_tuple(self.version) >= (0, 33, 0)

    @property
    def push_with_prefill_pipeline(self) -> bool:
        """NixlPushConnector takes a pipeline-parallel prefill (and reads `pp_size`) from 0.26.0 on."""
        return _version_tuple(self.version) >= (0, 26, 0)


# vLLM's connector that runs several (a CPU tier beside NIXL: docs/vllm-protocol.md, "A CPU tier").
MULTI_CONNECTOR, OFFLOADING_CONNECTOR = "MultiConnector", "OffloadingConnector"


def transfer_connector_config(kv_transfer_config: Mapping[str, Any]) -> dict[str, Any]:
    """The connector that moves KV between prefill and decode in an engine's --kv-transfer-config: the config
    itself, or a MultiConnector's first child, with the parent's engine id where it names none (as vLLM's
    MultiConnector hands it down)."""
    if kv_transfer_config.get("kv_connector") != MULTI_CONNECTOR:
        return dict(kv_transfer_config)
    first = kv_transfer_config["kv_connector_extra_config"]["connectors"][0]
    return {"engine_id": kv_transfer_config.get("engine_id"), **first}


def cpu_tier_bytes(kv_transfer_config: Mapping[str, Any]) -> int:
    """The CPU tier of an engine's --kv-transfer-config (its OffloadingConnector's cpu_bytes_to_use), or 0."""
    children = kv_transfer_config.get("kv_connector_extra_config", {}).get("connectors", []) \
        if kv_transfer_config.get("kv_connector") == MULTI_CONNECTOR else [kv_transfer_config]
    for child in children:
        if child.get("kv_connector") == OFFLOADING_CONNECTOR:
            return int(child.get("kv_connector_extra_config", {}).get("cpu_bytes_to_use", 0))
    return 0


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


# --- extended resources the operator requests for an engine pod (the user sets counts, never names) ---
ACCELERATOR_RESOURCES: Mapping[str, str] = {"nvidia": "nvidia.com/gpu", "neuron": "aws.amazon.com/neuron"}
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
DEVICE_RESOURCES = (*ACCELERATOR_RESOURCES.values(), EFA_RESOURCE, HUGEPAGES_RESOURCE)

# Downward API env vars that the engine id is assembled from inside the pod ($(VAR) expansion).
ENV_POD_NAME = "POD_NAME"
ENV_POD_UID = "POD_UID"
ENV_POD_IP = "POD_IP"

MAX_NAME_LENGTH = 63
# A Service name (DNS-1035 label, up to 63 characters): what every child name must be.
DNS_1035_LABEL_RE = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_DNS_LABEL = re.compile(DNS_1035_LABEL_RE)


def short_hash(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def fit_name(*parts: str, limit: int = MAX_NAME_LENGTH) -> str:
    """Join parts with '-' into a DNS-1035 label of at most `limit` characters.

    A name that fits is returned as is, so the common case reads naturally (`qwen-prefill`). A longer
    one keeps the last part (the role, which people grep for) and replaces the tail of the first with a
    hash of the whole, so two long CR names never collide.
    """
    full = "-".join(p for p in parts if p)
    if len(full) <= limit:
        return full
    suffix = "-".join(p for p in parts[1:] if p)
    digest = short_hash(full)
    room = limit - len(suffix) - len(digest) - 2
    head = parts[0][: max(room, 1)].rstrip("-")
    return "-".join(p for p in (head, digest, suffix) if p)[:limit].rstrip("-")


def is_dns_label(name: str) -> bool:
    return len(name) <= MAX_NAME_LENGTH and bool(_DNS_LABEL.match(name))


def model_label_value(model_name: str) -> str:
    """Label values are limited to 63 characters; CR names are not."""
    return fit_name(model_name)


# --- child names: deterministic, one function each -------------------------------------------------
def role_service_name(model: str, role: Role) -> str:
    return fit_name(model, role)


def engine_deployment_name(model: str, role: Role, revision: str) -> str:
    """P and D Deployments carry the revision: a new revision is a new pair, never a mixed rollout."""
    return fit_name(model, role, revision)


def pair_pod_group_name(model: str, revision: str) -> str:
    """The PodGroup of a revision's prefill and decode pods (one-pod engines); its pods carry it as LABEL_POD_GROUP."""
    return fit_name(model, revision, "pair")


def role_scaler_name(model: str, role: Role) -> str:
    """The DisaggregatedRole (and its HPA) of one engine role: no revision in it."""
    return fit_name(model, role)


def router_name(model: str) -> str:
    return fit_name(model, "router")


def inference_pool_name(model: str) -> str:
    """The Gateway API inference extension's InferencePool of the model: its router pods (docs/gateway.md)."""
    return fit_name(model, "router")


def http_route_name(model: str) -> str:
    """The HTTPRoute from the model's parent Gateways to its InferencePool."""
    return fit_name(model, "route")


def endpoint_picker_name(model: str) -> str:
    """GAIE's lightweight endpoint picker (lwepp) of the model's InferencePool: Deployment, Service and RBAC."""
    return fit_name(model, "lwepp")


def engines_network_policy_name(model: str) -> str:
    return fit_name(model, "engines")


def pdb_name(model: str, role: Role) -> str:
    return fit_name(model, role)


def router_url(model: str, namespace: str, port: int) -> str:
    return f"http://{router_name(model)}.{namespace}.svc:{port}"


# --- labels ----------------------------------------------------------------------------------------
def selector_labels(model: str, role: Role) -> dict[str, str]:
    """The stable subset used in selectors (never includes the revision: selectors are immutable)."""
    return {LABEL_MODEL: model_label_value(model), LABEL_ROLE: role}


def owned_selector(model: str) -> dict[str, str]:
    """Every child of one DisaggregatedModel carries these: how the operator finds stale children."""
    return {LABEL_MANAGED_BY: OPERATOR_NAME, LABEL_MODEL: model_label_value(model)}


def common_labels(model: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: model_label_value(model),
        LABEL_COMPONENT: component,
        **owned_selector(model),
    }


def child_labels(model: str, role: Role, revision: str | None = None) -> dict[str, str]:
    labels = {**common_labels(model, role), LABEL_ROLE: role}
    if revision is not None:
        labels[LABEL_REVISION] = revision
    return labels


def pod_serving(pod: Mapping[str, Any]) -> bool:
    """A pod (as the API returns it, a dict) that counts: Ready=True and not terminating. The operator's
    ready counts and the router's backends are the same pods."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and str(c.get("status")) == "True" for c in conditions)


# --- NIXL identity ---------------------------------------------------------------------------------
def engine_id(pod_name: str, pod_uid: str) -> str:
    """The NIXL engine_id of one pod incarnation: a restarted pod gets a new UID, hence a new id.

    Used twice with the same code: the operator calls it with "$(POD_NAME)" and "$(POD_UID)" so that
    Kubernetes expands the Downward API values into vLLM's --kv-transfer-config, and the router calls it
    with the pod's real name and UID.
    """
    return f"{pod_name}.{pod_uid}"


def engine_id_template() -> str:
    return engine_id(f"$({ENV_POD_NAME})", f"$({ENV_POD_UID})")


def dp_engine_id(base_engine_id: str, dp_rank: int, dp_size: int) -> str:
    """vLLM suffixes `_dp<rank>` to the configured engine_id when data parallel size > 1: the global rank,
    also on a pod whose ranks start above 0 (docs/vllm-protocol.md, "Data parallel across pods")."""
    return f"{base_engine_id}_dp{dp_rank}" if dp_size > 1 else base_engine_id


def side_channel_port(base_port: int, dp_rank: int) -> int:
    """One ZMQ handshake listener per engine core (DP rank), at base + its global rank (vLLM 0.26.0 and 0.33.0)."""
    return base_port + dp_rank


def kv_events_port(base_port: int, dp_rank: int) -> int:
    """vLLM offsets its KV event endpoints by the engine core's global data-parallel rank (offset_endpoint_port,
    given parallel_config.data_parallel_index, which is the global rank in 0.26.0 and 0.33.0), as NIXL's port."""
    return base_port + dp_rank


def kv_hash_seed(model_name: str) -> str:
    """PYTHONHASHSEED of a model's engines: vLLM's first block hash (NONE_HASH) is hash_fn(PYTHONHASHSEED), so
    every engine of the model and the router must share it. Deterministic, an integer in [0, 2**32) as Python
    requires of PYTHONHASHSEED."""
    return str(int.from_bytes(hashlib.sha256(model_name.encode()).digest()[:4], "big"))


def tcp_endpoint(host: str, port: int) -> str:
    """A ZMQ tcp:// endpoint; an IPv6 host in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(frozen=True)
class EngineIdentity:
    """What a router must know of a prefill engine before it dispatches a push decode leg."""

    engine_id: str
    host: str
    side_channel_port: int
    tp_size: int
    pp_size: int
    dp_rank: int = 0  # global: what engine_id and the side-channel port carry
    http_port: int = HTTP_PORT
    dp_size: int = 1  # the engine's
    dp_start_rank: int = 0  # the first rank this pod serves
    # Where this rank publishes its KV cache events and answers replay requests, the seed and block size its
    # block hashes use: None when the engine publishes no events (contract.ANNOTATION_KV_EVENTS_PORT absent).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_hash_seed: str | None = None
    kv_block_size: int | None = None

    @property
    def dp_local_index(self) -> int:
        """What `X-data-parallel-rank` must say to this pod's API server to reach this rank: with a pod serving
        ranks [start, start + local) (vLLM's hybrid load balancing) the header is an index into its own."""
        return self.dp_rank - self.dp_start_rank

    def push_decode_params(self, remote_request_id: str, transfer_id: str) -> dict[str, object]:
        """kv_transfer_params of a push decode leg.

        vLLM 0.33.0 reads the identity keys with [] (a missing one is a KeyError in the engine core);
        vLLM main matches the two legs on ``transfer_id`` (the same value in the prefill leg), released
        versions on the request id and ignore the extra key.
        """
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.side_channel_port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "remote_request_id": remote_request_id,
            "transfer_id": transfer_id,
        }


def lws_pod_address(leader_address: str, worker_index: int) -> str:
    """The DNS name of a group's pod, from its leader's (``LWS_LEADER_ADDRESS``, ``<lws>-<group>.<subdomain>.<ns>``).
    LWS (v0.9.0, ``pod_utils.AddLWSVariables``) names a group's workers ``<lws>-<group>-<index>``, pods of the
    StatefulSet ``<lws>-<group>`` whose service is the leader's subdomain: so worker i is the leader's first label
    with ``-<i>``, under the same subdomain (either subdomain policy). Worker 0 is the leader."""
    if worker_index == 0:
        return leader_address
    first, dot, rest = leader_address.partition(".")
    if not first or not dot:
        raise ValueError(f"{LWS_LEADER_ADDRESS_ENV}={leader_address!r} is not <leader>.<subdomain>.<namespace>")
    return f"{first}-{worker_index}.{rest}"


def identities_from_pod(
    name: str, uid: str, pod_ip: str, annotations: Mapping[str, str], labels: Mapping[str, str] | None = None
) -> list[EngineIdentity]:
    """The NIXL identities (one per data-parallel rank it serves) of a P or D pod, read per the contract.
    A pod of an LWS group starts at its worker index x its local size, unless its annotations say the start.
    ValueError when the annotations do not make sense (a rank range outside the engine's size)."""
    tp = int(annotations.get(ANNOTATION_TP_SIZE, "1"))
    pp = int(annotations.get(ANNOTATION_PP_SIZE, "1"))
    dp = int(annotations.get(ANNOTATION_DP_SIZE, "1"))
    local = int(annotations.get(ANNOTATION_DP_SIZE_LOCAL, "0")) or None
    index = (labels or {}).get(LWS_WORKER_INDEX_LABEL)
    start = int(annotations.get(ANNOTATION_DP_START_RANK) or (int(index) * local if index is not None and local else 0))
    local = local or dp - start
    if start < 0 or local < 1 or start + local > dp:
        raise ValueError(f"data-parallel ranks [{start}, {start + local}) are not within the engine's {dp}")
    base_port = int(annotations.get(ANNOTATION_SIDE_CHANNEL_PORT, str(NIXL_SIDE_CHANNEL_PORT)))
    http_port = int(annotations.get(ANNOTATION_HTTP_PORT, str(HTTP_PORT)))
    base = engine_id(name, uid)
    events_port = _optional_int(annotations, ANNOTATION_KV_EVENTS_PORT)
    replay_port = _optional_int(annotations, ANNOTATION_KV_EVENTS_REPLAY_PORT)
    block_size = _optional_int(annotations, ANNOTATION_KV_BLOCK_SIZE)

    def endpoint(port: int | None, rank: int) -> str | None:
        return None if port is None else tcp_endpoint(pod_ip, kv_events_port(port, rank))

    return [
        EngineIdentity(
            engine_id=dp_engine_id(base, rank, dp),
            host=pod_ip,
            side_channel_port=side_channel_port(base_port, rank),
            tp_size=tp,
            pp_size=pp,
            dp_rank=rank,
            http_port=http_port,
            dp_size=dp,
            dp_start_rank=start,
            kv_events_endpoint=endpoint(events_port, rank),
            kv_events_replay_endpoint=endpoint(replay_port, rank),
            kv_hash_seed=annotations.get(ANNOTATION_KV_HASH_SEED) or None,
            kv_block_size=block_size,
        )
        for rank in range(start, start + local)
    ]


def _optional_int(annotations: Mapping[str, str], key: str) -> int | None:
    value = annotations.get(key)
    return int(value) if value else None


# --- engines that span pods --------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineGroup:
    """The engine a pod belongs to: ``key`` names it (equal for every pod of one engine, within a namespace),
    ``pods`` is how many pods it has, ``index`` is this pod's place among them (its LWS worker index)."""

    key: str
    pods: int
    index: int = 0


def engine_group(pod_name: str, labels: Mapping[str, str] | None, annotations: Mapping[str, str] | None) -> EngineGroup:
    """Which engine a P or D pod belongs to, and how many pods that engine has. Pure and cheap (a few
    lookups): the operator counts engines with it, the router offers an engine only while all its pods serve.

    A pod that serves only some of its engine's data-parallel ranks (``ANNOTATION_DP_SIZE_LOCAL`` below
    ``ANNOTATION_DP_SIZE``) is one of ``size // local`` pods of one LeaderWorkerSet group: key
    ``<LWS name>/<group index>`` (``LWS_NAME_LABEL``, ``LWS_GROUP_INDEX_LABEL``; the same across LWS's
    recreations of the group), index its ``LWS_WORKER_INDEX_LABEL``. Any other pod is an engine of its
    own: key ``pod_name``, one pod, index 0 (LWS labels alone do not make a group of one pod).

    ValueError when the pod cannot say: ranks per pod that do not divide the engine's size, or a pod of a
    multi-pod engine without its LWS name, group index or a worker index within the group.
    """
    annotations = annotations or {}
    labels = labels or {}
    size = int(annotations.get(ANNOTATION_DP_SIZE) or "1")
    local = int(annotations.get(ANNOTATION_DP_SIZE_LOCAL) or "0") or size
    if size < 1 or local < 1 or size % local:
        raise ValueError(f"{local} data-parallel ranks per pod do not divide the engine's {size}")
    pods = size // local
    if pods == 1:
        return EngineGroup(pod_name, 1, 0)
    lws, group, index = labels.get(LWS_NAME_LABEL), labels.get(LWS_GROUP_INDEX_LABEL), labels.get(LWS_WORKER_INDEX_LABEL)
    if not lws or group is None or index is None:
        raise ValueError(
            f"pod {pod_name} serves {local} of its engine's {size} data-parallel ranks but lacks the labels "
            f"{LWS_NAME_LABEL}, {LWS_GROUP_INDEX_LABEL} and {LWS_WORKER_INDEX_LABEL} that say its engine"
        )
    if not 0 <= int(index) < pods:
        raise ValueError(f"pod {pod_name}: worker index {index} is not within its engine's {pods} pods")
    return EngineGroup(f"{lws}/{int(group)}", pods, int(index))
