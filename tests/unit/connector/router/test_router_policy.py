"""The router's policies (docs/router.md, Policies): the load read from vLLM's /metrics, the approximate prefix
index, and the picks they make; pure, with a fake clock. vLLM's own /metrics text is test_drain's fixture."""

from __future__ import annotations

from typing import Any

import pytest

from disagg_connector.contract import EngineIdentity
from disagg_connector.router.discovery import Backend
from disagg_connector.router.load import LoadBoard, parse_engine_metrics
from disagg_connector.router.pairing import Balancer
from disagg_connector.contract import kv_blocks
from disagg_connector.router.kv_events import BlockStored, DecodedBatch, KvIndex
from disagg_connector.router.policy import CPU_HIT_WORTH, Policies
from disagg_connector.router.prefix import CHUNK_BYTES, CHUNK_TOKENS, PrefixIndex, PromptKey, chunk_keys, prompt_key
from tests.fixtures.releases import RELEASES, with_values

RUNNING, WAITING, QUERIES = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prefix_cache_queries_total"
BY_REASON = "vllm:num_requests_waiting_by_reason"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def backend(pod: str, role: str = "prefill", dp_rank: int = 0, dp_size: int = 1) -> Backend:
    ident = EngineIdentity(f"{pod}.uid", "10.0.0.1", 5600 + dp_rank, 1, 1, dp_rank=dp_rank, dp_size=dp_size)
    return Backend(role, "r1", pod, "uid", "10.0.0.1", ident, dp_size=dp_size)


def text_prompt(words: int, start: int = 0) -> dict[str, Any]:
    return {"prompt": " ".join(f"w{i}" for i in range(start, start + words))}


def key(body: dict[str, Any], kind: str = "completions") -> PromptKey:
    from disagg_connector.contract.vllm_pd import estimate_prompt_tokens

    return prompt_key(kind, body, estimate_prompt_tokens(kind, body))


# --- reading vLLM's /metrics ------------------------------------------------------------------------------
@pytest.mark.parametrize("release", RELEASES)
def test_the_counters_of_each_engine_core_come_from_vllms_own_metrics_text(release: str) -> None:
    text = with_values(RELEASES[release], {(RUNNING, "0"): 3.0, (WAITING, "1"): 5.0, (QUERIES, "1"): 640.0})
    engines = parse_engine_metrics(text)
    assert set(engines) == {"0", "1"}
    assert (engines["0"].running, engines["0"].waiting, engines["1"].running, engines["1"].waiting) == (3.0, 0.0, 0.0, 5.0)
    assert engines["1"].prefix_queries == 640.0 and engines["0"].prefix_queries == 0.0
    assert engines["0"].cache_tokens is None  # this fixture keeps no cache_config_info


@pytest.mark.parametrize("release", RELEASES)
def test_requests_waiting_on_their_kv_are_load_but_not_a_queue_for_room(release: str) -> None:
    """vLLM's num_requests_waiting counts WAITING_FOR_REMOTE_KVS (reason "deferred"): a decode asked with its
    prefill waits so until the KV lands. It is load (it runs there next) but not a shortage of room, which is
    what the autoscaler reads as waiting."""
    text = with_values(RELEASES[release], {(WAITING, "0"): 5.0, (BY_REASON, "0", 'reason="capacity"'): 2.0,
                                           (BY_REASON, "0", 'reason="deferred"'): 3.0, (RUNNING, "1"): 1.0})  # fmt: skip
    engines = parse_engine_metrics(text)
    assert (engines["0"].waiting, engines["0"].queued, engines["1"].queued) == (5.0, 2.0, 0.0)
    board = LoadBoard(1.0, Clock())
    pod = backend("d", role="decode")
    board.record(pod, engines, inflight_before=0)
    reading = board.fresh(pod.key)
    assert reading is not None and reading.counters.queued == 2.0
    assert board.load(pod.key, inflight=0) == 6.0


def test_an_engine_that_does_not_split_waiting_by_reason_is_read_as_all_queued() -> None:
    text = 'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
    assert parse_engine_metrics(text)["0"].queued == 4.0


def test_the_kv_cache_size_comes_from_cache_config_info() -> None:
    text = (
        '# TYPE vllm:cache_config_info gauge\n'
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="4096"} 1.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
    )
    assert parse_engine_metrics(text)["0"].cache_tokens == 16 * 4096


