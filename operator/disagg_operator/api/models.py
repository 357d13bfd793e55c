"""The DisaggregatedModel API (disagg.dev/v1alpha1): the single source of truth for spec and status.

The CRD in crds/ is generated from these models (`disagg_operator.api.crd`), defaults and cross-field
CEL rules included. Field names are camelCase on the wire and snake_case in Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from disagg_connector import contract

from .cel import CelRule
from .vocabulary import CONDITION_TYPES

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


def _sub(model: type[BaseModel], description: str) -> Any:
    """A nested object that defaults to its own defaults, in Python and in the CRD."""
    return Field(default_factory=model, description=description)


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

# Kubernetes label syntax (apimachinery validation.IsQualifiedName / IsValidLabelValue): a key is an optional
# DNS-subdomain prefix and '/', then a name of up to 63 alphanumerics, '-', '_', '.'; a value is such a name
# or empty. The API server refuses a pod that breaks it, so admission refuses the spec first.
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
# (`[.]`, not an escaped dot: the expression also sits inside CEL string literals, where `\.` is no escape.)
QUALIFIED_NAME_RE = rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$"
LABEL_VALUE_RE = rf"^({_LABEL_NAME})?$"
LABEL_SYNTAX = "[prefix/]name, the name up to 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric"

LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_RE)]
# Names of other objects the pods refer to (PriorityClass, scheduler): DNS-1123 subdomains.
DNS_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ObjectName = Annotated[str, Field(max_length=253, pattern=DNS_SUBDOMAIN_RE)]
# A container image reference: Kubernetes refuses leading or trailing whitespace (and any inside breaks pulls).
Image = Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^\S+$")]
LabelMap = Annotated[dict[str, LabelValue], Field(max_length=64)]
AnnotationMap = Annotated[dict[str, Annotated[str, Field(max_length=65536)]], Field(max_length=64)]


def _keys_rule(field: str, what: str) -> CelRule:
    return CelRule(
        rule=f"self.{field}.all(k, size(k) <= 317 && k.matches('{QUALIFIED_NAME_RE}'))",
        message=f"{what} keys must be Kubernetes label keys ({LABEL_SYNTAX}): rename the offending key",
        field_path=f".{field}",
    )
Port = Annotated[int, Field(ge=1024, le=65000)]
VllmVersion = Literal[contract.VLLM_VERSIONS]  # type: ignore[valid-type]
# The vLLM release each default engine image runs (config.py tags the images with it): what a new model runs when
# its spec names no release. A model that runs already keeps its release (status.vllmVersion, resolve.held_release).
DEFAULT_VLLM_VERSION = {"nvidia": "0.33.0", "neuron": "0.24.0"}
# NVIDIA releases the operator has a default image of (images/vllm-runtime built with VLLM_VERSION=<release>):
# spec.engine.vllmVersion alone picks one. Others (0.24.0 on nvidia) need spec.engine.image.
IMAGED_NVIDIA_RELEASES = ("0.26.0", "0.33.0", "0.34.0")

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
    # data parallel over pods: the operator derives all of it from parallelism and accelerator.count
    "--data-parallel-size-local",
    "-dpl",
    "--data-parallel-start-rank",
    "-dpr",
    "--data-parallel-rank",
    "-dpn",
    "--data-parallel-address",
    "-dpa",
    "--data-parallel-rpc-port",
    "-dpp",
    "--data-parallel-backend",
    "-dpb",
    "--data-parallel-hybrid-lb",
    "--no-data-parallel-hybrid-lb",
    "-dph",
    "--data-parallel-external-lb",
    "--no-data-parallel-external-lb",
    "-dpe",
    "--data-parallel-multi-port-external-lb",
    "-dpm",
    "--headless",
    "--decode-context-parallel-size",
    "-dcp",
    "--enable-expert-parallel",
    "--no-enable-expert-parallel",
    "-ep",
    "--block-size",
    "--dtype",
    "--kv-cache-dtype",
    "--enable-sleep-mode",
    # KV cache events and the block hash they carry (docs/vllm-protocol.md, "KV events")
    "--kv-events-config",
    "--prefix-caching-hash-algo",
)
MANAGED_ENV = (
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    contract.ENV_POD_NAME,
    contract.ENV_POD_UID,
    contract.ENV_POD_IP,
    "PYTHONHASHSEED",  # the seed of vLLM's block hashes, shared by a model's engines and its router
)


# `--config FILE` makes vLLM read any flag, managed ones included, from a YAML file.
CONFIG_FLAG = "--config"


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


_LONG_FLAGS = tuple(f for f in MANAGED_FLAGS if f.startswith("--")) + (CONFIG_FLAG,)
_SHORT_FLAGS = tuple(f for f in MANAGED_FLAGS if not f.startswith("--"))
# vLLM's parser reads `--a_b` as `--a-b` (argparse_utils.FlexibleArgumentParser), `--a.b v` as a JSON key of
# `--a`, and argparse takes any unambiguous prefix (`--tensor-parallel` is `--tensor-parallel-size`). So an
# argument is refused when its option name, up to '=' or '.', with '_' read as '-', begins a managed flag.
_OPTION = "a.split('=')[0].split('.')[0].replace('_', '-')"


def _spells_a_long_flag(flags: tuple[str, ...]) -> str:
    """CEL: extraArgs' item `a` is one of the long `flags` in a spelling vLLM reads as it."""
    return f"(a.startsWith('--') && size(a) > 2 && {_cel_list(flags)}.exists(f, f.startsWith({_OPTION})))"


_NO_MANAGED_FLAGS = CelRule(
    rule=(
        f"self.extraArgs.all(a, !{_spells_a_long_flag(_LONG_FLAGS)} && "
        f"!{_cel_list(_SHORT_FLAGS)}.exists(f, a == f || a.startsWith(f + '=')))"
    ),
    message=(
        "extraArgs must not set flags the operator manages (" + ", ".join(MANAGED_FLAGS) + "), in any "
        "spelling vLLM reads as one of them (underscores for dashes, an abbreviation such as "
        "--tensor-parallel, a dotted key such as --kv-transfer-config.kv_role), nor --config (a file that can "
        "set any flag): use the matching spec fields (model, engine.blockSize, kvTransfer, parallelism) instead"
    ),
    field_path=".extraArgs",
)
# vLLM's flags that REPLACE a configured kv_connector with its offloading connector (kv_role kv_both, no warning:
# vllm/config/vllm.py _post_init_kv_transfer_config, 0.26.0, 0.33.0 and 0.34.0), which turns P/D off. kvCache.cpu is the way.
OFFLOADING_FLAGS = ("--kv-offloading-size",)
_NO_OFFLOADING_FLAGS = CelRule(
    rule=f"self.extraArgs.all(a, !{_spells_a_long_flag(OFFLOADING_FLAGS)})",
    message=(
        "extraArgs must not set " + " or ".join(OFFLOADING_FLAGS) + " (in any spelling vLLM reads as it): "
        "vLLM then replaces the NIXL connector with its offloading connector, without a warning, and prefill/decode "
        "disaggregation is off; set spec.prefill.kvCache.cpu (or decode's) instead, which renders both in a "
        "MultiConnector"
    ),
    field_path=".extraArgs",
)
_NO_MANAGED_ENV = CelRule(
    rule=f"self.env.all(e, !(e.name in {_cel_list(MANAGED_ENV)}))",
    message=(
        "env must not set variables the operator manages (" + ", ".join(MANAGED_ENV) + "): "
        "the NIXL side channel is wired from the pod IP and spec.kvTransfer.sideChannelPort, PYTHONHASHSEED "
        "from the model (the seed of the block hashes its router matches prompts with)"
    ),
    field_path=".env",
)

