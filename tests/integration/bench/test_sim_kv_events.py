"""The simulator as vLLM with prefix caching and ``--kv-events-config``: a real ZMQ subscriber sees each DP
rank's BlockStored batches on its own port (the endpoint's port plus the rank), a request sharing a prefix
hits it (``vllm:prefix_cache_hits_total``) and answers its first token sooner, and a replay from seq 0
returns the batches the subscriber saw."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
import time
import urllib.request
import uuid
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from disagg_connector import contract  # noqa: E402
from disagg_connector.contract import kv_blocks  # noqa: E402
from disagg_bench.vllm_sim import harness as h  # noqa: E402
from disagg_bench.vllm_sim import prefix_cache as pc  # noqa: E402

BLOCK = 16
DECODER = msgspec.msgpack.Decoder(pc.KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def metric(sim: h.Sim, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(h.http_get(sim.url + "/metrics")[1].decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def labels_of(sim: h.Sim, name: str) -> list[dict[str, str]]:
    text = h.http_get(sim.url + "/metrics")[1].decode()
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def post_json(url: str, body: Any = None) -> Any:
    req = urllib.request.Request(url, json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def complete(sim: h.Sim, prompt: str, rank: int, **extra: Any) -> str:
    """One streamed completion on DP rank ``rank``, read to its end; returns its request id."""
    import aiohttp

    xid = uuid.uuid4().hex

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            body = {**h.completion(stream=True, max_tokens=2), "prompt": prompt, **extra}
            headers = {"X-data-parallel-rank": str(rank), "X-Request-Id": xid}
            async with s.post(sim.url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200
                assert (await r.read()).endswith(b"data: [DONE]\n\n")

    asyncio.run(go())
    return xid


def scheduled(sim: h.Sim, xid: str) -> dict[str, Any]:
    """The simulator's record of the request's prompt taking its blocks: cached and computed tokens."""
    [event] = [e for e in sim.events("prompt_scheduled") if e["xid"] == xid]
    return event


class Subscriber:
    """vLLM's documented consumer: SUB on a rank's endpoint, DEALER on its replay endpoint."""

    def __init__(self, port: int, replay_port: int, host: str = h.HOST) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://{host}:{port}")
        self.host, self.replay_port = host, replay_port
        self.seen: list[tuple[int, bytes]] = []

    def receive(self, timeout_ms: int) -> pc.KVEventBatch | None:
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == b""
        self.seen.append((int.from_bytes(seq, "big"), payload))
        return DECODER.decode(payload)

    def until(self, wanted: type, timeout: float = 10.0) -> pc.KVEventBatch:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = self.receive(100)
            if batch is not None and any(isinstance(e, wanted) for e in batch.events):
                return batch
        raise AssertionError(f"no {wanted.__name__} within {timeout}s; seen {len(self.seen)} batches")

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://{self.host}:{self.replay_port}")
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            out = []
            while True:
                assert dealer.poll(10_000), "the replay did not end"
                empty, topic, seq, payload = dealer.recv_multipart()
                assert (empty, topic) == (b"", b"")
                if seq == END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = h.free_port_block(4)  # PUB base, base + 1 (ranks 0, 1); replay base + 2, base + 3
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{base}",
              "replay_endpoint": f"tcp://*:{base + 2}", "buffer_steps": 100}
    sim = h.launch_sim(tmp_path_factory.mktemp("sim-kv-events"), "decode", "push", dp=2,
                       extra=["--block-size", str(BLOCK), "--kv-events-config", json.dumps(config),
                              "--prefix-caching-hash-algo", contract.KV_HASH_ALGO])
    h.wait_ready(sim)
    yield sim, base
    h.stop_all(sim)


def subscribed(url: str, port: int, replay_port: int, host: str = h.HOST) -> Subscriber:
    """A subscriber that is known to receive: ZMQ's SUB joins asynchronously, so reset the (empty) cache
    until an AllBlocksCleared batch arrives."""
    s = Subscriber(port, replay_port, host)
    for _ in range(100):
        assert post_json(url + "/reset_prefix_cache") == {"success": True}
        batch = s.receive(100)
        if batch is not None:
            assert [type(e) for e in batch.events] == [pc.AllBlocksCleared]
            return s
    raise AssertionError("the subscriber never received a batch")


def test_events_hits_and_replay_of_one_rank(engine: Any) -> None:
    sim, base = engine
    rank = 1  # the endpoint's port + 1, and data_parallel_rank 1 in every batch
    sub = subscribed(sim.url, base + rank, base + 2 + rank)
    try:
        prefix = words("shared", 4 * BLOCK)
        first, second = f"{prefix} {words('a', 3)}", f"{prefix} {words('b', 2)}"
        complete(sim, first, rank)
        stored = sub.until(pc.BlockStored)
        assert stored.data_parallel_rank == rank
        [event] = stored.events
        tokens = pc.completion_token_ids(first)
        seed = os.environ.get("PYTHONHASHSEED", kv_blocks.DEFAULT_NONE_HASH_SEED)  # the simulator's, as vLLM's
        hashes = kv_blocks.block_hashes(tokens, BLOCK, seed, contract.KV_HASH_ALGO)
        assert isinstance(event, pc.BlockStored)
        assert event.block_hashes == [kv_blocks.external_hash(x) for x in hashes] and len(hashes) == 4
        assert (event.parent_block_hash, event.token_ids, event.block_size) == (None, tokens[: 4 * BLOCK], BLOCK)

        before = metric(sim, "vllm:prefix_cache_hits_total", engine=str(rank))
        complete(sim, second, rank)
        assert metric(sim, "vllm:prefix_cache_hits_total", engine=str(rank)) == before + 4 * BLOCK
        assert metric(sim, "vllm:prefix_cache_queries_total", engine=str(rank)) == len(tokens) + len(pc.completion_token_ids(second))
        assert metric(sim, "vllm:prefix_cache_hits_total", engine="0") == 0  # the other rank's cache is its own
        assert metric(sim, "vllm:kv_cache_usage_perc", engine=str(rank)) == 0  # both done: cached blocks are free

        # a reset after both: the last batch; then a replay from 0 has every batch, the subscriber's among them
        assert post_json(sim.url + "/reset_prefix_cache") == {"success": True}
        sub.until(pc.AllBlocksCleared)
        replayed = sub.replay(0)
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        first_seen = sub.seen[0][0]
        assert [r for r in replayed if r[0] >= first_seen] == sub.seen
        assert sub.replay(first_seen + 1) == sub.seen[1:]
    finally:
        sub.close()


def test_a_shared_prefix_is_not_computed_again(engine: Any) -> None:
    """The simulator charges a prefill for the tokens past the cached prefix only (its own record of each
    scheduled prompt, not the wall clock)."""
    sim, _ = engine
    prefix = words("ttft", 2000)
    before = metric(sim, "vllm:prefix_cache_hits_total", engine="0")
    cold, warm, other = (scheduled(sim, complete(sim, prompt, 0)) for prompt in (f"{prefix} one", f"{prefix} two three", f"{words('other', 2000)} one"))
    cached = 2000 // BLOCK * BLOCK
    assert (cold["hit_tokens"], warm["hit_tokens"], other["hit_tokens"]) == (0, cached, 0)
    assert cold["computed_tokens"] - warm["computed_tokens"] == cached - 1  # the warm prompt is one word longer
    assert warm["prefill_seconds"] < cold["prefill_seconds"] / 2 and warm["prefill_seconds"] < other["prefill_seconds"] / 2
    assert metric(sim, "vllm:prefix_cache_hits_total", engine="0") == before + cached


def test_cache_config_info_and_a_prefill_engine_that_does_not_cache(tmp_path: pathlib.Path) -> None:
    sim = h.launch_sim(tmp_path, "prefill", "push", extra=["--block-size", str(BLOCK), "--no-enable-prefix-caching"])
    try:
        h.wait_ready(sim)
        [info] = labels_of(sim, "vllm:cache_config_info")
        assert (info["block_size"], info["enable_prefix_caching"], info["engine"]) == (str(BLOCK), "False", "0")
        assert info["prefix_caching_hash_algo"] == "sha256"  # vLLM's default
        assert info["num_gpu_blocks"] == "65536"
        prompt = words("nocache", 4 * BLOCK + 1)
        for _ in range(2):
            reply = asyncio.run(h.post(sim.url + "/v1/completions", {**h.completion(max_tokens=1), "prompt": prompt,
                                                                     "kv_transfer_params": {"do_remote_decode": True}}))
            assert reply.status == 200
        assert metric(sim, "vllm:prefix_cache_hits_total", engine="0") == 0
        # P holds both prefills' blocks under their leases: 5 blocks each, nothing shared
        assert metric(sim, "vllm:kv_cache_usage_perc", engine="0") == 10 / 65536
    finally:
        h.stop_all(sim)


def test_a_prefill_engine_hits_what_it_holds_for_decode(tmp_path: pathlib.Path) -> None:
    sim = h.launch_sim(tmp_path, "prefill", "push", extra=["--block-size", str(BLOCK)])
    try:
        h.wait_ready(sim)
        prompt = words("held", 4 * BLOCK + 1)
        for _ in range(2):
            body = {**h.completion(max_tokens=1), "prompt": prompt, "kv_transfer_params": {"do_remote_decode": True}}
            assert asyncio.run(h.post(sim.url + "/v1/completions", body)).status == 200
        assert metric(sim, "vllm:prefix_cache_hits_total", engine="0") == 4 * BLOCK
        assert metric(sim, "vllm:prefix_cache_queries_total", engine="0") == 2 * (4 * BLOCK + 1)
        # 5 blocks for the first, 4 shared + 1 for the second: 6 held under the leases
        assert metric(sim, "vllm:kv_cache_usage_perc", engine="0") == 6 / 65536
    finally:
        h.stop_all(sim)


def test_simulated_pods_on_one_machine_publish_on_the_same_port(tmp_path: pathlib.Path) -> None:
    """``--kv-events-host``: each simulated pod binds the rendered wildcard endpoint on its own loopback address,
    as each real pod binds it in its own network namespace."""
    port = h.free_port_block(2)
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 1}"})
    pods = []
    try:
        for ip in ("127.0.0.2", "127.0.0.3"):
            sim = h.launch_sim(tmp_path, "decode", "push", extra=["--kv-events-config", config, "--kv-events-host", ip, "--host", ip])
            pods.append((ip, sim))
        for ip, sim in pods:
            url = f"http://{ip}:{sim.port}"
            h.wait_until(lambda: h.http_get(url + "/health", timeout=2)[0] == 200, what=f"pod {ip} up")
            s = subscribed(url, port, port + 1, host=ip)
            try:
                replayed = s.replay(0)  # its own replay socket, on the same address
                assert replayed and [seq for seq, _ in replayed] == list(range(len(replayed)))
            finally:
                s.close()
    finally:
        h.stop_all(*(sim for _, sim in pods))


def test_a_cpu_tier_gives_back_what_the_gpu_evicted_and_says_so(tmp_path: pathlib.Path) -> None:
    """A GPU pool of 40 blocks and a CPU tier of 100 (--cpu-offload-bytes over 1 KiB of KV per token): a prompt
    evicted by the next one is copied back from the CPU tier, not computed, and counted as vLLM counts a
    connector's hits; the tier's stores are published as events of medium CPU."""
    base = h.free_port_block(2)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{base}",
              "replay_endpoint": f"tcp://*:{base + 1}", "buffer_steps": 100}
    sim = h.launch_sim(tmp_path, "decode", "push", extra=[
        "--block-size", str(BLOCK), "--num-gpu-blocks", "40", "--kv-bytes-per-token", "1024",
        "--cpu-offload-bytes", str(100 * BLOCK * 1024), "--kv-events-config", json.dumps(config)])  # fmt: skip
    try:
        h.wait_ready(sim)
        sub = subscribed(sim.url, base, base + 1)
        try:
            first, other = words("tier-a", 500), words("tier-b", 500)  # 31 full blocks and a partial each
            cold = scheduled(sim, complete(sim, first, 0))
            stored = sub.until(pc.BlockStored)
            assert {e.medium for e in stored.events if isinstance(e, pc.BlockStored)} == {"CPU", "GPU"}
            scheduled(sim, complete(sim, other, 0))  # evicts the tail of the first from the GPU pool (tail first)
            again = scheduled(sim, complete(sim, first, 0))
        finally:
            sub.close()
        assert (cold["hit_tokens"], cold["restored_tokens"]) == (0, 0)
        assert again["hit_tokens"] + again["restored_tokens"] == 31 * BLOCK and again["restored_tokens"] >= 16 * BLOCK
        assert again["prefill_seconds"] < cold["prefill_seconds"] / 2
        assert metric(sim, "vllm:external_prefix_cache_hits_total", engine="0") == again["restored_tokens"]
    finally:
        h.stop_all(sim)
