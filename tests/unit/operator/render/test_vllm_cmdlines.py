"""vLLM's own argument parser and KVTransferConfig, of every checked release (one per pin file: 0.34.0, 0.33.0, 0.26.0), judge
every command line we render.

The lines are checked after Kubernetes' $(VAR) expansion with sample Downward API values, i.e. as the
container really receives them.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from disagg_bench.localrun.plan import LocalOptions, local_plan

from tests.fixtures.models import EXAMPLES, REPO, load_example
from tests.fixtures.strategies import models
from tests.fixtures.vllm_cli import CHECKED_VERSIONS, check_command_lines
from tests.fixtures.render import shell_argv
from tests.fixtures.render import command_lines

pytestmark = pytest.mark.vllm

def judge(items: list[dict[str, Any]], version: str) -> None:
    results = check_command_lines([{"id": i["id"], "argv": i["argv"]} for i in items], version)
    for item, result in zip(items, results):
        assert result["ok"], f"{item['id']}: vLLM refused {item['argv']}: {result['error']}"
        parsed = result["parsed"]
        assert parsed["engine_id"] == item["expect"]["engine_id"], item["id"]
        assert parsed["kv_role"] == item["expect"]["kv_role"], item["id"]
        config = json.loads(item["argv"][item["argv"].index("--kv-transfer-config") + 1])
        assert parsed["kv_connector"] == config["kv_connector"]
        assert parsed["kv_connector_extra_config"] == config["kv_connector_extra_config"]
        # vLLM's config post-init keeps the connector: nothing in the line turns KV offloading on in its place
        assert (parsed["kv_connector_after_post_init"], parsed["kv_role_after_post_init"]) == (config["kv_connector"], config["kv_role"]), item["id"]


def local_command_lines(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The lines disagg-localrun starts for a model, with the H200 runs' overrides (hack/gpu/run.sh)."""
    options = LocalOptions(gpus=tuple(str(i) for i in range(64)), colocate=True, backend="UCX", model_path="/tmp/model", load_format="dummy",
                           enforce_eager=True, kv_cache_memory_bytes=30 << 30, gpu_memory_utilization=0.35)
    plan = local_plan(obj, options, secrets={"HF_TOKEN": "t"})
    with tempfile.TemporaryDirectory() as tmp:  # a pod of an engine that spans pods runs vLLM through its shell
        return [{"id": f"local {obj['metadata']['name']}/{e.role}-{e.index}",
                 "argv": shell_argv(list(e.argv), dict(e.env), Path(tmp)) if e.argv[0] == "/bin/sh" else list(e.argv),
                 "expect": {"engine_id": e.engine_id, "kv_role": "kv_producer" if e.role == "prefill" else "kv_consumer"}}
                for e in plan.engines]  # fmt: skip


@pytest.mark.parametrize("version", CHECKED_VERSIONS)
def test_examples_parse_with_vllm(version: str) -> None:
    items = [i for path in EXAMPLES for i in command_lines(load_example(path))]
    assert len(items) == 2 * len(EXAMPLES)
    local = [load_example(p) for p in (*EXAMPLES, REPO / "hack" / "gpu" / "qwen3-0.6b-h200.yaml", REPO / "hack" / "gpu" / "qwen3-0.6b-2p1d.yaml")
             if not p.stem.startswith("trn2")]  # Trainium: no local run
    judge(items + [i for obj in local for i in local_command_lines(obj)], version)


# No shrinking: the failure message names the refused line. Each release's checker is imported once per session
# (tests/fixtures/vllm_cli.py), so an example costs its rendering and two batches of milliseconds per line.
@settings(max_examples=5, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(models(), min_size=20, max_size=20))
def test_any_accepted_spec_renders_lines_vllm_accepts(objs: list[dict[str, Any]]) -> None:
    items = [i for n, obj in enumerate(objs) for i in command_lines({**obj, "metadata": {**obj["metadata"], "name": f"m{n}"}})]
    for version in CHECKED_VERSIONS:
        judge(items, version)