def test_a_prefill_rank_reads_its_own_core_and_a_decode_pod_sums_its_cores() -> None:
    board = LoadBoard(1.0, Clock())
    engines = parse_engine_metrics(with_values(RELEASES["0.33.0"], {(RUNNING, "0"): 1.0, (RUNNING, "1"): 4.0, (WAITING, "1"): 2.0}))
    rank1, decode = backend("p", dp_rank=1, dp_size=2), backend("d", role="decode")
    board.record(rank1, engines, inflight_before=0)
    board.record(decode, engines, inflight_before=0)
    assert board.load(rank1.key, inflight=0) == 6.0
    assert board.load(decode.key, inflight=0) == 7.0


def test_load_is_the_others_requests_at_the_last_read_plus_this_routers_in_flight_now_and_in_flight_alone_once_stale() -> None:
    clock = Clock()
    board = LoadBoard(1.0, clock)
    b = backend("p")
    assert board.load(b.key, inflight=2) == 2.0  # never read: this router's own count
    engines = parse_engine_metrics(with_values(RELEASES["0.33.0"], {(RUNNING, "0"): 3.0, (WAITING, "0"): 1.0}))
    board.record(b, engines, inflight_before=1)  # one of the engine's four requests was this router's
    assert board.load(b.key, inflight=1) == 4.0  # the others' three, and this router's one
    assert board.load(b.key, inflight=3) == 6.0  # plus two this router sent since the read
    assert board.load(b.key, inflight=0) == 3.0  # this router's finished: the others' remain
    clock.now += 3.5  # more than three intervals: the read no longer says what the engine does
    assert board.load(b.key, inflight=9) == 9.0


def test_a_read_taken_during_a_burst_that_ended_does_not_make_the_engine_look_busy() -> None:
    # On the H200 (bench/results/h200-issue30-migration.md) 16 streams had just ended on one decode when 16 new ones
    # came: counted from the read taken while the first 16 ran, every new one went to the other decode.
    policies, board, balancer, _ = make()
    busy, idle = backend("d0", role="decode"), backend("d1", role="decode")
    read(board, busy, running=16, inflight_before=16)  # all of them this router's
    read(board, idle)
    picks = []
    for _ in range(16):
        picks.append(policies.decode([busy, idle]).backend.key)
        balancer.acquire(next(b for b in (busy, idle) if b.key == picks[-1]))
    assert picks.count(busy.key) == picks.count(idle.key) == 8, picks


def test_a_counter_that_went_back_is_a_restart_and_forgets_the_backends_prefix() -> None:
    board = LoadBoard(1.0, Clock())
    forgotten: list[str] = []
    board.on_restart = forgotten.append
    b = backend("p")
    board.record(b, parse_engine_metrics(with_values(RELEASES["0.33.0"], {(QUERIES, "0"): 5000.0})), 0)
    board.record(b, parse_engine_metrics(with_values(RELEASES["0.33.0"], {(QUERIES, "0"): 6000.0})), 0)
    assert forgotten == []
    board.record(b, parse_engine_metrics(with_values(RELEASES["0.33.0"], {(QUERIES, "0"): 16.0})), 0)
    assert forgotten == [b.key] and board.restarts[b.key] == 1


# --- the prefix index -------------------------------------------------------------------------------------
def test_chunk_keys_are_chained_so_equal_keys_mean_equal_prefixes() -> None:
    a = chunk_keys(b"x" * CHUNK_BYTES + b"A" * CHUNK_BYTES)
    b = chunk_keys(b"y" * CHUNK_BYTES + b"A" * CHUNK_BYTES)
    assert len(a) == 2 and a[1] != b[1]  # the same second chunk after a different first one
    assert chunk_keys(b"x" * (CHUNK_BYTES * 2 - 1)) == a[:1]  # only whole chunks
    assert len(chunk_keys(list(range(CHUNK_TOKENS * 2 + 5)))) == 2  # token ids: CHUNK_TOKENS per chunk


def test_a_conversations_next_turn_shares_the_previous_turns_chunks() -> None:
    history = [{"role": "system", "content": "s " * 2000}, {"role": "user", "content": "hello " * 500}]
    turn1 = key({"messages": history}, "chat")
    turn2 = key({"messages": [*history, {"role": "assistant", "content": "hi " * 400}, {"role": "user", "content": "more"}]}, "chat")
    shared = len(turn1.chunks)
    assert shared > 10 and turn2.chunks[: shared - 1] == turn1.chunks[: shared - 1]
    parts = key({"messages": [{"role": "system", "content": [{"type": "text", "text": "s " * 2000}]}]}, "chat")
    assert parts.chunks[:5] == turn1.chunks[:5]  # content parts: their text, as vLLM's template renders it


