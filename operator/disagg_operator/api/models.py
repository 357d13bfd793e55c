"""The DisaggregatedModel API (disagg.dev/v1alpha1): the single source of truth for spec and status.

The CRD in crds/ is generated from these models (`disagg_operator.api.crd`), defaults and cross-field
CEL rules included. Field names are camelCase on the wire and snake_case in Python.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from disagg_connector import contract

from .cel import CelRule

# --- building blocks --------------------------------------------------------------------------------


class ApiModel(BaseModel):
    """Base of every API object: camelCase aliases, unknown fields refused, immutable once parsed."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        if cls.cel_rules:
            target["x-kubernetes-validations"] = [r.to_schema() for r in cls.cel_rules]
        # pydantic leaves default_factory values out of the schema; the API server must default them
        # too, or CEL rules would meet absent lists and maps (an evaluation error, not a refusal).
        for name, field in cls.model_fields.items():
            prop = target.get("properties", {}).get(field.alias or name)
            if prop is not None and field.default_factory is not None:
                value = field.default_factory()  # type: ignore[call-arg]
                if isinstance(value, BaseModel):
                    # Spelled out in full: the API server checks a default against the CEL rules
                    # without applying the nested defaults first.
                    value = value.model_dump(by_alias=True, mode="json", exclude_none=True)
                prop["default"] = value
        return schema


def _sub(model: type[BaseModel]) -> Any:
    """A nested object that defaults to its own defaults, in Python and in the CRD."""
    return Field(default_factory=model)


