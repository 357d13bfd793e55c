"""An engine's shape over pods follows from parallelism and accelerator.count: the user never states it twice."""

from __future__ import annotations

import pytest

from disagg_operator.api.models import AcceleratorSpec, EngineShape, Parallelism, engine_shape


@pytest.mark.parametrize(("tensor", "pipeline", "data", "count", "shape"), [
    (1, 1, 1, 1, EngineShape(1, 1, 1, 1, 1)),  # the smallest engine
    (8, 1, 1, 8, EngineShape(1, 1, 8, 8, 1)),  # Qwen3-32B TP8 on a p5en
    (1, 1, 8, 8, EngineShape(8, 1, 8, 1, 1)),  # DP8 in one pod (a wide-EP prefill)
    (1, 1, 16, 8, EngineShape(8, 2, 8, 1, 1)),  # DP16 over two p5en nodes (a wide-EP decode)
    (2, 1, 8, 8, EngineShape(4, 2, 8, 2, 1)),  # TP2 x DP8: four ranks a node, two nodes
    (4, 2, 2, 8, EngineShape(1, 2, 8, 4, 2)),  # TP4 x PP2 fills a node; DP2 spans two
])  # fmt: skip
def test_nvidia_ranks_fill_each_pods_gpus(tensor: int, pipeline: int, data: int, count: int, shape: EngineShape) -> None:
    found = engine_shape(Parallelism(tensor=tensor, pipeline=pipeline, data=data), AcceleratorSpec(type="nvidia", count=count))
    assert found == shape
    assert found.accelerators == tensor * pipeline * data  # one GPU per rank, none idle


def test_neuron_engines_are_one_pod() -> None:
    shape = engine_shape(Parallelism(tensor=64, data=2), AcceleratorSpec(type="neuron", count=16))
    assert (shape.pods, shape.ranks_per_pod, shape.accelerators) == (1, 2, 16)