ExtraArgs = Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=64)]


class EnvVar(ApiModel):
    """One environment variable of the vLLM container."""

    name: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")] = Field(
        description="Variable name; names the operator wires itself (NIXL side channel, pod identity) are refused."
    )
    value: Annotated[str, Field(max_length=32768)] = Field(
        default="", description="Literal value; $(VAR) expands variables defined earlier in the container's env."
    )


EnvList = Annotated[list[EnvVar], Field(max_length=128)]


class Toleration(ApiModel):
    """A Kubernetes toleration, passed to the pods as written."""

    cel_rules = (
        CelRule(
            rule="self.operator != 'Exists' || !has(self.value) || self.value == ''",
            message="a toleration with operator Exists matches any value: remove value, or use operator Equal",
            field_path=".value",
        ),
        CelRule(
            rule="self.operator == 'Exists' || has(self.key) && self.key != ''",
            message="a toleration without a key must use operator Exists (it then tolerates every taint): "
            "set key, or operator Exists",
            field_path=".operator",
        ),
        CelRule(
            rule="!has(self.tolerationSeconds) || has(self.effect) && self.effect == 'NoExecute'",
            message="tolerationSeconds applies only to effect NoExecute: set effect NoExecute or remove tolerationSeconds",
            field_path=".tolerationSeconds",
        ),
    )

    key: Annotated[str, Field(max_length=317, pattern=QUALIFIED_NAME_RE)] | None = Field(
        default=None, description="Taint key to tolerate; unset with operator Exists tolerates every taint."
    )
    operator: Literal["Exists", "Equal"] = Field(
        default="Equal", description="Equal matches key and value; Exists matches any value of the key."
    )
    value: LabelValue | None = Field(default=None, description="Taint value to match (operator Equal only).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; unset matches every effect."
    )
    toleration_seconds: int | None = Field(
        default=None,
        description="Effect NoExecute only: seconds the pod stays after the taint appears; unset: forever.",
    )


class SecretKeyRef(ApiModel):
    """A Secret in the model's namespace that holds the credentials of model.source."""

    name: Name = Field(description="Name of the Secret (same namespace as the DisaggregatedModel).")
    key: str | None = Field(
        default=None,
        description="Key in the Secret. hf:// reads one key (default HF_TOKEN); s3:// loads the "
        "whole Secret as env (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) when unset.",
    )


# --- model and engine -------------------------------------------------------------------------------


class ModelSource(ApiModel):
    """Where the weights come from."""

    uri: Annotated[str, Field(pattern=r"^(hf|pvc|s3)://[^\s]+$", max_length=1024)] = Field(
        description="hf://org/name (downloaded from the Hugging Face hub), pvc://claim/path/in/claim "
        "(the claim is mounted read-only under /models/<claim>) or s3://bucket/prefix (streamed by "
        "vLLM's run:ai loader)."
    )
    secret_ref: SecretKeyRef | None = Field(
        default=None, description="Credentials for the source; unset: anonymous (public hub models)."
    )


class ModelSpec(ApiModel):
    """What vLLM serves."""

    name: Annotated[str, Field(min_length=1, max_length=512)] = Field(
        description="The model vLLM serves, e.g. Qwen/Qwen3-32B (also the default served name)."
    )
    served_model_name: Annotated[str, Field(min_length=1, max_length=512)] | None = Field(
        default=None,
        description="The name clients put in the OpenAI request's model field (vLLM --served-model-name, "
        "and what the router answers to). Unset: model.name.",
    )
    source: ModelSource | None = Field(
        default=None, description="Where the weights come from. Unset: vLLM loads model.name from the hub."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="vLLM --dtype of weights and activations; auto takes the model's own."
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto",
        description="vLLM --kv-cache-dtype, one value for both roles (KV moves between them byte for "
        "byte); auto = the model dtype.",
    )
    max_model_len: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="vLLM --max-model-len in tokens (prompt + output). Unset: the model's own."
    )


class EngineSpec(ApiModel):
    """vLLM settings shared by prefill and decode (they must agree for KV to move between them)."""

    cel_rules = (_NO_MANAGED_FLAGS, _NO_OFFLOADING_FLAGS, _NO_MANAGED_ENV)

    image: Image | None = Field(
        default=None,
        description="vLLM runtime image (vLLM + EFA + NIXL + disagg_connector). Unset: the operator's image "
        "of the model's release (the chart's modelDefaults), so one operator setting moves every model of a release.",
    )
    vllm_version: VllmVersion | None = Field(
        default=None,
        description="The vLLM release the engine image runs; launch flags and admission rules follow it. "
        "Unset: the release the model runs already (status.vllmVersion: an operator upgrade that moves the default "
        "release does not roll it), else, for a new model, the operator's default for the accelerator (0.33.0 on "
        "nvidia, 0.24.0, AWS's vLLM-Neuron, on neuron). Setting it rolls the model to that release; on nvidia "
        f"{', '.join(IMAGED_NVIDIA_RELEASES)} have an operator image, other releases need engine.image too.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy of the vLLM and preflight containers."
    )
    block_size: Literal[16, 32, 64, 128, 256] = Field(
        default=128,
        description="KV block size in tokens, the same on prefill and decode (vLLM's push handshake "
        "asserts it). Small blocks split a transfer into many descriptors.",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="vLLM automatic prefix caching (--enable-prefix-caching or --no-enable-prefix-caching).",
    )
    enable_sleep_mode: bool = Field(
        default=False,
        description="vLLM --enable-sleep-mode. The push connector cannot sleep: mode Auto then picks "
        "pull, and mode Push is refused.",
    )
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None,
        description="vLLM --gpu-memory-utilization: the fraction of each accelerator's memory vLLM may "
        "take (weights + KV cache). Unset: vLLM's default.",
    )
    extra_args: ExtraArgs = Field(
        default_factory=list,
        description="vLLM flags appended to both roles' command line, before the role's own extraArgs. "
        "Flags the operator sets from other fields are refused.",
    )
    env: EnvList = Field(
        default_factory=list,
        description="Environment of both roles' vLLM containers; a role's env entry of the same name wins.",
    )
    startup_timeout_seconds: Annotated[int, Field(ge=60, le=86400)] = Field(
        default=3600,
        description="Seconds vLLM may take to load weights before the startup probe restarts it; the "
        "engine Deployments' progress deadline is this plus 600.",
    )
    termination_grace_period_seconds: Annotated[int, Field(ge=0, le=3600)] = Field(
        default=120,
        description="Seconds a stopping vLLM pod gets before it is killed. Its preStop waits up to "
        "this - 15 for the engine to be idle (nothing running or waiting, no KV block held), so size it "
        "for the longest generation.",
    )


# --- KV transfer ------------------------------------------------------------------------------------


