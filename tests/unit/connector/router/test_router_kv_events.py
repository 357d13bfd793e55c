"""The router's KV-event index and its subscriber, against vLLM's own events.

- ``KvIndex`` (pure): prefix matching, every backend scored at once, sequence gaps held and healed by a
  replay or reset when the replay cannot cover them, a restarted publisher, ``AllBlocksCleared``,
  ``forget``, the LRU bound, and its memory per stored hash (tracemalloc, printed).
- The decoder reads bytes that vLLM 0.33.0's and 0.26.0's own ``KVEventBatch`` classes and msgspec encoder
  wrote, in each release's CPU environment, and skips an event of a tag it does not know; the events of
  each release's own ``BlockPool`` (a prompt cached, two blocks evicted), indexed, match the prompt as
  contract/kv_blocks hashes it.
- ``KvEventSubscriber`` follows vLLM 0.33.0's own ``ZmqEventPublisher`` (run in that environment): a
  subscriber that joins late sees a gap and heals it by replay; with a replay buffer too short it resets.
  A publisher written here on vLLM's wire format makes a gap mid-stream, and one without a replay socket.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import tempfile
import textwrap
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from disagg_connector.contract import kv_blocks
from disagg_connector.router.kv_events import (
    CpuTier,
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    KvEventDecoder,
    KVEventBatch,
    KvEventSubscriber,
    KvIndex,
    ReplayNeeded,
)
from tests.fixtures.vllm_cli import vllm_python
from disagg_bench.vllm_sim.harness import HOST, free_port_block


# --- builders ---------------------------------------------------------------------------------------------------
def stored(*hashes: int | bytes, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
        medium=medium, lora_name=None,
    )


def removed(*hashes: int | bytes) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def batch(*events: Any) -> DecodedBatch:
    return DecodedBatch(ts=0.0, events=list(events), data_parallel_rank=0)


def prompt_keys(n_blocks: int, seed: int = 0) -> list[int]:
    tokens = random.Random(seed).choices(range(150_000), k=16 * n_blocks)
    return kv_blocks.block_hash_keys(tokens, 16, "0")


# --- KvIndex ----------------------------------------------------------------------------------------------------
def test_match_counts_leading_blocks_and_stops_at_the_first_miss() -> None:
    keys = prompt_keys(6)
    index = KvIndex()
    index.apply("a", 0, batch(stored(*keys[:4])))
    index.apply("b", 0, batch(stored(keys[0], keys[1], keys[3], keys[4])))  # misses block 2
    assert index.match("a", keys) == 4
    assert index.match("b", keys) == 2
    assert index.match("c", keys) == 0  # never heard of: no blocks, no error
    assert index.match("a", []) == 0
    assert index.hits_by_backend(keys) == {"a": 4, "b": 2}
    assert index.hits_by_backend(prompt_keys(3, seed=1)) == {}


def test_hits_by_backend_is_match_for_every_backend() -> None:
    rng = random.Random(7)
    keys = prompt_keys(12)
    index = KvIndex()
    backends = [("pod-%d" % i, r) for i in range(6) for r in range(2)]
    for b in backends:
        held = [k for k in keys if rng.random() < 0.8]
        index.apply(b, 0, batch(stored(*held)))
    expected = {b: index.match(b, keys) for b in backends}
    assert index.hits_by_backend(keys) == {b: n for b, n in expected.items() if n > 0}
    assert any(n > 0 for n in expected.values())


def test_hits_by_backend_reads_no_further_than_the_longest_match() -> None:
    keys = prompt_keys(8)
    index = KvIndex()
    index.apply("a", 0, batch(stored(*keys[:3])))
    read: list[int] = []

    def lazily() -> Iterator[int]:
        for k in keys:
            read.append(k)
            yield k

    assert index.hits_by_backend(lazily()) == {"a": 3}
    assert read == keys[:4]  # the fourth is the miss that ends it; the rest were never hashed


def test_a_gap_is_held_and_healed_by_the_replay() -> None:
    index = KvIndex()
    assert index.apply("a", 0, batch(stored(1, 2))) is None
    # seq 1 was lost: seq 2 waits, and the index asks for a replay from 1 (once), keeping what it has.
    assert index.apply("a", 2, batch(stored(5), removed(1))) == ReplayNeeded("a", 1)
    assert index.apply("a", 3, batch(stored(6))) is None
    assert index.match("a", [1, 2]) == 2
    assert index.match("a", [5]) == 0
    # The replay: 1, then 2 and 3 again (already held, applied once).
    index.apply("a", 1, batch(stored(3, 4)), live=False)
    index.apply("a", 2, batch(stored(5), removed(1)), live=False)
    index.replay_done("a")
    assert index.match("a", [2, 3, 4, 5, 6]) == 5
    assert index.match("a", [1]) == 0  # removed by seq 2, applied after seq 1
    assert index.next_seq("a") == 4
    # Live batches the replay already delivered are duplicates, not a restart.
    index.apply("a", 4, batch(stored(7)))
    assert index.stats().gaps == 1 and index.stats().resets == 0


def test_a_gap_the_replay_cannot_cover_resets_the_backend() -> None:
    index = KvIndex()
    index.apply("a", 0, batch(stored(1, 2)))
    index.apply("b", 0, batch(stored(1, 2)))
    assert index.apply("a", 5, batch(stored(9))) == ReplayNeeded("a", 1)
    # vLLM's buffer starts at 4: seqs 1-3 are gone, and with them any removal of 1 or 2.
    index.apply("a", 4, batch(stored(8)), live=False)
    index.apply("a", 5, batch(stored(9)), live=False)
    index.replay_done("a")
    assert index.match("a", [1]) == 0
    assert index.match("a", [8, 9]) == 2 and index.held("a") == 2
    assert index.match("b", [1, 2]) == 2  # the other backend keeps its blocks
    assert index.stats().resets == 1


def test_a_replay_that_brings_nothing_resets_and_goes_on_from_the_held_batches() -> None:
    index = KvIndex()
    index.apply("a", 0, batch(stored(1)))
    assert index.apply("a", 3, batch(stored(3))) == ReplayNeeded("a", 1)
    index.apply("a", 4, batch(stored(4)))
    index.replay_done("a")  # e.g. timed out, or no replay socket
    assert index.held("a") == 2 and index.match("a", [1]) == 0
    assert index.next_seq("a") == 5
    assert index.apply("a", 5, batch(stored(5))) is None
    assert index.held("a") == 3


def test_a_late_joiner_asks_for_everything_from_seq_0() -> None:
    index = KvIndex()
    assert index.apply("a", 7, batch(stored(7))) == ReplayNeeded("a", 0)


def test_a_restarted_publisher_starts_the_backend_over() -> None:
    index = KvIndex()
    for seq in range(3):
        index.apply("a", seq, batch(stored(10 + seq)))
    assert index.held("a") == 3
    assert index.apply("a", 0, batch(stored(99))) is None  # a live seq going back: a new engine
    assert index.held("a") == 1 and index.match("a", [99]) == 1
    index.reset("a")  # what the router calls when discovery sees a new engine identity
    assert index.held("a") == 0 and index.next_seq("a") == 0


def test_all_blocks_cleared_and_forget_touch_one_backend() -> None:
    index = KvIndex()
    index.apply("a", 0, batch(stored(1, 2)))
    index.apply("b", 0, batch(stored(1, 2)))
    index.apply("a", 1, batch(AllBlocksCleared(), stored(3)))
    assert index.held("a") == 1 and index.match("a", [3]) == 1 and index.match("b", [1, 2]) == 2
    index.forget("b")
    assert index.hits_by_backend([1]) == {}
    assert index.next_seq("b") is None
    assert index.stats().distinct_hashes == 1


def test_removal_and_each_tier_under_its_own_key() -> None:
    index = KvIndex()
    index.apply("a", 0, batch(stored(1, 2, 3), stored(1, 2, 3, 4, medium="CPU"), removed(2), removed(77),
                              stored(5, medium="DISK")))  # fmt: skip
    assert index.match("a", [1, 3]) == 2
    assert index.match("a", [2]) == 0
    assert index.match("a", [4]) == 0  # an offloaded copy is not a GPU prefix hit: the CPU tier's
    assert index.match(CpuTier("a"), [1, 2, 3, 4]) == 4
    assert index.hits_by_backend([1, 2, 3, 4]) == {"a": 1, CpuTier("a"): 4}
    assert index.hits_by_backend([5]) == {}  # storage tiers are not indexed
    index.apply("a", 1, batch(BlockRemoved(block_hashes=[1], medium="CPU")))
    assert index.hits_by_backend([1, 3]) == {"a": 2}
    assert index.stats().backends == 1


def test_a_backend_that_starts_over_or_leaves_takes_its_cpu_tier_along() -> None:
    index = KvIndex()
    index.apply("a", 0, batch(stored(1, medium="CPU")))
    index.apply("a", 1, batch(AllBlocksCleared(), stored(2)))
    assert index.hits_by_backend([1]) == {} and index.match("a", [2]) == 1
    index.apply("a", 2, batch(stored(3, medium="CPU")))
    index.forget("a")
    assert index.hits_by_backend([3]) == {} and index.size == 0
    index.apply("b", 0, batch(stored(3, medium="CPU")))  # the freed ids are used again
    assert index.hits_by_backend([3]) == {CpuTier("b"): 1}


def test_int_and_bytes_event_hashes_match_the_same_request() -> None:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes the 32 bytes; the default, their low 64 bits.
    tokens = list(range(48))
    full = kv_blocks.block_hashes(tokens, 16, "0")
    index = KvIndex()
    index.apply("ints", 0, batch(stored(*(kv_blocks.external_hash(h) for h in full))))
    index.apply("bytes", 0, batch(stored(*(kv_blocks.external_hash(h, int_hashes=False) for h in full))))
    assert index.hits_by_backend(kv_blocks.iter_block_hash_keys(tokens, 16, "0")) == {"ints": 3, "bytes": 3}


def test_the_least_recently_stored_pair_goes_first() -> None:
    index = KvIndex(max_stored=4)
    index.apply("a", 0, batch(stored(1, 2, 3)))
    index.apply("b", 0, batch(stored(1)))
    index.apply("a", 1, batch(stored(1)))  # stored again: now the most recent of a's
    index.apply("b", 1, batch(stored(5, 6)))
    assert index.size == 4
    assert index.stats().evicted == 2
    # Out went a's 2 and 3 (least recently stored); a's 1 was refreshed, b's 1 came after a's 2 and 3.
    assert index.match("a", [1]) == 1 and index.match("a", [2]) == 0 and index.match("a", [3]) == 0
    assert index.match("b", [1, 5, 6]) == 3 and index.held("b") == 3


def test_memory_per_stored_hash() -> None:
    """Measures the index's bytes per (backend, hash) pair, prints it, and checks bytes_estimate tracks it."""
    n_backends, per_backend = 16, 20_000
    rng = random.Random(1)
    # Backends of one model share most of their prefixes: half the hashes are common to all.
    shared = [rng.getrandbits(64) for _ in range(per_backend // 2)]
    own = {b: [rng.getrandbits(64) for _ in range(per_backend // 2)] for b in range(n_backends)}
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = KvIndex(max_stored=10_000_000)
    for b in range(n_backends):
        index.apply(("pod-%d" % b, 0), 0, batch(stored(*shared, *own[b])))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_pair = used / index.size
    print(f"\nKvIndex: {index.size} stored pairs, {used / 2**20:.1f} MiB, {per_pair:.0f} B per stored hash "
          f"(bytes_estimate {index.bytes_estimate() / index.size:.0f} B)")
    assert index.size == n_backends * per_backend
    assert 0.5 < index.bytes_estimate() / used < 2


# --- the decoder, on bytes vLLM wrote -------------------------------------------------------------------------
RESULT = "kv-events-result: "
# Runs in a vLLM environment, one JSON command per stdin line, one RESULT line per command on stdout
# (vLLM logs to stdout too). It encodes sample batches with vLLM's own classes and msgspec encoder, and runs
# vLLM's own ZmqEventPublisher.
VLLM_SIDE = textwrap.dedent(
    """
    import json, sys, time
    import msgspec
    from vllm.distributed import kv_events as ke

    RESULT = "kv-events-result: "
    FIELDS = {f for f in ke.BlockStored.__struct_fields__}


    class BlockPinned(ke.KVCacheEvent):  # a tag the router does not know, as a newer vLLM's would be
        block_hashes: list[int]


    def stored(hashes, **extra):
        kw = dict(block_hashes=hashes, parent_block_hash=None, token_ids=[1, 2, 3], block_size=16,
                  lora_id=None, medium="GPU", lora_name=None)
        kw.update({k: v for k, v in extra.items() if k in FIELDS})
        return ke.BlockStored(**kw)


    def samples():
        full = stored([2**64 - 1, 5], parent_block_hash=2**63, extra_keys=[("lora-x", "salt"), None],
                      group_idx=1, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=4096,
                      locality="LOCAL", ownership="tier-2", session_id="s-1", lookahead_token_ids=[[7], [8]])
        known = [
            ke.KVEventBatch(ts=1.25, events=[stored([1, 2]), ke.BlockRemoved(block_hashes=[b"\\x01" * 32],
                            medium="GPU"), ke.AllBlocksCleared()], data_parallel_rank=3),
            ke.KVEventBatch(ts=2.5, events=[full]),
        ]
        unknown = ke.EventBatch(ts=3.0, events=[stored([11]), BlockPinned(block_hashes=[12]),
                                ke.BlockRemoved(block_hashes=[11], medium=None)])
        enc = msgspec.msgpack.Encoder()
        out = []
        for b, skipped in [(known[0], 0), (known[1], 0), (unknown, 1)]:
            events = [e for e in b.events if not isinstance(e, BlockPinned)]
            out.append({"payload": enc.encode(b).hex(), "ts": b.ts, "rank": b.data_parallel_rank,
                        "events": msgspec.to_builtins(events), "skipped": skipped})
        return out


    def engine_events(tokens, block_size, seed):
        # A real block pool's events: a request's full blocks cached, then two of them evicted.
        import os
        os.environ["PYTHONHASHSEED"] = seed
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils as kcu
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.request import Request

        fn = get_hash_fn_by_name("sha256_cbor")
        kcu.init_none_hash(fn)
        req = Request("r", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=kcu.get_request_block_hasher(block_size, fn))
        n = len(req.block_hashes)
        pool = BlockPool(num_gpu_blocks=n + 1, enable_caching=True, hash_block_size=block_size,
                         enable_kv_cache_events=True)
        blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(req, blocks, 0, n, block_size, 0)
        enc = msgspec.msgpack.Encoder()
        stored = enc.encode(ke.KVEventBatch(ts=4.0, events=pool.take_events()))
        # The request ends (vLLM frees a request's blocks tail first, so its tail is evicted first) and
        # the next one needs two blocks: the pool evicts two cached ones.
        pool.free_blocks(reversed(blocks))
        pool.get_new_blocks(2)
        removed = enc.encode(ke.KVEventBatch(ts=5.0, events=pool.take_events()))
        return {"full_blocks": n, "stored": stored.hex(), "removed": removed.hex()}


    publishers = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "samples":
            answer = samples()
        elif op == "engine_events":
            answer = engine_events(cmd["tokens"], cmd["block_size"], cmd["seed"])
        elif op == "publisher":
            publishers[cmd["name"]] = ke.ZmqEventPublisher(
                data_parallel_rank=0, endpoint=f"tcp://*:{cmd['port']}",
                replay_endpoint=f"tcp://*:{cmd['replay_port']}", buffer_steps=cmd["buffer_steps"],
                topic=cmd.get("topic", ""))
            answer = "ok"
        elif op == "publish":
            pub = publishers[cmd["name"]]
            for hashes in cmd["batches"]:
                pub.publish(ke.KVEventBatch(ts=time.time(), events=[stored(hashes)]))
            pub._event_queue.join()  # every batch sent on the PUB socket (and in the replay buffer)
            answer = "ok"
        elif op == "quit":
            for pub in publishers.values():
                pub.shutdown()
            break
        print(RESULT + json.dumps(answer), flush=True)
    """
)


class VllmSide:
    """One process of a vLLM environment running VLLM_SIDE: importing vLLM is the slow part, done once."""

    def __init__(self, version: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env["VLLM_TARGET_DEVICE"] = "cpu"
        self.version = version
        self.stderr = tempfile.TemporaryFile()  # not a pipe: nobody reads it until something fails
        self.proc = subprocess.Popen(
            [vllm_python(version), "-c", VLLM_SIDE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr, text=True, env=env,
        )

    def call(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:  # blocks until vLLM answers (its import takes a while, once)
            if line.startswith(RESULT):
                return json.loads(line.removeprefix(RESULT))
        self.stderr.seek(0)
        raise AssertionError(f"vLLM {self.version} side exited:\n{self.stderr.read()[-4000:].decode()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


@pytest.fixture(scope="module")
def vllm_0_33() -> Iterator[VllmSide]:
    side = VllmSide("0.33.0")
    try:
        yield side
    finally:
        side.close()


@pytest.fixture(scope="module")
def vllm_0_26() -> Iterator[VllmSide]:
    side = VllmSide("0.26.0")
    try:
        yield side
    finally:
        side.close()


def _check_decodes(side: VllmSide) -> None:
    decoder = KvEventDecoder()
    samples = side.call(op="samples")
    assert len(samples) == 3
    for sample in samples:
        decoded = decoder.decode(bytes.fromhex(sample["payload"]))
        assert decoded.ts == sample["ts"]
        assert decoded.data_parallel_rank == sample["rank"]
        assert decoded.skipped == sample["skipped"]
        assert json.loads(json.dumps(msgspec.to_builtins(decoded.events))) == sample["events"]  # tuples as lists
    assert decoder.skipped_by_tag == {"BlockPinned": 1}
    # And the index reads them: the removal of the bytes hash, the clear, the unknown event skipped.
    index = KvIndex()
    for seq, sample in enumerate(samples):
        index.apply("a", seq, decoder.decode(bytes.fromhex(sample["payload"])))
    assert index.match("a", [2**64 - 1, 5]) == 2 and index.held("a") == 2
    assert index.stats().skipped_events == 1


def _check_engine_events(side: VllmSide) -> None:
    """A real block pool's events, decoded and indexed, match the prompt as contract/kv_blocks hashes it."""
    tokens = random.Random(4).choices(range(150_000), k=16 * 5 + 3)
    answer = side.call(op="engine_events", tokens=tokens, block_size=16, seed="42")
    assert answer["full_blocks"] == 5
    decoder = KvEventDecoder()
    index = KvIndex()
    index.apply("p0", 0, decoder.decode(bytes.fromhex(answer["stored"])))
    assert index.hits_by_backend(kv_blocks.iter_block_hash_keys(tokens, 16, "42")) == {"p0": 5}
    assert index.match("p0", kv_blocks.block_hash_keys(tokens, 16, "0")) == 0  # another seed, other hashes
    removal = decoder.decode(bytes.fromhex(answer["removed"]))
    assert [type(e).__name__ for e in removal.events] == ["BlockRemoved", "BlockRemoved"]
    index.apply("p0", 1, removal)
    assert index.match("p0", kv_blocks.block_hash_keys(tokens, 16, "42")) == 3  # its last two blocks evicted


@pytest.mark.vllm
def test_decodes_what_vllm_0_33_encodes(vllm_0_33: VllmSide) -> None:
    _check_decodes(vllm_0_33)
    _check_engine_events(vllm_0_33)


@pytest.mark.vllm
def test_decodes_what_vllm_0_26_encodes(vllm_0_26: VllmSide) -> None:
    _check_decodes(vllm_0_26)
    _check_engine_events(vllm_0_26)


def test_a_batch_that_is_not_one_is_an_error_the_subscriber_counts() -> None:
    with pytest.raises(msgspec.DecodeError):
        KvEventDecoder().decode(b"\x93not msgpack")


# --- the subscriber -------------------------------------------------------------------------------------------
async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` while the loop runs the subscriber; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def publish_until_held(
    publish: Callable[[list[int]], Any], index: KvIndex, key: str, first_probe: int, timeout_s: float = 30
) -> int:
    """Publish probe batches until one reaches the index (a SUB socket drops what is published before it
    has connected, ZMQ's slow joiner); returns the probe that did."""
    deadline = time.monotonic() + timeout_s
    probe = first_probe
    while True:
        await publish([probe])
        try:
            await wait_until(lambda: index.match(key, [probe]) == 1, 0.5, f"probe {probe}")
            return probe
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            probe += 1


@pytest.mark.vllm
def test_follows_vllms_publisher_and_catches_up_on_what_it_published_before(vllm_0_33: VllmSide) -> None:
    port = free_port_block(2)
    vllm_0_33.call(op="publisher", name="long", port=port, replay_port=port + 1, buffer_steps=1000)
    before = [[1000 + i, 2000 + i] for i in range(5)]  # seqs 0-4, published before anyone subscribed
    vllm_0_33.call(op="publish", name="long", batches=before)

    async def main() -> None:
        index = KvIndex()
        sub = KvEventSubscriber(index)
        sub.add("p0", f"tcp://{HOST}:{port}", f"tcp://{HOST}:{port + 1}")
        sub.start()
        try:
            await wait_until(lambda: sub.caught_up("p0"), 30, "the first replay")
            # Seqs 0-4 came with the replay the subscriber asks for as it connects: no live batch, no gap needed.
            assert all(index.match("p0", [h]) == 1 for b in before for h in b)
            assert index.stats().gaps == 0 and index.stats().resets == 0 and sub.replays == 1
            await publish_until_held(
                lambda hashes: asyncio.to_thread(vllm_0_33.call, op="publish", name="long", batches=[hashes]),
                index, "p0", first_probe=10_000,
            )  # then live batches
            assert index.stats().resets == 0
        finally:
            await sub.stop()

    asyncio.run(main())


@pytest.mark.vllm
def test_a_replay_buffer_too_short_resets_the_backend(vllm_0_33: VllmSide) -> None:
    port = free_port_block(2)
    vllm_0_33.call(op="publisher", name="short", port=port, replay_port=port + 1, buffer_steps=2)
    vllm_0_33.call(op="publish", name="short", batches=[[3000 + i] for i in range(6)])  # seqs 0-5

    async def main() -> None:
        index = KvIndex()
        sub = KvEventSubscriber(index)
        sub.add("p0", f"tcp://{HOST}:{port}", f"tcp://{HOST}:{port + 1}")
        sub.start()
        try:
            await wait_until(lambda: sub.caught_up("p0"), 30, "the first replay")
            assert sub.replays == 1
            assert not any(index.match("p0", [3000 + i]) for i in range(4))  # gone from vLLM's buffer
            assert index.match("p0", [3004, 3005]) == 2  # what the buffer still had
            assert index.stats().resets == 1  # from seq 0 it could not cover: start over from what it has
            probe = await publish_until_held(
                lambda hashes: asyncio.to_thread(vllm_0_33.call, op="publish", name="short", batches=[hashes]),
                index, "p0", first_probe=20_000,
            )
            assert index.match("p0", [3004, 3005, probe]) == 3
        finally:
            await sub.stop()

    asyncio.run(main())


class WirePublisher:
    """vLLM's ZmqEventPublisher's wire format, written here so a test can drop a batch from the live stream
    (but not from the replay buffer): PUB ``(topic, seq, payload)``; ROUTER replay from a seq, then the end
    marker."""

    def __init__(self, ctx: zmq.asyncio.Context, port: int, replay: bool = True) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://{HOST}:{port}")
        self.router = ctx.socket(zmq.ROUTER) if replay else None
        if self.router is not None:
            self.router.bind(f"tcp://{HOST}:{port + 1}")
        self.buffer: list[tuple[int, bytes]] = []
        self.encoder = msgspec.msgpack.Encoder()
        self.replays_served = 0
        self.task = asyncio.get_running_loop().create_task(self._serve_replay()) if replay else None

    async def publish(self, hashes: list[int], live: bool = True) -> None:
        seq = len(self.buffer)
        payload = self.encoder.encode(KVEventBatch(ts=time.time(), events=[stored(*hashes)]))
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays_served += 1
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            await self.router.send_multipart((client, b"", b"", REPLAY_END_SEQ, b""))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await self.task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


def test_a_gap_mid_stream_is_healed_by_replay() -> None:
    port = free_port_block(2)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        wire = WirePublisher(ctx, port)
        index = KvIndex()
        sub = KvEventSubscriber(index)
        sub.add("p0", f"tcp://{HOST}:{port}", f"tcp://{HOST}:{port + 1}")
        sub.start()
        try:
            await publish_until_held(wire.publish, index, "p0", first_probe=1)
            replays_at_join = sub.replays
            await wire.publish([501, 502], live=False)  # lost on the way: only the replay has it
            await wire.publish([503])
            await wait_until(lambda: index.match("p0", [501, 502, 503]) == 3, 10, "the gap healed")
            assert sub.replays == replays_at_join + 1 == wire.replays_served
            assert index.stats().resets == 0
            # And the stream goes on in order.
            await wire.publish([504])
            await wait_until(lambda: index.match("p0", [504]) == 1, 10, "the next live batch")
            sub.remove("p0")
            assert index.held("p0") == 0 and index.hits_by_backend([501]) == {}
        finally:
            await sub.stop()
            await wire.close()
            ctx.term()

    asyncio.run(main())


def test_without_replay_a_gap_resets_and_an_unreachable_publisher_is_just_absent() -> None:
    port = free_port_block(4)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        wire = WirePublisher(ctx, port, replay=False)
        index = KvIndex()
        sub = KvEventSubscriber(index, replay_timeout_s=0.2)
        sub.add("p0", f"tcp://{HOST}:{port}", None)
        sub.add("gone", f"tcp://{HOST}:{port + 2}", f"tcp://{HOST}:{port + 3}")  # nothing listens there
        sub.start()
        try:
            first = await publish_until_held(wire.publish, index, "p0", first_probe=1)
            await wire.publish([601], live=False)
            await wire.publish([602])
            await wait_until(lambda: index.match("p0", [602]) == 1, 10, "the batch after the gap")
            assert index.match("p0", [first]) == 0  # reset: what was before the gap is unknown now
            assert index.match("p0", [601]) == 0
            assert index.match("gone", [first]) == 0 and index.hits_by_backend([602]) == {"p0": 1}
        finally:
            await sub.stop()
            await wire.close()
            ctx.term()

    asyncio.run(main())
