"""The simulator's prefix cache (bench/disagg_bench/vllm_sim/prefix_cache.py) keeps vLLM's rules: full blocks only, the
longest cached prefix but never the last token, least recently freed blocks evicted first and a sequence's
tail before its head, held blocks never evicted, capacity shared by held and cached blocks. Its KV events
decode with vLLM's own classes (0.26.0 and 0.33.0), and its tokens make a conversation's next turn extend
the previous one."""

from __future__ import annotations

import json
import os
import subprocess

import msgspec
import pytest

from disagg_connector.contract import kv_blocks
from tests.fixtures.vllm_cli import CHECKED_VERSIONS, vllm_python
from disagg_bench.vllm_sim import prefix_cache as pc

BS = 4


def toks(*values: int) -> list[int]:
    return list(values)


def cache(num_blocks: int = 16, enabled: bool = True) -> pc.PrefixCache:
    return pc.PrefixCache(num_blocks, BS, enabled)


def hashes(tokens: list[int]) -> list[bytes]:
    """What vLLM names these blocks: its default hash (sha256), this process's NONE_HASH seed."""
    return kv_blocks.block_hashes(tokens, BS, os.environ.get("PYTHONHASHSEED", kv_blocks.DEFAULT_NONE_HASH_SEED), "sha256")


def stored_runs(events: list[pc.CacheEvent]) -> list[list[int]]:
    return [e.token_ids for e in events if isinstance(e, pc.Stored)]


def removed(events: list[pc.CacheEvent]) -> list[bytes]:
    return [h for e in events if isinstance(e, pc.Removed) for h in e.block_hashes]


# --- hits -------------------------------------------------------------------------------------------------
def test_a_shared_prefix_hits_its_full_blocks_only() -> None:
    c = cache()
    first = c.allocate("a", range(10))  # blocks [0-3] [4-7], partial [8 9]
    assert first.hit_tokens == 0
    c.commit(first)
    c.free(first)
    second = c.allocate("b", [*range(6), 99, 98, 97, 96, 95])  # shares block 0 only (block 1 differs at token 6)
    assert second.hit_tokens == BS
    assert (c.stats.queries, c.stats.hits) == (10 + 11, BS)


def test_the_last_token_is_always_recomputed() -> None:
    c = cache()
    a = c.allocate("a", range(8))  # exactly two blocks
    c.commit(a)
    c.free(a)
    again = c.allocate("b", range(8))
    assert again.hit_tokens == BS  # not 8: vLLM looks up at most num_tokens - 1 tokens
    longer = c.allocate("c", range(9))
    assert longer.hit_tokens == 2 * BS


def test_nothing_hits_before_the_prompt_is_computed_or_when_caching_is_off() -> None:
    c = cache()
    c.allocate("a", range(8))  # scheduled, not committed
    assert c.allocate("b", range(9)).hit_tokens == 0
    off = cache(enabled=False)
    a = off.allocate("a", range(9))
    off.commit(a)
    off.free(a)
    assert off.allocate("b", range(9)).hit_tokens == 0
    assert (off.stats.queries, off.stats.hits, off.take_events()) == (0, 0, [])
    assert off.in_use == 3  # usage is still counted


def test_stored_events_chain_parent_hashes_and_carry_the_block_tokens() -> None:
    c = cache()
    a = c.allocate("a", range(6))
    c.commit(a)
    [first] = c.take_events()
    assert first == pc.Stored(hashes(list(range(4))), None, [0, 1, 2, 3], BS)
    # the request generates 3 tokens: blocks filled by generated tokens are cached at the end, parent = block 0
    c.grow(a, 9)
    c.commit(a, [6, 7, 8])
    [second] = c.take_events()
    assert second.parent_block_hash == first.block_hashes[0]
    assert second.token_ids == [4, 5, 6, 7]
    assert second.block_hashes == hashes(list(range(9)))[1:]