# Kubernetes resource.Quantity, accepted as int or string like kubectl does.
_QUANTITY_RE = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _quantity(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a quantity is a number or a string such as 64Gi")
    if isinstance(value, (int, float)):
        value = str(value)
    if isinstance(value, str) and not re.match(_QUANTITY_RE, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (examples: 8, 500m, 64Gi)")
    return value


# A quantity that CEL rules compare (always a string on the wire, e.g. "5120Mi" or "0").
StrQuantity = Annotated[str, Field(pattern=_QUANTITY_RE, max_length=64)]

Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    WithJsonSchema(
        {  # the only int-or-string shape structural schemas allow: pattern beside anyOf, not in it
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": _QUANTITY_RE,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

# Free-form Kubernetes objects we pass through (affinity, NetworkPolicy peers): the API server keeps them.
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]

Name = Annotated[str, Field(min_length=1, max_length=253)]
LabelMap = Annotated[dict[str, str], Field(max_length=64)]
Port = Annotated[int, Field(ge=1024, le=65000)]

# Flags and env vars that the operator owns: setting them by hand would silently break the P/D wiring.
MANAGED_FLAGS = (
    "--kv-transfer-config",
    "--port",
    "--host",
    "--model",
    "--served-model-name",
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
    "--decode-context-parallel-size",
    "-dcp",
    "--block-size",
    "--dtype",
    "--kv-cache-dtype",
    "--enable-sleep-mode",
)
MANAGED_ENV = (
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    contract.ENV_POD_NAME,
    contract.ENV_POD_UID,
    contract.ENV_POD_IP,
)


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


_NO_MANAGED_FLAGS = CelRule(
    rule=(
        f"self.extraArgs.all(a, !{_cel_list(MANAGED_FLAGS)}.exists(f, "
        "a == f || a.startsWith(f + '=') || a.startsWith(f + '.')))"
    ),
    message=(
        "extraArgs must not set flags the operator manages (" + ", ".join(MANAGED_FLAGS) + "): "
        "use the matching spec fields (model, engine.blockSize, kvTransfer, parallelism) instead"
    ),
    field_path=".extraArgs",
)
_NO_MANAGED_ENV = CelRule(
    rule=f"self.env.all(e, !(e.name in {_cel_list(MANAGED_ENV)}))",
    message=(
        "env must not set variables the operator manages (" + ", ".join(MANAGED_ENV) + "): "
        "the NIXL side channel is wired from the pod IP and spec.kvTransfer.sideChannelPort"
    ),
    field_path=".env",
)

ExtraArgs = Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=64)]


class EnvVar(ApiModel):
    name: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")]
    value: Annotated[str, Field(max_length=32768)] = ""


EnvList = Annotated[list[EnvVar], Field(max_length=128)]


class Toleration(ApiModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SecretKeyRef(ApiModel):
    name: Name
    key: str | None = Field(
        default=None,
        description="Key in the Secret. hf:// reads one key (default HF_TOKEN); s3:// loads the "
        "whole Secret as env (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) when unset.",
    )


# --- model and engine -------------------------------------------------------------------------------


class ModelSource(ApiModel):
    uri: Annotated[str, Field(pattern=r"^(hf|pvc|s3)://[^\s]+$", max_length=1024)] = Field(
        description="hf://org/name, pvc://claim/path/in/claim or s3://bucket/prefix"
    )
    secret_ref: SecretKeyRef | None = None


class ModelSpec(ApiModel):
    name: Annotated[str, Field(min_length=1, max_length=512)] = Field(
        description="The model vLLM serves, e.g. Qwen/Qwen3-32B (also the default served name)."
    )
    served_model_name: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    source: ModelSource | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    max_model_len: Annotated[int, Field(ge=1)] | None = None


class EngineSpec(ApiModel):
    cel_rules = (_NO_MANAGED_FLAGS, _NO_MANAGED_ENV)

    image: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        default=None,
        description="vLLM runtime image (vLLM + EFA + NIXL + disagg_connector). Unset: the "
        "operator's default, so one operator setting moves every model.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    block_size: Literal[16, 32, 64, 128, 256] = Field(
        default=128,
        description="KV block size in tokens, the same on prefill and decode (vLLM's push handshake "
        "asserts it). Small blocks split a transfer into many descriptors.",
    )
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    extra_args: ExtraArgs = Field(default_factory=list)
    env: EnvList = Field(default_factory=list)
    startup_timeout_seconds: Annotated[int, Field(ge=60, le=86400)] = Field(
        default=3600, description="How long vLLM may take to load weights before it is restarted."
    )
    termination_grace_period_seconds: Annotated[int, Field(ge=0, le=3600)] = 120


# --- KV transfer ------------------------------------------------------------------------------------


class KvTransferSpec(ApiModel):
    mode: Literal["Auto", "Push", "Pull"] = Field(
        default="Auto",
        description="Auto = Push unless the spec asks for something push cannot do "
        "(bidirectional KV, decode pipeline or context parallel, sleep mode).",
    )
    backend: Literal["Auto", "LIBFABRIC", "UCX"] = Field(
        default="Auto", description="Auto = LIBFABRIC when EFA devices are requested, UCX otherwise."
    )
    side_channel_port: Port = contract.NIXL_SIDE_CHANNEL_PORT
    lease_seconds: Annotated[int, Field(ge=5, le=3600)] = Field(
        default=120,
        description="vLLM kv_lease_duration: how long prefill keeps finished KV blocks for decode. "
        "Must exceed the router's request deadline.",
    )
    load_failure_policy: Literal["Fail", "Recompute"] = "Fail"
    bidirectional: bool = Field(
        default=False, description="Multi-turn KV reuse (decode KV read back by prefill): pull only."
    )
    buffer_device: Literal["Auto", "cuda", "cpu"] = Field(
        default="Auto", description="kv_buffer_device. Auto = cuda on nvidia, cpu on neuron."
    )


# --- roles ------------------------------------------------------------------------------------------


class Parallelism(ApiModel):
    tensor: Annotated[int, Field(ge=1, le=64)] = 1
    pipeline: Annotated[int, Field(ge=1, le=64)] = 1
    data: Annotated[int, Field(ge=1, le=64)] = 1
    context: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1, description="Decode context parallel size (decode only; pull only)."
    )


class AcceleratorSpec(ApiModel):
    type: Literal["nvidia", "neuron"] = "nvidia"
    count: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1,
        description="GPUs (nvidia.com/gpu) or Neuron devices (aws.amazon.com/neuron) per pod. "
        "vLLM needs an accelerator on both roles.",
    )


class EfaSpec(ApiModel):
    count: Annotated[int, Field(ge=0, le=32)] = Field(
        default=0, description="vpc.amazonaws.com/efa devices per pod (p5en.48xlarge has 16)."
    )