class KvTransferSpec(ApiModel):
    """How KV blocks move from prefill to decode (vLLM's NIXL connectors)."""

    mode: Literal["Auto", "Push", "Pull"] = Field(
        default="Auto",
        description="Push (NixlPushConnector: prefill writes KV into decode, both legs sent at once) or "
        "Pull (NixlConnector: decode reads KV from prefill). Auto = Push unless the spec asks for something "
        "push cannot do (bidirectional KV, decode pipeline or context parallel, sleep mode). "
        "status.transferMode says what was chosen and why.",
    )
    backend: Literal["Auto", "LIBFABRIC", "UCX"] = Field(
        default="Auto",
        description="NIXL backend. Auto = LIBFABRIC when EFA devices are requested, UCX otherwise "
        "(UCX over EFA runs at TCP speed, so it is refused with EFA).",
    )
    side_channel_port: Port = Field(
        default=contract.NIXL_SIDE_CHANNEL_PORT,
        description="TCP port of the NIXL handshake (VLLM_NIXL_SIDE_CHANNEL_PORT); data-parallel rank r "
        "listens on this + r. The ports must stay clear of vLLM's HTTP port 8000.",
    )
    lease_seconds: Annotated[int, Field(ge=5, le=3600)] = Field(
        default=120,
        description="vLLM kv_lease_duration: how long prefill keeps finished KV blocks for decode. "
        "Must exceed the router's request deadline.",
    )
    load_failure_policy: Literal["Fail", "Recompute"] = Field(
        default="Fail",
        description="vLLM kv_load_failure_policy, when decode cannot get a request's KV: Fail ends the "
        "request with an error (HTTP 500); Recompute prefills it again on decode.",
    )
    bidirectional: bool = Field(
        default=False, description="Multi-turn KV reuse (decode KV read back by prefill): pull only."
    )
    buffer_device: Literal["Auto", "cuda", "cpu"] = Field(
        default="Auto",
        description="vLLM kv_buffer_device, where NIXL registers KV for transfer. Auto = cuda on "
        "nvidia, cpu on neuron.",
    )


# --- roles ------------------------------------------------------------------------------------------


class Parallelism(ApiModel):
    """vLLM parallel sizes of one engine. Tensor and pipeline ranks stay inside a pod; data-parallel ranks
    fill a pod's accelerators (accelerator.count / (tensor x pipeline) ranks per pod)."""

    tensor: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1,
        description="vLLM --tensor-parallel-size. Prefill's and decode's must divide each other "
        "(vLLM maps KV heads between them).",
    )
    pipeline: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1, description="vLLM --pipeline-parallel-size. Above 1 on decode needs pull mode."
    )
    data: Annotated[int, Field(ge=1, le=contract.MAX_DATA_PARALLEL_SIZE)] = Field(
        default=1,
        description="vLLM --data-parallel-size: engine cores of one engine, each with its own NIXL port "
        "(kvTransfer.sideChannelPort + rank). When they are more than one pod's accelerators hold "
        "(accelerator.count / (tensor x pipeline) ranks per pod), the engine spans data / that many pods, one "
        "LeaderWorkerSet group (the LWS controller must be installed).",
    )
    context: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1, description="Decode context parallel size (decode only; pull only)."
    )
    expert: bool = Field(
        default=False,
        description="vLLM --enable-expert-parallel: a mixture-of-experts model's experts are spread over the "
        "engine's tensor x data ranks instead of being sharded by tensor parallelism.",
    )


@dataclass(frozen=True)
class EngineShape:
    """How one engine of a role lays out over pods, derived from parallelism and accelerator.count (never
    stated twice by the user). One pod per engine is the special case of ranks_per_pod == data."""

    ranks_per_pod: int  # data-parallel ranks each pod runs (one vLLM engine core each)
    pods: int  # pods per engine
    accelerators_per_pod: int
    tensor: int = 1  # inside a pod, per data-parallel rank
    pipeline: int = 1

    @property
    def accelerators(self) -> int:
        return self.pods * self.accelerators_per_pod

    @property
    def spans_pods(self) -> bool:
        """One LeaderWorkerSet group per engine (a DP flag per pod, a shell for its start rank, a PodGroup)."""
        return self.pods > 1


