"""Decisions derived from a spec: effective transfer mode, backend and buffer device, with reasons.

Pure functions: the renderer uses them to wire pods, the status writer reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from disagg_connector.contract import VLLM_VERSIONS, VllmProtocol

from .api.models import DEFAULT_VLLM_VERSION, IMAGED_NVIDIA_RELEASES, DisaggregatedModel, DisaggregatedModelSpec

TransferMode = Literal["Push", "Pull"]
Backend = Literal["LIBFABRIC", "UCX"]

CONNECTOR = {"Push": "NixlPushConnector", "Pull": "NixlConnector"}


@dataclass(frozen=True)
class TransferPlan:
    mode: TransferMode
    reason: str
    backend: Backend
    backend_reason: str
    buffer_device: Literal["cuda", "cpu"]
    vllm_version: str

    @property
    def connector(self) -> str:
        return CONNECTOR[self.mode]


def vllm_version(spec: DisaggregatedModelSpec) -> str:
    """The release the engines run: the spec's, else the default image's for the accelerator (render first
    gives a running model's spec the release it runs: keep_release)."""
    return spec.engine.vllm_version or DEFAULT_VLLM_VERSION[spec.prefill.accelerator.type]


def held_release(spec: DisaggregatedModelSpec, status: Mapping[str, Any] | None) -> str | None:
    """The release a running model keeps while its spec names none: the one its status says it runs.

    So an operator upgrade that moves DEFAULT_VLLM_VERSION rolls no running model; each moves when its spec
    names the new release (`disagg-operator plan` shows the rollout first). Not held: a release the spec names,
    a status without one (a new model, or one last written by an operator before status.vllmVersion), and a
    release the accelerator does not run or the operator has no image of (the spec moved to another
    accelerator, or dropped its image)."""
    if spec.engine.vllm_version is not None or not status:
        return None
    running = status.get("vllmVersion")
    if running not in VLLM_VERSIONS:
        return None
    if spec.prefill.accelerator.type == "neuron":
        return running if running == DEFAULT_VLLM_VERSION["neuron"] else None
    return running if running in IMAGED_NVIDIA_RELEASES or spec.engine.image else None


def keep_release(dm: DisaggregatedModel, status: Mapping[str, Any] | None) -> DisaggregatedModel:
    """The model as the operator renders it: its spec names the release held_release keeps, if any."""
    held = held_release(dm.spec, status)
    if held is None:
        return dm
    engine = dm.spec.engine.model_copy(update={"vllm_version": held})
    return dm.model_copy(update={"spec": dm.spec.model_copy(update={"engine": engine})})


def _needs_pull(spec: DisaggregatedModelSpec) -> str | None:
    """The first requested feature that push cannot do, in words, or None."""
    if spec.kv_transfer.bidirectional:
        return "bidirectional KV reuse (spec.kvTransfer.bidirectional) works only in pull mode"
    if spec.decode.parallelism.pipeline > 1:
        return "decode pipeline parallel > 1 is not supported by the push connector"
    if spec.decode.parallelism.context > 1:
        return "decode context parallel > 1 is not supported by the push connector"
    if spec.engine.enable_sleep_mode:
        return "sleep mode is not supported by the push connector"
    version = vllm_version(spec)
    if spec.prefill.parallelism.pipeline > 1 and not VllmProtocol(version).push_with_prefill_pipeline:
        return f"the push connector of vLLM {version} takes no pipeline-parallel prefill (0.26.0 and later do)"
    return None


def transfer_mode(spec: DisaggregatedModelSpec) -> tuple[TransferMode, str]:
    requested = spec.kv_transfer.mode
    if requested == "Pull":
        return "Pull", "Pull requested in spec.kvTransfer.mode"
    blocker = _needs_pull(spec)
    if requested == "Push":
        # Admission refuses Push with a blocker; reaching here with one means the CRD was bypassed.
        if blocker:
            raise ValueError(f"spec.kvTransfer.mode Push is impossible: {blocker}")
        return "Push", "Push requested in spec.kvTransfer.mode"
    if blocker:
        return "Pull", f"Auto chose pull: {blocker}"
    return "Push", "Auto chose push: the router sends both legs concurrently and nothing in the spec needs pull"


def backend(spec: DisaggregatedModelSpec) -> tuple[Backend, str]:
    requested = spec.kv_transfer.backend
    if requested != "Auto":
        return requested, f"{requested} requested in spec.kvTransfer.backend"
    if spec.prefill.efa.count > 0:
        return "LIBFABRIC", "Auto chose LIBFABRIC: EFA devices are requested (UCX over EFA runs at TCP speed)"
    return "UCX", "Auto chose UCX: no EFA devices are requested"


def plan(spec: DisaggregatedModelSpec) -> TransferPlan:
    mode, reason = transfer_mode(spec)
    chosen_backend, backend_reason = backend(spec)
    device = spec.kv_transfer.buffer_device
    if device == "Auto":
        device = "cuda" if spec.prefill.accelerator.type == "nvidia" else "cpu"
    return TransferPlan(mode, reason, chosen_backend, backend_reason, device, vllm_version(spec))