def test_the_hash_algorithm_is_vllms_flag() -> None:
    c = pc.PrefixCache(16, BS, hash_algo="sha256_cbor")
    a = c.allocate("a", range(5))
    c.commit(a)
    [stored] = c.take_events()
    seed = os.environ.get("PYTHONHASHSEED", kv_blocks.DEFAULT_NONE_HASH_SEED)
    assert stored.block_hashes == kv_blocks.block_hashes(list(range(4)), BS, seed, "sha256_cbor") != hashes(list(range(4)))


def test_content_cached_meanwhile_by_another_request_is_not_stored_twice() -> None:
    c = cache()
    a, b = c.allocate("a", range(9)), c.allocate("b", range(9))  # concurrent, same prompt: neither hits
    c.commit(a)
    c.commit(b)
    assert stored_runs(c.take_events()) == [list(range(8))]
    assert c.cached_blocks == 2
    c.free(a)
    c.free(b)
    assert c.in_use == 0


# --- capacity and eviction ------------------------------------------------------------------------------------
def test_capacity_is_shared_and_the_least_recently_freed_go_first_tail_before_head() -> None:
    c = cache(num_blocks=4)
    a = c.allocate("a", [1] * 8)  # 2 blocks
    c.commit(a)
    b = c.allocate("b", [2] * 8)
    c.commit(b)
    c.take_events()
    c.free(a)  # a first: a's blocks are the least recently freed
    c.free(b)
    assert (c.in_use, c.cached_blocks, c.usage) == (0, 4, 0.0)  # cached blocks nobody holds count as free
    a_hashes = hashes([1] * 8)
    b_hashes = hashes([2] * 8)
    n = c.allocate("n", [3] * 5)  # 2 new blocks: the pool of 4 is full of cached blocks, 2 must go
    assert removed(c.take_events()) == [a_hashes[1], a_hashes[0]]  # a's tail, then its head
    assert (c.in_use, c.cached_blocks, c.usage) == (2, 2, 0.5)
    c.allocate("m", [4] * 4)  # one more block: b's tail goes
    assert removed(c.take_events()) == [b_hashes[1]]
    assert c.allocate("b2", [2] * 8 + [0]).hit_tokens == BS  # b's head is still cached
    c.free(n)


def test_a_hit_refreshes_a_block_so_it_is_evicted_last() -> None:
    c = cache(num_blocks=3)
    for rid, t in (("a", 1), ("b", 2), ("c", 3)):
        x = c.allocate(rid, [t] * 4)
        c.commit(x)
        c.free(x)
    c.take_events()
    again = c.allocate("a2", [1] * 4 + [0])  # a's block hit: held, then freed after b and c
    assert again.hit_tokens == BS
    c.free(again)
    c.allocate("d", [4] * 8)  # 2 blocks: b's and c's go, a's stays
    gone = removed(c.take_events())
    assert gone == [hashes([t] * 4)[0] for t in (2, 3)]


def test_held_blocks_are_never_evicted_even_past_capacity() -> None:
    c = cache(num_blocks=2)
    held = c.allocate("held", [5] * 8)
    c.commit(held)
    c.take_events()
    c.allocate("big", [6] * 12)  # 3 blocks more than fit: nothing evictable, none evicted
    assert removed(c.take_events()) == []
    assert (c.in_use, c.usage) == (5, 1.0)
    assert c.allocate("again", [5] * 9).hit_tokens == 2 * BS


def test_generated_tokens_take_blocks_as_they_fill_one() -> None:
    c = cache(num_blocks=8)
    a = c.allocate("a", range(5))
    assert c.in_use == 2
    c.grow(a, 8)
    assert c.in_use == 2
    c.grow(a, 9)
    assert c.in_use == 3
    c.free(a)
    c.free(a)  # freeing twice is harmless (every path that ends a request frees)
    assert c.in_use == 0


def test_reset_is_refused_while_blocks_are_held_then_clears_everything() -> None:
    c = cache()
    a = c.allocate("a", range(9))
    c.commit(a)
    c.take_events()
    assert c.reset() is False
    c.free(a)
    assert c.reset() is True
    assert c.take_events() == [pc.Cleared()]
    assert (c.cached_blocks, c.allocate("b", range(9)).hit_tokens) == (0, 0)