class ResourceRequirements(ApiModel):
    requests: Annotated[dict[str, Quantity], Field(max_length=32)] = Field(default_factory=dict)
    limits: Annotated[dict[str, Quantity], Field(max_length=32)] = Field(default_factory=dict)


class AutoscalingSpec(ApiModel):
    cel_rules = (
        CelRule(
            rule="self.minReplicas <= self.maxReplicas",
            message="autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
            field_path=".minReplicas",
        ),
    )

    min_replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    max_replicas: Annotated[int, Field(ge=1, le=1000)]


class RoleSpec(ApiModel):
    cel_rules = (
        CelRule(
            rule=(
                "self.accelerator.type != 'nvidia' || self.accelerator.count == "
                "self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.data"
            ),
            message="accelerator.count must equal parallelism.tensor x pipeline x data: one pod runs "
            "every rank of one vLLM engine, one GPU each",
            field_path=".accelerator.count",
        ),
        _NO_MANAGED_FLAGS,
        _NO_MANAGED_ENV,
    )

    replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    parallelism: Parallelism = _sub(Parallelism)
    accelerator: AcceleratorSpec = _sub(AcceleratorSpec)
    efa: EfaSpec = _sub(EfaSpec)
    resources: ResourceRequirements = _sub(ResourceRequirements)
    node_selector: LabelMap = Field(default_factory=dict)
    tolerations: Annotated[list[Toleration], Field(max_length=32)] = Field(default_factory=list)
    affinity: FreeForm | None = Field(
        default=None,
        description="Kubernetes affinity; the operator adds its own P/D placement terms to it.",
    )
    priority_class_name: Annotated[str, Field(max_length=253)] | None = None
    scheduler_name: Annotated[str, Field(max_length=253)] | None = None
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="When set, the operator stops owning replicas so that an HPA or KEDA can; "
        "replicas is only the initial size.",
    )
    extra_args: ExtraArgs = Field(default_factory=list)
    env: EnvList = Field(default_factory=list)


# --- router, network, rollout ----------------------------------------------------------------------


class ServiceSpec(ApiModel):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: Annotated[int, Field(ge=1, le=65535)] = contract.ROUTER_PORT
    annotations: LabelMap = Field(default_factory=dict)


class RouterSpec(ApiModel):
    replicas: Annotated[int, Field(ge=0, le=100)] = 2
    image: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        default=None, description="Router image. Unset: the operator's default."
    )
    service: ServiceSpec = _sub(ServiceSpec)
    request_deadline_seconds: Annotated[int, Field(ge=1, le=3600)] = Field(
        default=60,
        description="The router's deadline for each leg of a request; both legs are cancelled "
        "when it passes. Must stay below kvTransfer.leaseSeconds.",
    )
    max_retries: Annotated[int, Field(ge=0, le=5)] = Field(
        default=1, description="Retries on another P/D pair, only while nothing reached the client."
    )
    decode_selection: Literal["LeastOutstanding"] = "LeastOutstanding"
    resources: ResourceRequirements = _sub(ResourceRequirements)
    node_selector: LabelMap = Field(default_factory=dict)
    tolerations: Annotated[list[Toleration], Field(max_length=32)] = Field(default_factory=list)


class EfaNetworkSpec(ApiModel):
    hugepages: StrQuantity = Field(
        default="5120Mi",
        description="hugepages-2Mi per EFA pod (libfabric's FI_EFA_USE_HUGE_PAGE); '0' turns it off.",
    )
    shared_memory: StrQuantity = Field(
        default="64Gi", description="Size of the memory-backed /dev/shm of every vLLM pod."
    )
    privileged: bool = Field(
        default=False,
        description="Run EFA pods privileged (some setups need it for fi_mr_reg of GPU memory); "
        "false adds only the IPC_LOCK capability.",
    )


class PlacementSpec(ApiModel):
    zone: Literal["Required", "Preferred", "None"] = Field(
        default="Required", description="Keep prefill and decode pods in one availability zone."
    )
    spine: Literal["Required", "Preferred", "None"] = Field(
        default="Preferred", description="Keep prefill and decode pods under one network spine."
    )
    spine_topology_key: Annotated[str, Field(min_length=1, max_length=316)] = (
        "topology.k8s.aws/network-node-layer-3"
    )
    separate_hosts: bool = Field(
        default=False,
        description="Require prefill and decode on different nodes (some EFA setups fail with "
        "EAGAIN when both share a host).",
    )