def engine_shape(parallelism: Parallelism, accelerator: AcceleratorSpec) -> EngineShape:
    """The layout of one engine. On nvidia one GPU per rank: a pod runs accelerator.count / (tensor x
    pipeline) data-parallel ranks, and an engine spans data / that many pods. Neuron devices are not one per
    rank (vLLM-Neuron shards by tensor parallelism over its cores): one pod per engine."""
    tensor, pipeline = parallelism.tensor, parallelism.pipeline
    if accelerator.type != "nvidia":
        return EngineShape(parallelism.data, 1, accelerator.count, tensor, pipeline)
    ranks_per_pod = max(1, accelerator.count // (tensor * pipeline))
    return EngineShape(ranks_per_pod, max(1, parallelism.data // ranks_per_pod), accelerator.count, tensor, pipeline)


class AcceleratorSpec(ApiModel):
    """The accelerators of one pod."""

    type: Literal["nvidia", "neuron"] = Field(
        default="nvidia",
        description="nvidia (GPUs) or neuron (AWS Trainium/Inferentia, the operator's Neuron image); "
        "the same on both roles.",
    )
    count: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1,
        description="GPUs (nvidia.com/gpu) or Neuron devices (aws.amazon.com/neuron) per pod. "
        "vLLM needs an accelerator on both roles; on nvidia one per rank: tensor x pipeline x data for an engine in "
        "one pod, a divisor of that (a multiple of tensor x pipeline) for an engine that spans pods.",
    )


class EfaSpec(ApiModel):
    """AWS Elastic Fabric Adapter devices of one pod, which carry the KV transfer."""

    count: Annotated[int, Field(ge=0, le=32)] = Field(
        default=0,
        description="vpc.amazonaws.com/efa devices per pod (p5en.48xlarge has 16). 0: no EFA, KV moves "
        "over UCX (TCP). Above 0 on both roles or on neither.",
    )


class ResourceRequirements(ApiModel):
    """Kubernetes container resources."""

    cel_rules = (
        CelRule(
            rule=(
                "['cpu', 'memory'].all(r, !(r in self.requests) || !(r in self.limits) || "
                "!isQuantity(string(self.requests[r])) || !isQuantity(string(self.limits[r])) || "
                "quantity(string(self.limits[r])).compareTo(quantity(string(self.requests[r]))) >= 0)"
            ),
            message="resources.limits must not be below resources.requests for cpu or memory (Kubernetes refuses "
            "the pod): raise the limit or lower the request",
            field_path=".limits",
        ),
        CelRule(
            rule=(
                f"!{_cel_list(contract.DEVICE_RESOURCES)}.exists(r, r in self.requests || r in self.limits)"
            ),
            message="resources must not name " + ", ".join(contract.DEVICE_RESOURCES) + ": the operator "
            "requests them itself from accelerator.count, efa.count and spec.network.efa.hugepages: set those",
            field_path=".requests",
        ),
    )

    requests: Annotated[dict[str, Quantity], Field(max_length=32)] = Field(
        default_factory=dict,
        description="Resource requests (cpu, memory, ...). On engines the operator adds the accelerator, "
        "EFA and hugepages from accelerator.count, efa.count and network.efa.hugepages.",
    )
    limits: Annotated[dict[str, Quantity], Field(max_length=32)] = Field(
        default_factory=dict, description="Resource limits; the operator adds devices as for requests."
    )


class AutoscalingSpec(ApiModel):
    """An HorizontalPodAutoscaler for the role, rendered by the operator. It scales the role's
    DisaggregatedRole (`<model>-<role>`), whose name survives revisions, so the autoscaler never has to
    follow a rollout; the operator then never writes that size itself (replicas is the initial size only)."""

    cel_rules = (
        CelRule(
            rule="self.minReplicas <= self.maxReplicas",
            message="autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
            field_path=".minReplicas",
        ),
    )

    min_replicas: Annotated[int, Field(ge=1, le=1000)] = Field(
        default=1, description="The HPA's minReplicas (at least 1: scaling an engine role to zero is spec.<role>.replicas: 0)."
    )
    max_replicas: Annotated[int, Field(ge=1, le=1000)] = Field(description="The HPA's maxReplicas.")
    metrics: Annotated[list[FreeForm], Field(min_length=1, max_length=16)] = Field(
        description="The HPA's metrics (autoscaling/v2 MetricSpec, as written in an HPA), e.g. a Pods metric "
        "vllm:num_requests_waiting_by_reason with the selector reason=capacity (requests waiting for room; "
        "vllm:num_requests_waiting also counts a decode waiting on its remote KV) from a Prometheus adapter. CPU is "
        "no measure of a GPU engine's load, so there is no default: name what to scale on."
    )
    behavior: FreeForm | None = Field(
        default=None, description="The HPA's scale-up/scale-down behavior (autoscaling/v2 HorizontalPodAutoscalerBehavior)."
    )


class EngineBounds(ApiModel):
    """How few and how many engines the SLO autoscaler may give one role."""

    cel_rules = (
        CelRule(rule="self.minEngines <= self.maxEngines", message="minEngines must not exceed maxEngines",
                field_path=".minEngines"),
    )  # fmt: skip

    min_engines: Annotated[int, Field(ge=1, le=1000)] = Field(default=1, description="Fewest engines.")
    max_engines: Annotated[int, Field(ge=1, le=1000)] = Field(description="Most engines.")


class AcceleratorBudget(ApiModel):
    """The accelerators (GPUs or Neuron devices, of every engine's pods) the model's engines may use together."""

    cel_rules = (
        CelRule(rule="!has(self.max) || self.min <= self.max", message="accelerators.min must not exceed accelerators.max",
                field_path=".min"),
    )  # fmt: skip

    min: Annotated[int, Field(ge=0, le=100_000)] = Field(default=0, description="Fewest accelerators: below it the "
                                                         "role further off its target gets engines.")  # fmt: skip
    max: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        default=None, description="Most accelerators: above it the role less far off its target gives engines up "
        "first. Unset: only the roles' maxEngines bound the model."
    )


class ModelAutoscalingSpec(ApiModel):
    """Prefill and decode sized together to TTFT and TPOT targets from what the routers measure
    (docs/autoscaling.md)."""

    mode: Literal["Advisory", "Active"] = Field(
        default="Advisory",
        description="Advisory: the autoscaler decides every interval and reports the sizes it would set, and why, in "
        "status.autoscaling; the roles' sizes stay with their writers (spec.<role>.replicas, kubectl scale). Active: "
        "it writes them too (the roles' DisaggregatedRoles), within the bounds: it is then the roles' one writer, "
        "so a kubectl scale lasts until its next decision.",
    )
    ttft_milliseconds: Annotated[int, Field(ge=10, le=600_000)] = Field(description="Time to first token target.")
    tpot_milliseconds: Annotated[int, Field(ge=1, le=10_000)] = Field(description="Time per output token target.")
    percentile: Literal[50, 90, 95, 99] = Field(default=90, description="The percentile of requests that must meet both.")
    prefill: EngineBounds = Field(description="Bounds of the prefill engines.")
    decode: EngineBounds = Field(description="Bounds of the decode engines.")
    accelerators: AcceleratorBudget = Field(
        default_factory=AcceleratorBudget, description="The budget of both roles' accelerators together."
    )
    interval_seconds: Annotated[int, Field(ge=5, le=300)] = Field(default=15, description="How often it decides.")
    scale_up_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = Field(
        default=0, description="A role grows to the least size this window's decisions asked for."
    )
    scale_down_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = Field(
        default=300, description="A role shrinks to the most this window's decisions asked for (no flapping)."
    )
    warmup_seconds: Annotated[int, Field(ge=0, le=3600)] = Field(
        default=120, description="An engine Ready for less than this is not counted as capacity and teaches nothing."
    )
    max_step_engines: Annotated[int, Field(ge=1, le=64)] = Field(
        default=4, description="Engines a role may grow or shrink by in one decision."
    )


class KVCacheSpec(ApiModel):
    """Where a role's engines keep KV cache beyond GPU memory."""

    cel_rules = (
        CelRule(
            rule="!has(self.cpu) || quantity(self.cpu).compareTo(quantity('0')) > 0",
            message="kvCache.cpu must be above 0 (leave it out for GPU memory only)",
            field_path=".cpu",
        ),
    )

    cpu: StrQuantity | None = Field(
        default=None,
        description="A CPU tier per engine core (data-parallel rank): KV blocks evicted from GPU memory are kept "
        "in the pod's host memory, up to this size, and prefix hits are restored from there instead of being "
        "computed again (vLLM's OffloadingConnector, rendered after the NIXL connector in a MultiConnector, so "
        "prefill/decode stays on; --kv-offloading-size would replace the NIXL connector and is refused in "
        "extraArgs). The pod's memory request (and limit, when set) grows by this times the ranks it runs. "
        "Typical on prefill, whose prefix hits it multiplies for multi-turn traffic. Unset: GPU memory only.",
    )


class RoleSpec(ApiModel):
    """One engine role (prefill or decode): its size, devices and placement."""

    cel_rules = (
        CelRule(
            rule=(
                "self.accelerator.type != 'nvidia' || "
                "self.accelerator.count % (self.parallelism.tensor * self.parallelism.pipeline) == 0"
            ),
            message="accelerator.count must be a multiple of parallelism.tensor x pipeline: a pod runs whole "
            "data-parallel ranks of tensor x pipeline GPUs each",
            field_path=".accelerator.count",
        ),
        CelRule(
            rule=(
                "self.accelerator.type != 'nvidia' || self.accelerator.count <= "
                "self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.data"
            ),
            message="accelerator.count must be at most parallelism.tensor x pipeline x data: vLLM uses one GPU "
            "per rank, and a pod runs ranks of one engine only",
            field_path=".accelerator.count",
        ),
        CelRule(
            rule=(
                "self.accelerator.type != 'nvidia' || "
                "self.accelerator.count % (self.parallelism.tensor * self.parallelism.pipeline) != 0 || "
                "self.parallelism.data % (self.accelerator.count / "
                "(self.parallelism.tensor * self.parallelism.pipeline)) == 0"
            ),
            message="parallelism.data must be a multiple of the ranks one pod runs (accelerator.count / (tensor x "
            "pipeline)): an engine that spans pods is data / ranks-per-pod pods, every pod alike",
            field_path=".parallelism.data",
        ),
        CelRule(
            rule=(
                "self.accelerator.type != 'nvidia' || self.parallelism.expert || "
                "self.accelerator.count >= self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.data"
            ),
            message="an engine spans pods (parallelism.data above the ranks one pod runs) only with parallelism.expert: "
            "true: a dense model's data-parallel ranks are independent engines, and vLLM fails to serve them split "
            "over pods (vllm-project/vllm#32252): raise replicas instead",
            field_path=".parallelism.expert",
        ),
        CelRule(
            rule="self.accelerator.type == 'nvidia' || !has(self.kvCache.cpu)",
            message="kvCache.cpu needs vLLM's OffloadingConnector and MultiConnector, which AWS's vLLM-Neuron (0.24.0) "
            "does not have: leave it out on neuron",
            field_path=".kvCache.cpu",
        ),
        _NO_MANAGED_FLAGS,
        _NO_OFFLOADING_FLAGS,
        _NO_MANAGED_ENV,
        _keys_rule("nodeSelector", "nodeSelector"),
    )

    replicas: Annotated[int, Field(ge=0, le=1000)] = Field(
        default=1,
        description="Engines of this role: one pod each, or one LeaderWorkerSet group of pods each for an engine "
        "that spans pods (see parallelism.data). 0 stops the role (Ready=True ScaledToZero: nothing is "
        "served until it scales up again). The size "
        "lives in the role's DisaggregatedRole `<model>-<role>` (its scale subresource): a change of this field is "
        "written there; `kubectl scale`, an HPA or KEDA scale that object, and the operator never undoes them "
        "until this field changes again (a DisaggregatedRole deleted by hand comes back at the size status "
        "last recorded as targetReplicas).",
    )
    parallelism: Parallelism = _sub(Parallelism, "vLLM parallel sizes of one engine of this role.")
    accelerator: AcceleratorSpec = _sub(AcceleratorSpec, "Accelerators per pod.")
    efa: EfaSpec = _sub(EfaSpec, "EFA devices per pod.")
    resources: ResourceRequirements = _sub(
        ResourceRequirements, "Resources of the vLLM container (devices are added from the fields above)."
    )
    kv_cache: KVCacheSpec = _sub(KVCacheSpec, "KV cache beyond GPU memory: a CPU tier.")
    node_selector: LabelMap = Field(
        default_factory=dict, description="Node labels the pods must land on (Kubernetes nodeSelector)."
    )
    tolerations: Annotated[list[Toleration], Field(max_length=32)] = Field(
        default_factory=list,
        description="Tolerations added to the operator's own (NoSchedule on the accelerator and EFA resources).",
    )
    affinity: FreeForm | None = Field(
        default=None,
        description="Kubernetes affinity; the operator adds its own P/D placement terms to it.",
    )
    priority_class_name: ObjectName | None = Field(
        default=None, description="PriorityClass of the pods. Unset: the cluster default."
    )
    scheduler_name: ObjectName | None = Field(
        default=None, description="Scheduler of the pods (a gang scheduler, say). Unset: default-scheduler."
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="An HPA on the role's DisaggregatedRole: the HPA owns the size, replicas is only the initial one.",
    )
    extra_args: ExtraArgs = Field(
        default_factory=list,
        description="vLLM flags for this role only, appended after engine.extraArgs (argparse keeps the last).",
    )
    env: EnvList = Field(
        default_factory=list, description="Environment for this role only; wins over engine.env of the same name."
    )

    @property
    def shape(self) -> EngineShape:
        return engine_shape(self.parallelism, self.accelerator)


# --- router, network, rollout ----------------------------------------------------------------------


class ServiceSpec(ApiModel):
    """The router's Service, the model's one endpoint for clients."""

    cel_rules = (_keys_rule("annotations", "Service annotation"),)

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Kubernetes Service type."
    )
    port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=contract.ROUTER_PORT, description="Service port clients connect to (status.router.url)."
    )
    annotations: AnnotationMap = Field(
        default_factory=dict, description="Annotations of the Service (load balancer settings, say)."
    )


