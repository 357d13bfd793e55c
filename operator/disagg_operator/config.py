"""Operator-wide defaults for rendered children. The Helm chart sets them (env), not the code."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Mapping

from .api.models import DEFAULT_VLLM_VERSION, IMAGED_NVIDIA_RELEASES

# Tagged with the vLLM release inside: the neuron image is AWS's vLLM-Neuron DLC, an older vLLM.
ENGINE_REPOSITORY = "ghcr.io/disagg-dev/vllm-runtime"
ENGINE_IMAGE = f"{ENGINE_REPOSITORY}:{DEFAULT_VLLM_VERSION['nvidia']}-efa"
NEURON_ENGINE_IMAGE = f"{ENGINE_REPOSITORY}:{DEFAULT_VLLM_VERSION['neuron']}-neuron"
ROUTER_IMAGE = "ghcr.io/disagg-dev/disagg-router:0.1.0"


class DefaultsError(ValueError):
    """The operator's environment names defaults it cannot use; the message says which variable to change."""


@dataclass(frozen=True)
class RenderDefaults:
    engine_image: str = ENGINE_IMAGE  # runs DEFAULT_VLLM_VERSION["nvidia"]
    neuron_engine_image: str = NEURON_ENGINE_IMAGE  # runs DEFAULT_VLLM_VERSION["neuron"]
    router_image: str = ROUTER_IMAGE
    # The images of the other NVIDIA releases a model may name in spec.engine.vllmVersion without an image
    # (a model pinned to a release keeps its image when the operator's default release moves). Unlisted:
    # ENGINE_REPOSITORY:<release>-efa, built from images/vllm-runtime with VLLM_VERSION=<release>.
    engine_images: Mapping[str, str] = field(default_factory=dict)

    def engine_image_for(self, release: str, accelerator: str) -> str | None:
        """The default image of `release` on `accelerator`, or None where there is none (admission then asks the
        model for spec.engine.image)."""
        if accelerator == "neuron":
            return self.neuron_engine_image if release == DEFAULT_VLLM_VERSION["neuron"] else None
        if release == DEFAULT_VLLM_VERSION["nvidia"]:
            return self.engine_image
        if release in self.engine_images:
            return self.engine_images[release]
        return f"{ENGINE_REPOSITORY}:{release}-efa" if release in IMAGED_NVIDIA_RELEASES else None

    @classmethod
    def from_env(cls) -> "RenderDefaults":
        return cls(
            engine_image=os.environ.get("DISAGG_ENGINE_IMAGE", ENGINE_IMAGE),
            neuron_engine_image=os.environ.get("DISAGG_NEURON_ENGINE_IMAGE", NEURON_ENGINE_IMAGE),
            router_image=os.environ.get("DISAGG_ROUTER_IMAGE", ROUTER_IMAGE),
            engine_images=_release_images(os.environ.get("DISAGG_ENGINE_IMAGES", "")),
        )


def _release_images(raw: str) -> dict[str, str]:
    """DISAGG_ENGINE_IMAGES: a JSON object of release -> image (the chart's modelDefaults.engineImages)."""
    if not raw.strip():
        return {}
    try:
        images = json.loads(raw)
    except json.JSONDecodeError as error:
        raise DefaultsError(f"DISAGG_ENGINE_IMAGES is not JSON ({error}): write an object of release to image, "
                            'e.g. {"0.34.0": "registry.example.com/vllm-runtime:0.34.0-efa"}') from None  # fmt: skip
    if not isinstance(images, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in images.items()):
        raise DefaultsError('DISAGG_ENGINE_IMAGES must be a JSON object of release to image, e.g. {"0.34.0": "registry.example.com/vllm-runtime:0.34.0-efa"}')
    unknown = sorted(set(images) - set(IMAGED_NVIDIA_RELEASES))
    if unknown:
        raise DefaultsError(f"DISAGG_ENGINE_IMAGES names {', '.join(unknown)}, not NVIDIA releases the operator renders "
                            f"({', '.join(IMAGED_NVIDIA_RELEASES)}): remove them")  # fmt: skip
    return images