def test_a_match_counts_leading_chunks_only_and_the_lru_bound_evicts_the_oldest() -> None:
    index = PrefixIndex()
    index.set_capacity("p0", CHUNK_TOKENS * 10)  # ten chunks
    first, second = tuple(range(1, 7)), tuple(range(101, 107))
    index.insert("p0", first)
    index.insert("p1", first[:3])
    assert index.match(first, ["p0", "p1", "p2"]) == {"p0": 6, "p1": 3}
    assert index.match((999, *first), ["p0"]) == {}  # a miss ends the prefix
    index.insert("p0", second)  # twelve chunks on a ten-chunk backend: the two oldest go
    assert index.held("p0") == 10 and index.match(first, ["p0"]) == {}
    assert index.match(second, ["p0"]) == {"p0": 6}
    index.insert("p0", first[2:])  # touched again: now the most recent
    index.keep_only({"p0"})
    assert index.match(first, ["p1"]) == {} and index.size == 10


def test_the_index_as_a_whole_stays_within_its_bound() -> None:
    index = PrefixIndex(max_chunks=50)
    for i in range(10):
        index.insert(f"p{i % 3}", tuple(range(i * 100, i * 100 + 20)))
    assert index.size <= 50 and index.evictions >= 150


# --- the picks --------------------------------------------------------------------------------------------
def make(prefill: str = "prefix-and-load", decode: str = "least-loaded") -> tuple[Policies, LoadBoard, Balancer, Clock]:
    clock = Clock()
    board, balancer = LoadBoard(1.0, clock), Balancer()
    return Policies(prefill, decode, balancer, board, PrefixIndex()), board, balancer, clock


def read(board: LoadBoard, b: Backend, running: float = 0.0, waiting: float = 0.0, inflight_before: int = 0) -> None:
    """A read of ``b``'s engine; ``inflight_before``: how many of its requests were this router's then."""
    text = with_values(RELEASES["0.33.0"], {(RUNNING, "0"): running, (WAITING, "0"): waiting})
    board.record(b, parse_engine_metrics(text), inflight_before)


def test_without_data_the_prefill_pick_is_least_outstanding_round_robin() -> None:
    policies, _, _, _ = make()
    ps = [backend("p0"), backend("p1")]
    picks = [policies.prefill(ps, key(text_prompt(200, start=1000 * i))) for i in range(4)]
    assert [p.backend.pod for p in picks] == ["p0", "p1", "p0", "p1"] and {p.reason for p in picks} == {"in_flight"}


def test_a_repeated_prefix_goes_back_to_the_engine_that_holds_it_while_loads_are_equal() -> None:
    policies, board, _, _ = make()
    ps = [backend("p0"), backend("p1")]
    shared = text_prompt(400)
    first = policies.prefill(ps, key(shared))
    again = []
    for i in range(3):
        for b in ps:
            read(board, b)  # each turn finished before the next: both engines idle at the read
        again.append(policies.prefill(ps, key({"prompt": shared["prompt"] + f" turn{i}"})))
    assert {p.backend.pod for p in again} == {first.backend.pod} and {p.reason for p in again} == {"cache_hit"}
    assert all(p.expected_hit_tokens >= 0.9 * key(shared).tokens for p in again)


def test_no_engine_idles_while_the_one_holding_the_prefix_queues() -> None:
    policies, board, _, _ = make()
    ps = [backend("p0"), backend("p1")]
    shared = text_prompt(2000)  # a long shared system prompt: a hit worth many requests of queue
    holder = policies.prefill(ps, key(shared)).backend
    other = next(b for b in ps if b is not holder)
    read(board, holder, running=1)
    read(board, other)
    first = policies.prefill(ps, key({"prompt": shared["prompt"] + " a"}))
    assert first.backend is holder  # one ahead: within the slack
    policies.balancer.acquire(first.backend)  # and that leg stays in flight
    pick = policies.prefill(ps, key({"prompt": shared["prompt"] + " b"}))  # two ahead of an idle engine: out
    assert pick.backend is other and pick.reason == "load"
    assert policies.index.match(key(shared).chunks, [other.key])  # and now the other holds the prefix too
    second = text_prompt(2000, start=50_000)
    policies.index.insert(holder.key, key(second).chunks)
    read(board, holder, running=10)
    read(board, other, running=8)  # busy both: half the least busy one's load is the slack
    assert policies.prefill(ps, key({"prompt": second["prompt"] + " c"})).backend is holder
    read(board, holder, running=13)  # 13 > 8 + 4
    assert policies.prefill(ps, key({"prompt": second["prompt"] + " d"})).backend is other


def test_a_hit_is_worth_nothing_behind_a_long_queue() -> None:
    policies, board, _, _ = make()
    ps = [backend("p0"), backend("p1")]
    shared = text_prompt(400)
    holder = policies.prefill(ps, key(shared)).backend
    other = next(b for b in ps if b is not holder)
    read(board, holder, running=4, waiting=30)
    read(board, other)
    pick = policies.prefill(ps, key({"prompt": shared["prompt"] + " next"}))
    assert pick.backend is other and pick.reason == "load"