class MigrationSpec(ApiModel):
    """Stream migration: a decode engine that crashes, hangs or fails mid-stream does not cut the client's answer."""

    enabled: bool = Field(
        default=True,
        description="Continue a stream whose decode engine fails after the first token on another P/D pair of a "
        "serving revision: the router re-submits the prompt and every token already sent as token ids, with fresh "
        "request ids, and splices the continuation into the same client stream (docs/router.md, Failures and "
        "stream migration). Off: such a stream ends with an error event and no [DONE].",
    )
    max_migrations: Annotated[int, Field(ge=1, le=10)] = Field(
        default=2, description="Continuations of one stream at most; the next failure ends it with an error event."
    )
    wait_seconds: Annotated[int, Field(ge=0, le=1800)] = Field(
        default=120,
        description="How long a stream whose decode failed waits in the router for a pair to continue on when none "
        "takes it at once (every decode gone: a restarting engine, a recreated multi-node group), with an SSE "
        "comment to the client every 5 s; then it ends with an error event. 0: it ends at once.",
    )


class RouterSpec(ApiModel):
    """The router: an OpenAI-compatible endpoint that sends each request's prefill and decode legs."""

    cel_rules = (_keys_rule("nodeSelector", "nodeSelector"),)

    replicas: Annotated[int, Field(ge=0, le=100)] = Field(
        default=2, description="Router pods; two by default so one can restart while the other serves."
    )
    image: Image | None = Field(
        default=None, description="Router image. Unset: the operator's default."
    )
    service: ServiceSpec = _sub(ServiceSpec, "The router's Service.")
    request_deadline_seconds: Annotated[int, Field(ge=1, le=3600)] = Field(
        default=60,
        description="The router's deadline for each leg of a request; both legs are cancelled "
        "when it passes. Must stay below kvTransfer.leaseSeconds.",
    )
    max_retries: Annotated[int, Field(ge=0, le=5)] = Field(
        default=1, description="Retries on another P/D pair, only while nothing reached the client."
    )
    migration: MigrationSpec = _sub(MigrationSpec, "Stream migration after the first token.")
    disaggregation_threshold_tokens: Annotated[int, Field(ge=0, le=1048576)] = Field(
        default=256,
        description="Prompts shorter than this many tokens (estimated from their length, 4 bytes per "
        "token) skip the prefill engine: a decode engine prefills them itself. Default from "
        "bench/results/router-bench.txt: below 256 tokens that cuts their TTFT by about 40% and "
        "slows the decode's other streams by under 5%. 0 disaggregates every request.",
    )
    prefill_policy: Literal["PrefixAndLoad", "LeastOutstanding"] = Field(
        default="PrefixAndLoad",
        description="How the router picks a prefill engine within a revision. PrefixAndLoad: the engine with the "
        "best expected prefix-cache hit for the prompt against its load (requests running and waiting from "
        "vLLM's /metrics plus this router's in flight); the engines then publish vLLM's KV cache events to "
        "the router (when engine.enablePrefixCaching is true; without it the pick is by load alone). "
        "LeastOutstanding: fewest requests in flight from this router, ties round robin.",
    )
    decode_policy: Literal["LeastLoaded", "LeastOutstanding"] = Field(
        default="LeastLoaded",
        description="How the router picks a decode engine within a revision. LeastLoaded: fewest requests "
        "running and waiting per vLLM's /metrics plus this router's in flight. LeastOutstanding: fewest "
        "requests in flight from this router, ties round robin.",
    )
    resources: ResourceRequirements = _sub(
        ResourceRequirements, "Router container resources. Empty: requests cpu 500m, memory 512Mi; limit memory 1Gi."
    )
    node_selector: LabelMap = Field(
        default_factory=dict, description="Node labels the router pods must land on."
    )
    tolerations: Annotated[list[Toleration], Field(max_length=32)] = Field(
        default_factory=list, description="Tolerations of the router pods."
    )


class EfaNetworkSpec(ApiModel):
    """Pod settings for EFA; they apply to roles with efa.count above 0 (sharedMemory to every engine)."""

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
    """Where prefill and decode land relative to each other: KV crosses between them on every request."""

    zone: Literal["Required", "Preferred", "None"] = Field(
        default="Required", description="Keep prefill and decode pods in one availability zone."
    )
    spine: Literal["Required", "Preferred", "None"] = Field(
        default="Preferred", description="Keep prefill and decode pods under one network spine."
    )
    spine_topology_key: Annotated[str, Field(min_length=1, max_length=316)] = Field(
        default="topology.k8s.aws/network-node-layer-3",
        description="Node label that names a node's network spine (EC2 instance topology on EKS).",
    )
    separate_hosts: bool = Field(
        default=False,
        description="Require prefill and decode on different nodes (some EFA setups fail with "
        "EAGAIN when both share a host).",
    )