# --- tokens ---------------------------------------------------------------------------------------------------
def test_a_cpu_tier_keeps_what_the_gpu_evicted_and_gives_it_back_instead_of_compute() -> None:
    c = pc.PrefixCache(2, BS, cpu_blocks=3)
    a = c.allocate("a", [1] * 8 + [0])  # 2 full blocks + 1 token
    c.commit(a)
    c.free(a)
    stored = [e for e in c.take_events() if isinstance(e, pc.Stored)]
    assert [(e.medium, e.block_hashes) for e in stored] == [("CPU", hashes([1] * 8)), ("GPU", hashes([1] * 8))]
    assert (stored[0].token_ids, stored[0].block_size, stored[0].parent_block_hash) == ([], 0, None)  # a placeholder
    b = c.allocate("b", [2] * 8 + [0])  # the GPU pool of 2 evicts a's blocks; the CPU tier keeps them
    c.commit(b)
    c.free(b)
    events = c.take_events()
    assert [(e.medium, e.block_hashes) for e in events if isinstance(e, pc.Removed)] == [
        ("GPU", [hashes([1] * 8)[1]]), ("GPU", [hashes([1] * 8)[0]]), ("CPU", [hashes([1] * 8)[0]])]  # 4 > 3: a's head
    again = c.allocate("a2", [1] * 8 + [0])
    assert (again.hit_tokens, again.restored_tokens) == (0, 0)  # the head went from both tiers: nothing leads
    c.free(again)
    d = pc.PrefixCache(4, BS, cpu_blocks=8)
    first = d.allocate("x", list(range(12)) + [0])
    d.commit(first)
    d.free(first)
    d.allocate("y", [9] * 16)  # four new blocks: every cached block of x leaves the GPU
    turn = d.allocate("x2", list(range(12)) + [0, 5])
    assert (turn.hit_tokens, turn.restored_tokens) == (0, 12)  # three blocks copied back, not computed
    assert (d.stats.external_queries, d.stats.external_hits) == (13 + 16 + 14, 12)


def test_without_a_cpu_tier_nothing_is_restored_and_a_decodes_remote_kv_is_the_connectors_hit() -> None:
    c = cache(num_blocks=8)
    a = c.allocate("a", [1] * 8 + [0])
    c.commit(a)
    c.free(a)
    assert {e.medium for e in c.take_events()} == {"GPU"} and a.restored_tokens == 0
    assert (c.stats.external_queries, c.stats.external_hits) == (9, 0)  # the connector is asked, finds nothing
    d = c.allocate("d", [1] * 8 + [0, 2], remote_kv=True)  # a decode: its 2 cached blocks, the rest over NIXL
    assert (d.hit_tokens, c.stats.external_queries - 9, c.stats.external_hits) == (8, 2, 2)  # as on the H200: hits + external = queries


def test_text_is_one_token_per_word_and_token_ids_are_used_as_given() -> None:
    assert len(pc.completion_token_ids("a b  c\nd")) == 4
    assert pc.completion_token_ids([7, 8, 9]) == [7, 8, 9]
    assert pc.completion_token_ids("same words") == pc.completion_token_ids("same words")
    assert pc.completion_token_ids("x y")[0] != pc.completion_token_ids("y x")[0]
    assert len(pc.chat_token_ids([{"role": "user", "content": "one two three"}])) == 3 + 4  # as the sim counted


def test_a_conversations_next_turn_extends_the_previous_turn_and_its_answer() -> None:
    turn1 = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hello there"}]
    answer = " ".join(f"tok{i}" for i in range(5))  # what the simulator writes
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "more please"}]
    prompt1, prompt2 = pc.chat_token_ids(turn1), pc.chat_token_ids(turn2)
    generated = [pc.generated_token_id(i) for i in range(5)]
    assert prompt2[: len(prompt1) + 5] == prompt1 + generated


# --- wire format, decoded by vLLM itself --------------------------------------------------------------------
VLLM_DECODER = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
def plain(k, v):
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list) and k.endswith("hashes"):
        return [x.hex() if isinstance(x, bytes) else x for x in v]
    return v
