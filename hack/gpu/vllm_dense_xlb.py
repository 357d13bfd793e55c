"""`vllm` with one change for a dense model whose engine spans pods at one data-parallel rank per pod: a
workaround for a vLLM 0.26.0 fault, to run the operator's rendered command lines unchanged on the rest.

With `--data-parallel-size-local 1` vLLM turns hybrid load balancing into external load balancing
(`engine/arg_utils.py`: "data_parallel_hybrid_lb is not eligible when data_parallel_size_local = 1, autoswitch
to data_parallel_external_lb") after its check that external load balancing is for MoE models only. A dense
model has no DP coordinator under external load balancing (`VllmConfig.needs_dp_coordinator`), but the API
server's client for external load balancing, `DPAsyncMPClient`, subscribes to the coordinator's stats and
asserts on their address (`v1/engine/core_client.py:1247`, `assert self.stats_update_address is not None`): the
API server dies after every engine core has started and passed the group's handshake (seen on the H200,
bench/results/h200-issue18-dp.md). Here that case gets `AsyncMPClient`, the client of an engine of one rank, which
is what such a pod is (its ranks share nothing for a dense model; the engine core already carries its global
rank: engine_id `_dp<rank>`, NIXL side channel base + rank). Everything else is vLLM's.

    python3 hack/gpu/vllm_dense_xlb.py serve MODEL ...     # as `vllm serve MODEL ...`

It served the lines rendered before admission asked for `parallelism.expert` on an engine that spans pods. With
`--enable-expert-parallel` (what is admitted now) vLLM refuses a dense model earlier, in `VllmConfig`'s checks
("Number of experts in the model must be greater than 0 ..."), and this workaround does not reach that.
"""

from __future__ import annotations

import sys

from vllm.v1.engine import core_client

_make_async_mp_client = core_client.EngineCoreClient.make_async_mp_client


def make_async_mp_client(vllm_config, executor_class, log_stats, client_addresses=None, client_count=1, client_index=0):  # type: ignore[no-untyped-def]
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1 and parallel.data_parallel_external_lb and not vllm_config.needs_dp_coordinator:
        print(f"vllm_dense_xlb: dense model, external DP load balancing, no DP coordinator: AsyncMPClient for rank "
              f"{parallel.data_parallel_rank} instead of DPAsyncMPClient", file=sys.stderr, flush=True)
        return core_client.AsyncMPClient(vllm_config, executor_class, log_stats, client_addresses, client_count, client_index)
    return _make_async_mp_client(vllm_config, executor_class, log_stats, client_addresses, client_count, client_index)


core_client.EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