class NetworkPolicySpec(ApiModel):
    """The engines' NetworkPolicy."""

    enabled: bool = Field(
        default=True,
        description="Create NetworkPolicy <name>-engines: prefill and decode reach each other (on the "
        "NIXL ports with LIBFABRIC, on all ports with UCX); only the router reaches vLLM's HTTP port.",
    )
    metrics_from: Annotated[list[FreeForm], Field(max_length=16)] = Field(
        default_factory=list,
        description="NetworkPolicy peers (e.g. a Prometheus namespaceSelector) also allowed to "
        "reach the engines' HTTP port for /metrics.",
    )


class NetworkSpec(ApiModel):
    """Fabric, placement and network policy of the engines."""

    efa: EfaNetworkSpec = _sub(EfaNetworkSpec, "Hugepages, /dev/shm and privileges of the engine pods.")
    placement: PlacementSpec = _sub(PlacementSpec, "Placement of prefill and decode relative to each other.")
    network_policy: NetworkPolicySpec = _sub(NetworkPolicySpec, "The engines' NetworkPolicy.")


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
    """How a new revision of one role replaces the old, in pods (see `rollout.py`)."""

    max_surge: IntOrPercent = Field(
        default=1,
        description="Pods of this role a rollout may add above its size (count, or % of the size rounded up). "
        "The default never needs more than one extra pod per role.",
    )
    max_unavailable: IntOrPercent = Field(
        default=0,
        description="Pods of this role that may be missing from its size during a rollout (count, or % rounded "
        "down); 0 keeps full serving capacity. A ready pair is always kept, whatever this allows.",
    )


class RolloutSpec(ApiModel):
    """A change of what prefill and decode must agree on (image, model, transfer mode, ...) is a new revision.
    It replaces the old one in pod steps bounded per role, old prefill and decode leaving in pairs as new
    ready pods stand in for them, each old pod drained before it goes."""

    prefill: RoleRollout = _sub(RoleRollout, "Bounds for the prefill role.")
    decode: RoleRollout = _sub(RoleRollout, "Bounds for the decode role.")
    drain_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = Field(
        default=3600,
        description="Seconds a pod that leaves (a rollout, scale-in) may stay draining when its routers cannot "
        "say it is idle (a router that does not answer, a stream that never ends); a pod goes as soon as every "
        "ready router reports nothing in flight on it, streams included. Size it for the longest generation "
        "you serve. A prefill is let go sooner: after router.requestDeadlineSeconds plus kvTransfer.leaseSeconds "
        "no decode can still read its KV.",
    )


# --- Gateway API inference routing ---------------------------------------------------------------------

# Gateway API's own syntax (sigs.k8s.io/gateway-api v1.6.3, apis/v1/shared_types.go): admission refuses what its
# CRDs would refuse, so a bad reference is a spec error and not a child the API server rejects.
_DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
GATEWAY_HOSTNAME_RE = r"^(\*[.])?[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
GatewayHostname = Annotated[str, Field(min_length=1, max_length=253, pattern=GATEWAY_HOSTNAME_RE)]
# GAIE's lightweight endpoint picker at the version whose CRDs the tests install (docs/gateway.md).
LWEPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/lwepp:v1.6.0"
_SAME_PARENT = ("p1.name == p2.name && (has(p1.__namespace__) ? p1.__namespace__ : '') == "
                "(has(p2.__namespace__) ? p2.__namespace__ : '')")  # `namespace` is a CEL reserved word (cel.py)


class ParentGatewayRef(ApiModel):
    """A Gateway (gateway.networking.k8s.io) whose listeners route to the model: an HTTPRoute parentRef."""

    name: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_RE)] = Field(
        description="Name of the Gateway."
    )
    namespace: Annotated[str, Field(min_length=1, max_length=63, pattern=_DNS_LABEL_RE)] | None = Field(
        default=None,
        description="Namespace of the Gateway. Unset: the model's. A Gateway in another namespace must allow routes "
        "from this one (its listeners' allowedRoutes.namespaces).",
    )
    section_name: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_RE)] | None = Field(
        default=None, description="The Gateway listener to attach to. Unset: every listener that allows the route."
    )


class GatewaySpec(ApiModel):
    """Routing from Gateway API inference gateways (Istio, Agentgateway, NGINX Gateway Fabric, ...): an
    InferencePool (inference.networking.k8s.io/v1) of the model's router pods on the router port, and an HTTPRoute
    from the parent Gateways to it. Pairing, concurrent push and the revision split stay the router's
    (docs/gateway.md). Needs the InferencePool and HTTPRoute CRDs in the cluster."""

    cel_rules = (
        CelRule(
            rule=f"self.parentRefs.all(p1, self.parentRefs.exists_one(p2, {_SAME_PARENT} && "
            "(has(p1.sectionName) ? p1.sectionName : '') == (has(p2.sectionName) ? p2.sectionName : '')))",
            message="spec.gateway.parentRefs names one Gateway listener twice: remove the repeated entry",
            field_path=".parentRefs",
        ),
        CelRule(
            rule=f"self.parentRefs.all(p1, self.parentRefs.all(p2, !({_SAME_PARENT}) || "
            "has(p1.sectionName) == has(p2.sectionName)))",
            message="a Gateway named twice in spec.gateway.parentRefs needs a sectionName in every entry (Gateway "
            "API refuses one entry for the whole Gateway beside one for a listener): set sectionName on each",
            field_path=".parentRefs",
        ),
        CelRule(
            rule="self.hostnames.all(h1, self.hostnames.exists_one(h2, h1 == h2))",
            message="spec.gateway.hostnames repeats a hostname: remove the repeated entry",
            field_path=".hostnames",
        ),
        CelRule(
            rule="self.endpointPicker == 'Lwepp' || !has(self.endpointPickerImage)",
            message="spec.gateway.endpointPickerImage is the lwepp image: set endpointPicker to Lwepp, or remove it",
            field_path=".endpointPickerImage",
        ),
    )

    parent_refs: Annotated[list[ParentGatewayRef], Field(min_length=1, max_length=8)] = Field(
        description="The Gateways (and optionally their listeners) the model's HTTPRoute attaches to."
    )
    hostnames: Annotated[list[GatewayHostname], Field(max_length=16)] = Field(
        default_factory=list,
        description="Hostnames the HTTPRoute matches (a leading '*.' is a wildcard). Empty: the listeners' own.",
    )
    endpoint_picker: Literal["None", "Lwepp"] = Field(
        default="None",
        description="The InferencePool's endpoint picker. None: the pool has no endpointPickerRef, and the gateway "
        "balances over the router pods itself (GAIE v1.5.0 on; not every gateway supports it). Lwepp: the operator "
        "runs GAIE's lightweight endpoint picker (Deployment and Service <name>-lwepp, ext-proc gRPC on port "
        f"{contract.LWEPP_GRPC_PORT}), which picks among the ready router pods, fail-closed.",
    )
    endpoint_picker_image: Image | None = Field(
        default=None, description=f"The lwepp image (endpointPicker Lwepp). Unset: {LWEPP_IMAGE}."
    )