batches = []
for payload in json.load(sys.stdin):
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(bytes.fromhex(payload))
    events = [{"type": type(e).__name__, **{f: plain(f, getattr(e, f)) for f in e.__struct_fields__}} for e in batch.events]
    batches.append({"ts": batch.ts, "rank": batch.data_parallel_rank, "events": events})
fields = {c.__name__: list(c.__struct_fields__) for c in (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared)}
print("DECODED " + json.dumps({"batches": batches, "fields": fields}))
"""


def _sample_batches() -> list[list[pc.CacheEvent]]:
    """A store, two evictions, a reset: every kind of event the simulator publishes."""
    c = pc.PrefixCache(2, BS)
    a = c.allocate("a", range(9))
    c.commit(a)
    batches = [c.take_events()]
    c.free(a)
    b = c.allocate("b", [7] * 8)  # needs both blocks: a's two cached blocks are evicted
    batches.append(c.take_events())
    c.free(b)
    assert c.reset()
    batches.append(c.take_events())
    return batches


def _decoded_by_vllm(version: str, payloads: list[bytes]) -> dict:
    proc = subprocess.run(
        [vllm_python(version), "-c", VLLM_DECODER], input=json.dumps([p.hex() for p in payloads]),
        capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("DECODED ")]
    return json.loads(line.removeprefix("DECODED "))


@pytest.fixture(scope="module", params=CHECKED_VERSIONS)
def vllm_decoded(request: pytest.FixtureRequest) -> tuple[str, list[list[pc.CacheEvent]], dict]:
    """One vLLM process per release decodes the sample batches with int hashes (vLLM's default), then bytes."""
    batches = _sample_batches()
    payloads = [pc.encode_batch(pc.wire_batch(events, 3, 1700000000.5, ints)) for ints in (True, False) for events in batches]
    return request.param, batches, _decoded_by_vllm(request.param, payloads)


@pytest.mark.vllm
@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
def test_vllm_decodes_the_simulators_event_batches(vllm_decoded: tuple[str, list[list[pc.CacheEvent]], dict], int_hashes: bool) -> None:
    version, batches, answer = vllm_decoded
    decoded = answer["batches"][:3] if int_hashes else answer["batches"][3:]
    assert [(b["ts"], b["rank"]) for b in decoded] == [(1700000000.5, 3)] * 3
    [[stored], evicted, [cleared]] = [b["events"] for b in decoded]
    [[ours_stored], ours_removed, _] = batches
    assert isinstance(ours_stored, pc.Stored)

    def on_wire(h: bytes) -> int | str:
        return kv_blocks.external_hash(h, True) if int_hashes else h.hex()  # type: ignore[return-value]

    assert stored["type"] == "BlockStored"
    assert stored["block_hashes"] == [on_wire(h) for h in ours_stored.block_hashes]
    assert (stored["parent_block_hash"], stored["token_ids"], stored["block_size"]) == (None, list(range(8)), BS)
    assert (stored["lora_id"], stored["medium"], stored["lora_name"]) == (None, "GPU", None)
    assert (stored["extra_keys"], stored["group_idx"], stored["kv_cache_spec_kind"]) == ([None, None], 0, "full_attention")
    assert [e["type"] for e in evicted] == ["BlockRemoved", "BlockRemoved"]
    assert [e["block_hashes"] for e in evicted] == [[on_wire(h)] for e in ours_removed for h in e.block_hashes]  # type: ignore[union-attr]
    assert all(e["medium"] == "GPU" and e["group_idx"] == 0 for e in evicted)
    assert cleared["type"] == "AllBlocksCleared"
    # Our structs are 0.33.0's, field for field and in order (the order is the wire format); 0.26.0's are a
    # prefix of them (it lacks the trailing ownership, session_id, lookahead_token_ids, which we leave at
    # their defaults, so they are never on the wire).
    for name, theirs in answer["fields"].items():
        ours = list(getattr(pc, name).__struct_fields__)
        if version >= "0.33.0":
            assert ours == theirs, name
        else:
            assert ours[: len(theirs)] == theirs, name
