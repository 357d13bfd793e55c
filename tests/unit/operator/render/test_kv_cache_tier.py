"""A CPU tier (spec.<role>.kvCache.cpu): vLLM's OffloadingConnector beside NIXL in a MultiConnector, with NIXL
first, and host memory the pod asks for; vLLM's own parsers and config post-init keep P/D on."""

from __future__ import annotations

import pytest

from disagg_connector import contract
from disagg_operator.api.validation import parse
from disagg_operator.quantity import parse_quantity
from disagg_operator.render import render

from tests.fixtures.models import dm
from tests.fixtures.render import check_invariants, command_lines, engine_container, kv_config
from tests.fixtures.vllm_cli import CHECKED_VERSIONS, check_command_lines

TIER = {"prefill": {"kvCache": {"cpu": "100Gi"}, "resources": {"requests": {"memory": "64Gi"}, "limits": {"memory": "80Gi"}}}}


def test_a_role_with_a_cpu_tier_runs_nixl_first_then_offloading() -> None:
    objects = render(parse(dm(TIER))).objects
    prefill, decode = kv_config(engine_container(objects, "prefill")), kv_config(engine_container(objects, "decode"))
    assert (prefill["kv_connector"], prefill["kv_role"]) == (contract.MULTI_CONNECTOR, "kv_producer")
    nixl, offload = prefill["kv_connector_extra_config"]["connectors"]
    # NIXL's child is the very connector decode runs (in prefill's role), less the engine id MultiConnector hands
    # down from the parent
    assert nixl == {**{k: v for k, v in decode.items() if k != "engine_id"}, "kv_role": "kv_producer"}
    assert prefill["engine_id"] == decode["engine_id"] == contract.engine_id_template()
    assert offload == {"kv_connector": contract.OFFLOADING_CONNECTOR, "kv_role": "kv_both",
                       "kv_connector_extra_config": {"cpu_bytes_to_use": 100 << 30}}  # fmt: skip
    assert contract.transfer_connector_config(prefill) == {**nixl, "engine_id": prefill["engine_id"]}


@pytest.mark.parametrize(("ranks", "memory"), [(1, 64 + 100), (4, 64 + 4 * 100)])
def test_the_pod_asks_for_the_tier_of_every_engine_core_it_runs(ranks: int, memory: int) -> None:
    spec = {**TIER, "prefill": {**TIER["prefill"], "parallelism": {"data": ranks}, "accelerator": {"count": ranks}}}
    resources = engine_container(render(parse(dm(spec))).objects, "prefill")["resources"]
    assert parse_quantity(resources["requests"]["memory"]) == memory << 30
    assert resources["requests"]["memory"] == f"{memory}Gi"  # as a person writes it, in the largest whole unit
    assert parse_quantity(resources["limits"]["memory"]) == (memory - 64 + 80) << 30
    untouched = engine_container(render(parse(dm(spec))).objects, "decode")["resources"]
    assert "memory" not in untouched["limits"]


def test_a_tier_without_a_memory_request_asks_for_the_tier() -> None:
    resources = engine_container(render(parse(dm({"decode": {"kvCache": {"cpu": "8Gi"}}}))).objects, "decode")["resources"]
    assert parse_quantity(resources["requests"]["memory"]) == 8 << 30


@pytest.mark.vllm
@pytest.mark.parametrize("version", CHECKED_VERSIONS)
def test_vllm_parses_the_tier_and_its_post_init_leaves_the_multi_connector(version: str) -> None:
    obj = dm({**TIER, "decode": {"kvCache": {"cpu": "1.5e10"}}})
    check_invariants(obj)
    items = command_lines(obj)
    for item, result in zip(items, check_command_lines([{"id": i["id"], "argv": i["argv"]} for i in items], version)):
        assert result["ok"], f"{item['id']}: vLLM {version} refused {item['argv']}: {result['error']}"
        parsed = result["parsed"]
        assert parsed["kv_connector"] == parsed["kv_connector_after_post_init"] == contract.MULTI_CONNECTOR
        assert parsed["kv_role_after_post_init"] == item["expect"]["kv_role"]
        children = parsed["kv_connector_extra_config"]["connectors"]
        assert [c["kv_connector"] for c in children][1:] == [contract.OFFLOADING_CONNECTOR]