# --- spec -------------------------------------------------------------------------------------------

# The effective vLLM release in CEL: the spec's, else the default image's for the accelerator.
_CEL_DEFAULT_VLLM_VERSION = (
    f"(self.prefill.accelerator.type == 'neuron' ? '{DEFAULT_VLLM_VERSION['neuron']}' : "
    f"'{DEFAULT_VLLM_VERSION['nvidia']}')"
)
_CEL_VLLM_VERSION = f"(has(self.engine.vllmVersion) ? self.engine.vllmVersion : {_CEL_DEFAULT_VLLM_VERSION})"
# Whether the engines publish vLLM's KV cache events (DisaggregatedModelSpec.publishes_kv_events), in CEL.
_CEL_PUBLISHES_KV_EVENTS = "(self.router.prefillPolicy == 'PrefixAndLoad' && self.engine.enablePrefixCaching)"
_PUSH_INCOMPATIBLE = "mode Push cannot {what}: set spec.kvTransfer.mode to Pull (or Auto, which picks pull) {fix}"



def _cel_accelerators_per_engine(role: str) -> str:
    """engine_shape(...).accelerators of spec.<role>, in CEL."""
    r = f"self.{role}"
    per_pod = f"({r}.accelerator.count / ({r}.parallelism.tensor * {r}.parallelism.pipeline))"
    ranks = f"({per_pod} > 1 ? {per_pod} : 1)"
    pods = f"({r}.parallelism.data / {ranks} > 1 ? {r}.parallelism.data / {ranks} : 1)"
    return f"({r}.accelerator.type != 'nvidia' ? {r}.accelerator.count : {r}.accelerator.count * {pods})"


def _cel_autoscaling_accelerators(bound: str) -> str:
    return " + ".join(f"self.autoscaling.{role}.{bound} * {_cel_accelerators_per_engine(role)}" for role in ("prefill", "decode"))


AUTOSCALING_RULES = (
    CelRule(
        rule="!has(self.autoscaling) || !has(self.autoscaling.accelerators) || !has(self.autoscaling.accelerators.max) || "
        f"{_cel_autoscaling_accelerators('minEngines')} <= self.autoscaling.accelerators.max",
        message="autoscaling.accelerators.max is below what the roles' minEngines take (minEngines x the accelerators of "
        "one engine, summed over prefill and decode): raise accelerators.max or lower a role's minEngines",
        field_path=".autoscaling.accelerators.max",
    ),
    CelRule(
        rule="!has(self.autoscaling) || !has(self.autoscaling.accelerators) || "
        f"self.autoscaling.accelerators.min <= {_cel_autoscaling_accelerators('maxEngines')}",
        message="autoscaling.accelerators.min is above what the roles' maxEngines allow: lower accelerators.min or raise "
        "a role's maxEngines",
        field_path=".autoscaling.accelerators.min",
    ),
    CelRule(
        rule="!has(self.autoscaling) || !has(self.autoscaling.mode) || self.autoscaling.mode != 'Active' || "
        "(!has(self.prefill.autoscaling) && !has(self.decode.autoscaling))",
        message="autoscaling.mode Active writes both roles' sizes, and spec.<role>.autoscaling renders an HPA that "
        "writes its role's: one writer per size. Remove spec.prefill.autoscaling and spec.decode.autoscaling, or "
        "set autoscaling.mode to Advisory",
        field_path=".autoscaling.mode",
    ),
)

