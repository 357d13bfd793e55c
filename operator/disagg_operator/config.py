"""Operator-wide defaults for rendered children. The Helm chart sets them (env), not the code."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .api.models import DEFAULT_VLLM_VERSION

# Tagged with the vLLM release inside: the neuron image is AWS's vLLM-Neuron DLC, an older vLLM.
ENGINE_IMAGE = f"ghcr.io/disagg-dev/vllm-runtime:{DEFAULT_VLLM_VERSION['nvidia']}-efa"
NEURON_ENGINE_IMAGE = f"ghcr.io/disagg-dev/vllm-runtime:{DEFAULT_VLLM_VERSION['neuron']}-neuron"
ROUTER_IMAGE = "ghcr.io/disagg-dev/disagg-router:0.1.0"


@dataclass(frozen=True)
class RenderDefaults:
    engine_image: str = ENGINE_IMAGE
    neuron_engine_image: str = NEURON_ENGINE_IMAGE
    router_image: str = ROUTER_IMAGE

    @classmethod
    def from_env(cls) -> "RenderDefaults":
        return cls(
            engine_image=os.environ.get("DISAGG_ENGINE_IMAGE", ENGINE_IMAGE),
            neuron_engine_image=os.environ.get("DISAGG_NEURON_ENGINE_IMAGE", NEURON_ENGINE_IMAGE),
            router_image=os.environ.get("DISAGG_ROUTER_IMAGE", ROUTER_IMAGE),
        )
