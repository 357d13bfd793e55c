"""The simulator answers as the vLLM release it stands in for: P's kv_transfer_params carry ``transfer_mode`` from
0.33.0 on only (vLLM 0.26.0's push_scheduler.py does not return it). vllm-router 0.1.17 moves a prefill URL to
concurrent push once P's answer says ``transfer_mode: "push"``, and its cache_aware prefill pick behaves differently
on that path: on 0.26.0 engines it never learnt push (bench/results/h200-issue20-peers.md), so a replay of those
runs must not teach it (bench/results/sim-vs-real.md, issue 19's routing runs)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg_connector import contract
from disagg_bench.vllm_sim import sim
from disagg_bench.vllm_sim.as_vllm import sim_argv

from tests.fixtures.vllm_sim import sim_engine

KV = '{"kv_connector":"NixlPushConnector","kv_role":"kv_producer"}'


def _engine(mode: str, *extra: str) -> sim.Engine:
    return sim_engine("prefill", mode, *extra, engine_id="p")


def _finished_prefill() -> sim.Seq:
    """A prefill of 300 tokens whose answer P is about to give."""
    return sim.Seq("x", "cmpl-x-0-abcd1234", "cmpl-x", "completions", 300, 1, 0, {"do_remote_decode": True})


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("version", contract.VLLM_VERSIONS)
def test_prefill_answer_names_its_transfer_mode_from_0_33_on(mode: str, version: str) -> None:
    engine = _engine(mode, "--vllm-version", version)
    params = engine.returned_params(_finished_prefill())
    assert params.get("transfer_mode") == (mode if contract.VllmProtocol(version).returns_transfer_mode else None)
    assert params["remote_engine_id"] == "p" and params["remote_num_tokens"] == 300  # the rest as before


def test_the_default_release_is_0_33_0() -> None:
    engine = _engine("push")
    assert engine.returned_params(_finished_prefill())["transfer_mode"] == "push"


def test_as_vllm_takes_the_release_from_the_environment() -> None:
    def version(env: dict[str, str]) -> str:
        return sim.build_parser().parse_args(sim_argv(["serve", "m", "--kv-transfer-config", KV], env, {})).vllm_version

    assert version({}) == "0.33.0"
    assert version({"DISAGG_SIM_VLLM_VERSION": "0.26.0"}) == "0.26.0"
    with pytest.raises(SystemExit):  # a release the operator does not render for
        version({"DISAGG_SIM_VLLM_VERSION": "0.99.0"})


def test_version_endpoint_reports_the_release() -> None:
    async def get() -> object:
        async with TestClient(TestServer(_engine("push", "--vllm-version", "0.26.0").http_app())) as client:
            r = await client.get("/version")
            return r.status, await r.json()

    assert asyncio.run(get()) == (200, {"version": "0.26.0"})


@pytest.mark.parametrize(
    ("prefill", "decode", "pair"),
    [("0.34.0", "0.34.0", True), ("0.33.0", "0.34.0", False), ("0.34.0", "0.33.0", False), ("0.33.0", "0.33.0", True),
     ("0.26.0", "0.33.0", False)],
)
def test_engines_of_two_releases_never_handshake(prefill: str, decode: str, pair: bool) -> None:
    """vLLM puts its own version in NIXL's compatibility hash (0.26.0, 0.33.0, 0.34.0): a 0.33.0 and a 0.34.0 engine
    of otherwise equal settings refuse each other's handshake, so a rollout between them that paired across revisions
    would fail."""

    hashes = (sim_engine(role, "push", "--vllm-version", version).compat_hash for role, version in (("prefill", prefill), ("decode", decode)))
    assert (next(hashes) == next(hashes)) == pair


def test_engines_without_a_cpu_tier_start_whatever_their_kv_size() -> None:
    """Zero-cost engines (router_bench's peers: no KV size) have no tier; a tier needs a KV size to count blocks."""
    zero = sim_engine("prefill", "push", "--kv-bytes-per-token", "0")
    assert zero.caches[0].cpu_blocks == 0
    with pytest.raises(SystemExit, match="kv-bytes-per-token"):
        sim_engine("prefill", "push", "--kv-bytes-per-token", "0", "--cpu-offload-bytes", "1024")