SPEC_RULES = (
    *AUTOSCALING_RULES,
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
        rule=(
            "!(self.kvTransfer.mode == 'Push' && self.prefill.parallelism.pipeline > 1 && "
            f"{_CEL_VLLM_VERSION} == '0.24.0')"
        ),
        message=_PUSH_INCOMPATIBLE.format(
            what="run prefill with pipeline parallel > 1 on vLLM 0.24.0 (push takes a pipelined prefill "
            "from 0.26.0 on)",
            fix="or set spec.engine.vllmVersion to 0.26.0 or later, or spec.prefill.parallelism.pipeline to 1",
        ),
        field_path=".kvTransfer.mode",
    ),
    CelRule(
        rule=(
            "!has(self.engine.vllmVersion) || has(self.engine.image) || "
            f"(self.prefill.accelerator.type == 'neuron' ? self.engine.vllmVersion == '{DEFAULT_VLLM_VERSION['neuron']}' : "
            f"self.engine.vllmVersion in {list(IMAGED_NVIDIA_RELEASES)})"
        ),
        message=f"the operator has engine images of vLLM {', '.join(IMAGED_NVIDIA_RELEASES)} on nvidia and "
        f"{DEFAULT_VLLM_VERSION['neuron']} on neuron: set spec.engine.image to an image of the release in "
        "spec.engine.vllmVersion, or choose one of those releases",
        field_path=".engine.vllmVersion",
    ),
    CelRule(
        rule=(
            "!((has(self.prefill.kvCache.cpu) || has(self.decode.kvCache.cpu)) && "
            f"{_CEL_VLLM_VERSION} == '0.24.0')"
        ),
        # read in the 0.26.0, 0.33.0 and 0.34.0 wheels (MultiConnector, OffloadingConnector's cpu_bytes_to_use)
        message="kvCache.cpu is rendered for vLLM 0.26.0 and later: set spec.engine.vllmVersion (and image) to "
        "0.26.0 or later, or leave kvCache.cpu out",
        field_path=".engine.vllmVersion",
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
        rule=f"!{_CEL_PUBLISHES_KV_EVENTS} || " + " && ".join(
            f"(self.kvTransfer.sideChannelPort + self.{role}.parallelism.data <= {base} || "
            f"self.kvTransfer.sideChannelPort >= {base} + self.{role}.parallelism.data)"
            for base in (contract.KV_EVENTS_PORT, contract.KV_EVENTS_REPLAY_PORT)
            for role in contract.ENGINE_ROLES
        ),
        message="the NIXL side-channel ports (sideChannelPort + data-parallel rank) overlap the KV event ports "
        f"({contract.KV_EVENTS_PORT} and {contract.KV_EVENTS_REPLAY_PORT} + rank, published for "
        "router.prefillPolicy PrefixAndLoad): move spec.kvTransfer.sideChannelPort",
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
    """What to serve and how: one model on prefill and decode engines wired for NIXL KV transfer."""

    cel_rules = SPEC_RULES

    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = _sub(EngineSpec, "vLLM settings of both roles.")
    kv_transfer: KvTransferSpec = _sub(KvTransferSpec, "KV transfer between prefill and decode.")
    prefill: RoleSpec = _sub(RoleSpec, "The prefill engines (vLLM kv_producer).")
    decode: RoleSpec = _sub(RoleSpec, "The decode engines (vLLM kv_consumer).")
    router: RouterSpec = _sub(RouterSpec, "The router in front of the engines.")
    network: NetworkSpec = _sub(NetworkSpec, "EFA pod settings, placement and network policy.")
    rollout: RolloutSpec = _sub(RolloutSpec, "Update strategy of the engine Deployments.")
    gateway: GatewaySpec | None = Field(
        default=None,
        description="Routing from Gateway API inference gateways: an InferencePool of the router pods and an "
        "HTTPRoute from these Gateways (docs/gateway.md). Unset: the router's Service only.",
    )
    autoscaling: ModelAutoscalingSpec | None = Field(
        default=None,
        description="Prefill and decode sized together to TTFT and TPOT targets from the routers' measurements, "
        "within a GPU budget (docs/autoscaling.md). Active: not with spec.<role>.autoscaling (one writer per role's size).",
    )

    @property
    def publishes_kv_events(self) -> bool:
        """The engines publish vLLM's KV cache events to the router: its prefill policy matches prompts against
        them, and with prefix caching on there are cached blocks to report (docs/vllm-protocol.md, "KV events")."""
        return self.router.prefill_policy == "PrefixAndLoad" and self.engine.enable_prefix_caching


# --- status -----------------------------------------------------------------------------------------

def condition_types_description() -> str:
    """Condition.type's description in the CRD: every condition type the operator writes, from the vocabulary."""
    *first, last = CONDITION_TYPES
    return f"{', '.join(first)} or {last} (docs/reasons.md says what each means)."


class Condition(ApiModel):
    """One observed condition, in the Kubernetes convention."""

    type: str = Field(description=condition_types_description())
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds now.")
    reason: str = Field(default="", description="CamelCase cause, stable for alerts (e.g. InsufficientEFADevices).")
    message: str = Field(default="", description="What is wrong and what to change, for a human.")
    last_transition_time: str | None = Field(
        default=None, description="RFC 3339 time status last flipped (not when the message changed)."
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation of the spec this condition was computed from."
    )


class RoleStatus(ApiModel):
    """Pod counts of one engine role."""

    replicas: int = Field(default=0, description="Pods of the role in every revision, terminating ones excluded.")
    ready_replicas: int = Field(default=0, description="Ready pods of the current revision (the ones that serve).")
    updated_replicas: int = Field(default=0, description="Pods of the current revision, ready or not.")
    target_replicas: int | None = Field(
        default=None, description="The size the role is brought to: spec.<role>.replicas, or what scaled its "
        "DisaggregatedRole since (kubectl scale, an HPA)."
    )


class RouterStatus(ApiModel):
    """The router's state."""

    ready_replicas: int = Field(default=0, description="Ready router pods.")
    url: str | None = Field(default=None, description="In-cluster URL of the router's Service, for clients.")


class RoleRecommendation(ApiModel):
    current: int = Field(description="The role's size when it decided.")
    recommended: int = Field(description="The size it decided on.")
    reason: str = Field(description="Why, in words.")


class AutoscalingStatus(ApiModel):
    """The SLO autoscaler's last decision (spec.autoscaling; docs/autoscaling.md)."""

    mode: Literal["Advisory", "Active"] = Field(description="Advisory: reported, not applied.")
    decided_at: str = Field(description="When it decided (RFC 3339).")
    prefill: RoleRecommendation = Field(description="Prefill's size, decided.")
    decode: RoleRecommendation = Field(description="Decode's size, decided.")
    blocked: str | None = Field(default=None, description="A role that cannot grow, and the scheduler's reason.")
    measured: dict[str, float] = Field(
        default_factory=dict, description="What the routers measured over the interval: requests, and the targets' "
        "percentile of TTFT, TPOT, the prefill leg and the TTFT of prompts decode prefilled itself, in seconds "
        "(ttftSeconds, tpotSeconds, prefillLegSeconds, localTtftSeconds).",
    )
    estimates: dict[str, float] = Field(default_factory=dict, description="Demand and learned capacity per role.")


class DisaggregatedModelStatus(ApiModel):
    """What is true now, written by the operator."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation of the spec this status describes."
    )
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Invalid"] | None = Field(
        default=None,
        description="One word for the conditions, for people (kubectl get's PHASE column) and the "
        "operator's models-by-phase gauge: Invalid (spec refused, see Ready's message), Ready, Degraded, "
        "Progressing (pods of the current revision exist) or Pending. Derived from the conditions in the "
        "same pass; tools read the conditions (Ready, Degraded, Progressing, Reconciling, Stalled).",
    )
    transfer_mode: Literal["Push", "Pull"] | None = Field(
        default=None, description="The effective KV transfer mode (spec.kvTransfer.mode resolved)."
    )
    transfer_mode_reason: str | None = Field(default=None, description="Why that transfer mode was chosen.")
    backend: Literal["LIBFABRIC", "UCX"] | None = Field(
        default=None, description="The effective NIXL backend (spec.kvTransfer.backend resolved)."
    )
    vllm_version: VllmVersion | None = Field(
        default=None,
        description="The vLLM release the current revision's engines run (spec.engine.vllmVersion resolved). A "
        "model whose spec names no release keeps this one when the operator's default release moves.",
    )
    revision: str | None = Field(
        default=None,
        description="Hash of everything prefill and decode must agree on; engine Deployments and pods "
        "carry it, and the router pairs pods only within one revision.",
    )
    autoscaling: AutoscalingStatus | None = Field(default=None, description="The SLO autoscaler's last decision.")
    prefill: RoleStatus = Field(default_factory=RoleStatus, description="Prefill pod counts.")
    decode: RoleStatus = Field(default_factory=RoleStatus, description="Decode pod counts.")
    router: RouterStatus = Field(default_factory=RouterStatus, description="Router pods and URL.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready (the model serves at the size asked, or is on its way there "
        "within the rollout budget), Progressing, Degraded, FabricReady, KVTransferHealthy, GangScheduled (where PodGroups "
        "are served, or an engine spans pods), and for kstatus readers Reconciling and Stalled, each with a reason that says what to do."
    )


class ObjectMeta(BaseModel):
    """The part of metadata the renderer needs; everything else is kept but ignored."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=253)]
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None


# Services are named after the model, and a Service name must be a DNS-1035 label: refuse at admission
# what the API server would refuse child by child (child names longer than 63 characters are shortened
# with a hash by contract.fit_name, so length is no problem).
MODEL_RULES = (
    CelRule(
        rule=f"self.metadata.name.matches('{contract.DNS_1035_LABEL_RE}')",
        message="metadata.name must start with a letter and hold only lower-case letters, digits and '-' "
        "(Services are named after the model and Kubernetes refuses dots there): e.g. qwen3-5-small, not qwen3.5-small",
    ),  # no fieldPath: the API server accepts none into metadata; the message names the field
)


class DisaggregatedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    cel_rules: ClassVar[tuple[CelRule, ...]] = MODEL_RULES

    api_version: Literal["disagg.dev/v1alpha1"] = Field(
        default=f"{contract.API_GROUP}/{contract.API_VERSION}", alias="apiVersion"
    )
    kind: Literal["DisaggregatedModel"] = contract.KIND
    metadata: ObjectMeta
    spec: DisaggregatedModelSpec
    status: DisaggregatedModelStatus | None = None


# --- DisaggregatedRole: the scale target of one engine role -------------------------------------------


class DisaggregatedRoleSpec(ApiModel):
    """The size of one engine role of a DisaggregatedModel, under a name that survives revisions."""

    replicas: Annotated[int, Field(ge=0, le=1000)] = Field(
        default=1,
        description="Pods of the role. Written by `kubectl scale`, an HPA or KEDA through the scale subresource, or by "
        "the operator when the model's spec.<role>.replicas changes; the operator rolls every revision out to it.",
    )


class DisaggregatedRoleStatus(ApiModel):
    """What the role has now, written by the operator."""

    replicas: int = Field(default=0, description="Pods of the role in every revision (the scale subresource's status).")
    ready_replicas: int = Field(default=0, description="Ready pods of the role in every revision.")
    selector: str = Field(default="", description="Label selector of the role's pods, for the HPA (label-selector syntax).")
    revision: str | None = Field(default=None, description="The model's current revision.")