class NetworkPolicySpec(ApiModel):
    enabled: bool = True
    metrics_from: Annotated[list[FreeForm], Field(max_length=16)] = Field(
        default_factory=list,
        description="NetworkPolicy peers (e.g. a Prometheus namespaceSelector) also allowed to "
        "reach the engines' HTTP port for /metrics.",
    )


class NetworkSpec(ApiModel):
    efa: EfaNetworkSpec = _sub(EfaNetworkSpec)
    placement: PlacementSpec = _sub(PlacementSpec)
    network_policy: NetworkPolicySpec = _sub(NetworkPolicySpec)


def _int_or_percent(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and re.match(r"^[0-9]{1,3}%$", value):
        return value
    raise ValueError("must be a non-negative integer or a percentage such as 25%")


IntOrPercent = Annotated[
    int | str,
    BeforeValidator(_int_or_percent),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": r"^[0-9]{1,3}%$",
            "x-kubernetes-int-or-string": True,
        }
    ),
]


class RoleRollout(ApiModel):
    max_surge: IntOrPercent = Field(default="25%")
    max_unavailable: IntOrPercent = 0


class RolloutSpec(ApiModel):
    prefill: RoleRollout = _sub(RoleRollout)
    decode: RoleRollout = _sub(RoleRollout)


# --- spec -------------------------------------------------------------------------------------------

_PUSH_INCOMPATIBLE = "mode Push cannot {what}: set spec.kvTransfer.mode to Pull (or Auto, which picks pull) {fix}"

SPEC_RULES = (
    CelRule(
        rule=(
            "self.prefill.parallelism.tensor % self.decode.parallelism.tensor == 0 || "
            "self.decode.parallelism.tensor % self.prefill.parallelism.tensor == 0"
        ),
        message="prefill and decode tensor-parallel sizes must divide each other (vLLM maps KV heads "
        "between them): make spec.decode.parallelism.tensor a divisor or multiple of "
        "spec.prefill.parallelism.tensor",
        field_path=".decode.parallelism.tensor",
    ),
    CelRule(
        rule="!(self.kvTransfer.mode == 'Push' && self.kvTransfer.bidirectional)",
        message=_PUSH_INCOMPATIBLE.format(
            what="do bidirectional KV reuse", fix="or set spec.kvTransfer.bidirectional to false"
        ),
        field_path=".kvTransfer.mode",
    ),
    CelRule(
        rule="!(self.kvTransfer.mode == 'Push' && self.decode.parallelism.pipeline > 1)",
        message=_PUSH_INCOMPATIBLE.format(
            what="run decode with pipeline parallel > 1 (vLLM rejects a kv_consumer with PP)",
            fix="or set spec.decode.parallelism.pipeline to 1",
        ),
        field_path=".kvTransfer.mode",
    ),
    CelRule(
        rule="!(self.kvTransfer.mode == 'Push' && self.decode.parallelism.context > 1)",
        message=_PUSH_INCOMPATIBLE.format(
            what="run decode with context parallel > 1",
            fix="or set spec.decode.parallelism.context to 1",
        ),
        field_path=".kvTransfer.mode",
    ),
    CelRule(
        rule="!(self.kvTransfer.mode == 'Push' && self.engine.enableSleepMode)",
        message=_PUSH_INCOMPATIBLE.format(
            what="use sleep mode", fix="or set spec.engine.enableSleepMode to false"
        ),
        field_path=".kvTransfer.mode",
    ),
    CelRule(
        rule="self.prefill.parallelism.context == 1",
        message="context parallelism applies to decode only: set spec.prefill.parallelism.context to 1",
        field_path=".prefill.parallelism.context",
    ),
    CelRule(
        rule="!(self.kvTransfer.backend == 'UCX' && (self.prefill.efa.count > 0 || self.decode.efa.count > 0))",
        message="backend UCX over EFA silently runs at TCP speed: set spec.kvTransfer.backend to "
        "LIBFABRIC (or Auto), or request no EFA devices",
        field_path=".kvTransfer.backend",
    ),
    CelRule(
        rule="(self.prefill.efa.count == 0) == (self.decode.efa.count == 0)",
        message="EFA must be on both roles or on neither (NIXL runs one backend on both sides): set "
        "spec.prefill.efa.count and spec.decode.efa.count both above 0, or both to 0",
        field_path=".decode.efa.count",
    ),
    CelRule(
        rule="self.prefill.accelerator.type == self.decode.accelerator.type",
        message="prefill and decode must run on the same accelerator type (their KV caches must match "
        "byte for byte): make spec.decode.accelerator.type equal spec.prefill.accelerator.type",
        field_path=".decode.accelerator.type",
    ),
    CelRule(
        rule="self.kvTransfer.leaseSeconds > self.router.requestDeadlineSeconds",
        message="spec.kvTransfer.leaseSeconds must exceed spec.router.requestDeadlineSeconds, or "
        "prefill frees KV blocks before a queued decode can take them",
        field_path=".kvTransfer.leaseSeconds",
    ),
    CelRule(
        rule=(
            "self.kvTransfer.sideChannelPort > 8000 || self.kvTransfer.sideChannelPort + "
            "self.prefill.parallelism.data <= 8000 && self.kvTransfer.sideChannelPort + "
            "self.decode.parallelism.data <= 8000"
        ),
        message="the NIXL side-channel ports (sideChannelPort + data-parallel rank) overlap vLLM's HTTP "
        "port 8000: move spec.kvTransfer.sideChannelPort",
        field_path=".kvTransfer.sideChannelPort",
    ),
    CelRule(
        rule=(
            "self.prefill.efa.count == 0 || !has(self.network.efa.hugepages) || "
            "self.network.efa.hugepages == '0' || "
            "(['cpu', 'memory'].exists(r, r in self.prefill.resources.requests) && "
            "['cpu', 'memory'].exists(r, r in self.decode.resources.requests))"
        ),
        message="Kubernetes refuses hugepages without a cpu or memory request: set "
        "resources.requests.memory (or cpu) on both roles, or spec.network.efa.hugepages to '0'",
        field_path=".network.efa.hugepages",
    ),
)