BLOCK, SEED = 16, "0"


def kv_backend(pod: str) -> Backend:
    """A prefill engine whose KV events the router follows (so its hits are exact)."""
    ident = EngineIdentity(f"{pod}.uid", "10.0.0.1", 5600, 1, 1, kv_events_endpoint="tcp://10.0.0.1:5557",
                           kv_hash_seed=SEED, kv_block_size=BLOCK)  # fmt: skip
    return Backend("prefill", "r1", pod, "uid", "10.0.0.1", ident)


def holds(kv: KvIndex, b: Backend, token_ids: list[int], gpu: int = 0, cpu: int = 0) -> None:
    """``b``'s engine published that it holds the first ``gpu`` blocks of ``token_ids`` in GPU memory and the
    first ``cpu`` in its CPU tier (vLLM's events: medium GPU, medium CPU)."""
    hashes = kv_blocks.block_hashes(token_ids, BLOCK, SEED)
    events = [BlockStored(block_hashes=hashes[:n], parent_block_hash=None, token_ids=[], block_size=BLOCK, lora_id=None,
                          medium=medium, lora_name=None) for n, medium in ((gpu, "GPU"), (cpu, "CPU")) if n]  # fmt: skip
    kv.apply(b.key, kv.next_seq(b.key) or 0, DecodedBatch(ts=0.0, events=events, data_parallel_rank=0))


@pytest.mark.parametrize(
    ("held", "winner"),
    [
        ({"p0": (8, 0), "p1": (0, 8)}, "p0"),  # equal prefixes: the GPU hit
        ({"p0": (0, 0), "p1": (0, 8)}, "p1"),  # a CPU hit over none
        ({"p0": (3, 0), "p1": (0, 8)}, "p1"),  # a CPU hit that saves more than a short GPU hit
        ({"p0": (4, 8), "p1": (6, 0)}, "p0"),  # GPU then CPU beyond it: 4 + 0.8 x 4 blocks > 6
    ],
)
def test_a_gpu_hit_then_a_cpu_hit_then_load(held: dict[str, tuple[int, int]], winner: str) -> None:
    clock = Clock()
    board, balancer, kv = LoadBoard(1.0, clock), Balancer(), KvIndex()
    policies = Policies("prefix-and-load", "least-loaded", balancer, board, PrefixIndex(), kv)
    ps = [kv_backend("p0"), kv_backend("p1")]
    token_ids = list(range(10 * BLOCK))
    for b in ps:
        holds(kv, b, token_ids, *held[b.pod])
        read(board, b)  # both idle
    pick = policies.prefill(ps, key({"prompt": token_ids}))
    assert (pick.backend.pod, pick.reason) == (winner, "cache_hit")
    gpu, cpu = held[winner]
    assert pick.expected_hit_tokens == int((gpu + CPU_HIT_WORTH * max(cpu - gpu, 0)) * BLOCK)


def test_least_outstanding_ignores_the_cache_but_still_says_what_it_expected() -> None:
    policies, board, _, _ = make(prefill="least-outstanding")
    ps = [backend("p0"), backend("p1")]
    shared = text_prompt(400)
    picks = [policies.prefill(ps, key(shared)) for _ in range(4)]
    assert [p.backend.pod for p in picks] == ["p0", "p1", "p0", "p1"]
    assert [p.expected_hit_tokens > 0 for p in picks] == [False, False, True, True]


def test_decode_least_loaded_follows_the_engines_numbers_and_falls_back_without_them() -> None:
    policies, board, balancer, clock = make()
    ds = [backend("d0", role="decode"), backend("d1", role="decode")]
    assert [policies.decode(ds).backend.pod for _ in range(2)] == ["d0", "d1"]  # no reading: round robin
    read(board, ds[0], running=12)
    read(board, ds[1], running=3)
    picks = []
    for _ in range(11):
        picks.append(policies.decode(ds))
        balancer.acquire(picks[-1].backend)  # each leg stays in flight
    # d1 until the legs sent since the read make it as busy as d0 (3 + 9 = 12), then both in turn
    assert [p.backend.pod for p in picks[:9]] == ["d1"] * 9 and {p.backend.pod for p in picks[9:]} == {"d0", "d1"}
    assert {p.reason for p in picks} == {"load"}
    clock.now += 10  # stale: this router's in-flight counts again
    assert policies.decode(ds).reason == "in_flight"
    outstanding, board2, _, _ = make(decode="least-outstanding")
    read(board2, ds[0], running=12)
    assert [outstanding.decode(ds).backend.pod for _ in range(2)] == ["d0", "d1"]
