"""An engine that spans pods, rendered onto a LeaderWorkerSet group: what each pod runs, judged by vLLM.

Each pod's command line is what the real shell
makes of the rendered one for its LWS worker index, then what both vLLM releases' parsers read from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disagg_connector import contract
from disagg_operator.api.models import DisaggregatedModel
from disagg_operator.api.validation import parse
from disagg_operator.render import render

from tests.fixtures.models import dm
from tests.fixtures.vllm_cli import CHECKED_VERSIONS, check_command_lines
from tests.fixtures.render import LEADER, POD_UID, pod_argv

# DeepSeek-V3-like wide EP decode: DP16 x TP1 over two 8-GPU pods
SPEC = {"decode": {"parallelism": {"data": 16, "expert": True}, "accelerator": {"count": 8}},
        "prefill": {"parallelism": {"data": 8, "expert": True}, "accelerator": {"count": 8}}}


def model() -> DisaggregatedModel:
    return parse(dm(SPEC))


def engines_of(role: str) -> dict[str, Any]:
    (workload,) = [o for o in render(model()).objects if o["kind"] in ("Deployment", "LeaderWorkerSet")
                   and o["metadata"]["labels"].get(contract.LABEL_ROLE) == role]  # fmt: skip
    return workload


def decode_template() -> dict[str, Any]:
    return engines_of("decode")["spec"]["leaderWorkerTemplate"]["workerTemplate"]


def test_one_group_per_engine_every_pod_from_one_template() -> None:
    lws = engines_of("decode")
    assert lws["kind"] == "LeaderWorkerSet" and lws["spec"]["replicas"] == 1
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert "leaderTemplate" not in group  # the leader is worker 0 of the same template
    assert group["workerTemplate"]["metadata"]["labels"][contract.LABEL_REVISION] == lws["metadata"]["labels"][contract.LABEL_REVISION]
    assert engines_of("prefill")["kind"] == "Deployment"  # DP8 on 8 GPUs: one pod per engine
    assert group["workerTemplate"]["metadata"]["annotations"][contract.ANNOTATION_DP_SIZE_LOCAL] == "8"


@pytest.mark.vllm
@pytest.mark.parametrize("version", CHECKED_VERSIONS)
def test_each_pods_command_line_is_what_vllm_reads_as_its_ranks(version: str, tmp_path: Path) -> None:
    (container,) = decode_template()["spec"]["containers"]
    lines = [{"id": f"decode-{i}", "argv": pod_argv(container, i, tmp_path)} for i in (0, 1)]
    results = check_command_lines(lines, version)
    for index, (line, result) in enumerate(zip(lines, results)):
        assert result["ok"], f"{line['id']}: vLLM {version} refused {line['argv']}: {result['error']}"
        parsed = result["parsed"]
        assert (parsed["data_parallel_size"], parsed["data_parallel_size_local"], parsed["data_parallel_start_rank"]) == (16, 8, 8 * index)
        assert parsed["data_parallel_address"] == LEADER and parsed["data_parallel_rpc_port"] == contract.DATA_PARALLEL_RPC_PORT
        assert parsed["data_parallel_hybrid_lb"] is True and parsed["enable_expert_parallel"] is True
        assert parsed["engine_id"] == contract.engine_id(f"m-decode-abc-0-{index}", POD_UID)


def test_the_router_reads_each_pods_ranks_from_its_worker_index() -> None:
    annotations = decode_template()["metadata"]["annotations"]
    for index in (0, 1):
        ids = contract.identities_from_pod(f"p{index}", "u", "10.0.0.1", annotations, {contract.LWS_WORKER_INDEX_LABEL: str(index)})
        assert [i.dp_rank for i in ids] == list(range(8 * index, 8 * index + 8))
        assert [i.dp_local_index for i in ids] == list(range(8))
        assert ids[0].side_channel_port == 5600 + 8 * index and ids[0].engine_id.endswith(f"_dp{8 * index}")