class DisaggregatedModelSpec(ApiModel):
    cel_rules = SPEC_RULES

    model: ModelSpec
    engine: EngineSpec = _sub(EngineSpec)
    kv_transfer: KvTransferSpec = _sub(KvTransferSpec)
    prefill: RoleSpec = _sub(RoleSpec)
    decode: RoleSpec = _sub(RoleSpec)
    router: RouterSpec = _sub(RouterSpec)
    network: NetworkSpec = _sub(NetworkSpec)
    rollout: RolloutSpec = _sub(RolloutSpec)


# --- status -----------------------------------------------------------------------------------------

class Condition(ApiModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class RoleStatus(ApiModel):
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0


class RouterStatus(ApiModel):
    ready_replicas: int = 0
    url: str | None = None


class DisaggregatedModelStatus(ApiModel):
    observed_generation: int | None = None
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Invalid"] | None = None
    transfer_mode: Literal["Push", "Pull"] | None = None
    transfer_mode_reason: str | None = None
    backend: Literal["LIBFABRIC", "UCX"] | None = None
    revision: str | None = None
    prefill: RoleStatus = Field(default_factory=RoleStatus)
    decode: RoleStatus = Field(default_factory=RoleStatus)
    router: RouterStatus = Field(default_factory=RouterStatus)
    conditions: list[Condition] = Field(default_factory=list)


class ObjectMeta(BaseModel):
    """The part of metadata the renderer needs; everything else is kept but ignored."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=253)]
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None


class DisaggregatedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    api_version: Literal["disagg.dev/v1alpha1"] = Field(
        default=f"{contract.API_GROUP}/{contract.API_VERSION}", alias="apiVersion"
    )
    kind: Literal["DisaggregatedModel"] = contract.KIND
    metadata: ObjectMeta
    spec: DisaggregatedModelSpec
    status: DisaggregatedModelStatus | None = None
