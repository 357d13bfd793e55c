"""The simulator's prefix cache: vLLM 0.33.0's automatic prefix caching for one DP rank, without the GPU.

Pure: no I/O, no clock (it reads vLLM's PYTHONHASHSEED and VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES from the
environment, as vLLM does). :mod:`disagg_bench.vllm_sim.sim` owns one :class:`PrefixCache` per DP rank and publishes the
events it collects (:meth:`PrefixCache.take_events`) in vLLM's wire format (:func:`wire_batch`, the structs of
``vllm/distributed/kv_events.py``).

**Tokens.** The simulator has no tokenizer; like the GPU harness's model (hack/gpu/make_model.py: N words are
N tokens) a text prompt is one token per whitespace-separated word, ``word -> stable int``
(:func:`word_token_id`); a token-id prompt is used as given. A chat request is a fixed two-token preamble,
then per message its role token and its words, then the assistant's role token (the generation prompt): four
tokens beyond the words for one message, and a conversation's next turn (which resends the history with the
assistant's answer) extends the previous turn's prompt plus answer, so it hits the blocks that turn cached.
Generated token i is the word the simulator writes for it (``tok<i>``).

**Blocks** (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``, ``kv_cache_manager.py``):
- only full blocks of ``block_size`` tokens are cached; a block's hash chains its parent's hash and its own
  tokens: vLLM's ``hash_block_tokens`` with ``--prefix-caching-hash-algo`` (``sha256``, vLLM's default, or
  ``sha256_cbor``) and the NONE_HASH seed of PYTHONHASHSEED (0.33.0's fixed default without it), computed by
  :mod:`disagg_connector.contract.kv_blocks` (:func:`prompt_block_hashes`);
  events carry them as vLLM does (``maybe_convert_block_hash``: 64-bit ints unless
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``);
- a request's hit is the longest run of leading cached blocks, but never its last token (vLLM looks up at
  most ``num_tokens - 1`` tokens), so a fully cached prompt still computes its last block;
- capacity is ``num_blocks`` per rank, shared by the blocks requests hold and the cached blocks nobody holds;
  the latter are evicted least recently freed first when a request needs a block, and a request's blocks are
  freed tail first (vLLM frees them in reverse, so a sequence's last blocks go before its first);
- blocks a request holds are never evicted; a block whose hash another block already caches stays uncached;
- the cache does not refuse: a request that needs more blocks than are free gets them anyway (the simulator
  does not model vLLM's preemption), and usage is capped at 1 by the metric.

**A CPU tier** (``cpu_blocks``: vLLM's OffloadingConnector in a MultiConnector, ``kvCache.cpu``): every full block
a request computed is also stored in host memory (``kv_offload``: stores follow the compute), up to ``cpu_blocks``,
least recently used evicted first. A prompt's blocks past its GPU hit that the CPU tier holds are copied back
instead of computed (``Allocation.restored_tokens``; the connector's lookup starts where the GPU hit ends), then
cached on the GPU as computed ones are. Its events have medium ``CPU`` and the shape of the offloading
connector's placeholders (one run of hashes, no tokens, ``block_size`` 0). A reset clears the GPU tier only.

Simplifications: a never-used block is always taken before a cached one is evicted (vLLM's free queue can
interleave them); blocks filled by generated tokens are cached when the request finishes (vLLM caches each as
it fills); LoRA, multimodal extra keys and cache salts do not exist here.
"""

from __future__ import annotations

import math
import os
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from disagg_connector.contract import kv_blocks

CHAT_PREAMBLE = ("<|sim_bos|>", "<|sim_chat|>")  # two tokens: one message's chat = its words + 4
MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"
FULL_ATTENTION = "full_attention"  # KVCacheSpecKind.FULL_ATTENTION: what kv_cache_manager stamps on stores


# --- tokens ----------------------------------------------------------------------------------------------
def word_token_id(word: str) -> int:
    """A word's token id: the same in every process (not Python's salted hash), below 2**31; CRC-32 because a
    16k-word prompt must not hold the simulator's event loop (collisions only merge two words)."""
    return zlib.crc32(word.encode()) & 0x7FFFFFFF


def text_token_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) & 0x7FFFFFFF for w in text.split()]


def role_token_id(role: str) -> int:
    return word_token_id(f"<|sim_role:{role}|>")


def completion_token_ids(prompt: Any) -> list[int]:
    """``prompt`` of /v1/completions: token ids as given, else the words of the text (or of each text)."""
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return list(prompt)
    texts = prompt if isinstance(prompt, list) else [prompt]
    return [t for p in texts for t in text_token_ids(str(p))]


def chat_token_ids(messages: Sequence[Any]) -> list[int]:
    """``messages`` of /v1/chat/completions in order, then the generation prompt (module docstring)."""
    out = [word_token_id(w) for w in CHAT_PREAMBLE]
    for m in messages:
        if isinstance(m, dict):
            out.append(role_token_id(str(m.get("role", "user"))))
            out += text_token_ids(str(m.get("content", "")))
    out.append(role_token_id("assistant"))
    return out


def generated_token_id(i: int, wrong: bool = False) -> int:
    """The id of the i-th token the simulator writes (`` tok<i>``, or `` ??<i>`` from a wrong KV)."""
    return word_token_id(f"??{i}" if wrong else f"tok{i}")


_GENERATED_INDEX: dict[int, int] = {}  # generated_token_id(i) -> i, for the first GENERATED_INDEX_SIZE tokens
GENERATED_INDEX_SIZE = 1 << 16


def generated_run(token_ids: Sequence[int]) -> int:
    """How many of the simulator's own tokens end ``token_ids`` in order (``tok0 ... tok<n-1>``): the next token
    is ``tok<n>``. The simulator's answer is so a function of the token-id prefix, as greedy decoding is: a
    continuation whose prompt is the original prompt plus the tokens already generated (stream migration) goes on
    exactly where the answer broke off, and one that dropped or repeated a token starts again from ``tok0``."""
    index = generated_index()
    last = index.get(token_ids[-1]) if token_ids else None
    if last is None or last + 1 > len(token_ids):
        return 0
    run = token_ids[len(token_ids) - last - 1 :]
    return last + 1 if all(index.get(t) == i for i, t in enumerate(run)) else 0


def generated_index() -> dict[int, int]:
    """generated_token_id(i) -> i, built once (an engine builds it as it starts: not on its first request's path)."""
    if not _GENERATED_INDEX:
        _GENERATED_INDEX.update((generated_token_id(i), i) for i in range(GENERATED_INDEX_SIZE))
    return _GENERATED_INDEX


# --- block hashes ----------------------------------------------------------------------------------------
def prompt_block_hashes(tokens: Sequence[int], block_size: int, algo: kv_blocks.HashAlgo = "sha256") -> list[bytes]:
    """The 32-byte hashes of the full blocks of ``tokens``, as a vLLM 0.33.0 engine with
    ``--prefix-caching-hash-algo algo`` and this process's PYTHONHASHSEED names them."""
    seed = os.environ.get("PYTHONHASHSEED", kv_blocks.DEFAULT_NONE_HASH_SEED)
    return kv_blocks.block_hashes(tokens, block_size, seed, algo)


def int_event_hashes() -> bool:
    """vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (on by default)."""
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"


def event_hash(block_hash: bytes, int_hashes: bool) -> int | bytes:
    """What vLLM's events carry for a block hash (``maybe_convert_block_hash``)."""
    return kv_blocks.external_hash(block_hash, int_hashes)


# --- events (what the cache reports; wire_batch turns them into vLLM's structs) -----------------------------
@dataclass(frozen=True)
class Stored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class Removed:
    block_hashes: list[bytes]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class Cleared:
    pass


CacheEvent = Stored | Removed | Cleared


# --- the cache -------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Block:
    hash: bytes | None = None
    ref: int = 0


@dataclass(eq=False)
class Allocation:
    """One request's blocks: ``blocks[:cached]`` are in the cache (hit or committed)."""

    request_id: str
    tokens: list[int]
    hashes: list[bytes]
    blocks: list[Block]
    cached: int
    hit_tokens: int
    restored_tokens: int = 0  # copied back from the CPU tier: neither computed nor a GPU hit
    freed: bool = False


@dataclass
class CacheStats:
    """vLLM's PrefixCacheStats totals, in tokens; ``external_*``: the connector's (the CPU tier's), which vLLM
    counts as ``vllm:external_prefix_cache_*``."""

    queries: int = 0
    hits: int = 0
    external_queries: int = 0
    external_hits: int = 0


@dataclass
class PrefixCache:
    num_blocks: int
    block_size: int
    enabled: bool = True
    hash_algo: kv_blocks.HashAlgo = "sha256"  # vLLM's --prefix-caching-hash-algo (its default)
    cpu_blocks: int = 0  # the CPU tier's capacity (module docstring); 0: none
    stats: CacheStats = field(default_factory=CacheStats)
    in_use: int = 0  # blocks some request holds
    _cached: dict[bytes, Block] = field(default_factory=dict)
    _evictable: OrderedDict[bytes, Block] = field(default_factory=OrderedDict)  # cached, held by nobody; LRU first
    _events: list[CacheEvent] = field(default_factory=list)
    _cpu: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # the CPU tier's hashes, LRU first

    # -- queries
    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def usage(self) -> float:
        """vLLM's ``BlockPool.get_usage``: cached blocks nobody holds count as free."""
        return min(1.0, self.in_use / self.num_blocks) if self.num_blocks > 0 else 0.0

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    # -- a request's life
    def allocate(self, request_id: str, tokens: Sequence[int], remote_kv: bool = False) -> Allocation:
        """Blocks for a prompt being scheduled: its longest cached prefix (never its last token) plus new
        blocks for the rest. ``hit_tokens`` need no compute. ``remote_kv``: a decode whose KV past that prefix
        comes over NIXL, which vLLM counts as the connector's hits (else the CPU tier's blocks are)."""
        tokens = list(tokens)
        hashes = prompt_block_hashes(tokens, self.block_size, self.hash_algo) if self.enabled else []
        hit = restored = 0
        if self.enabled:
            limit = max(0, len(tokens) - 1) // self.block_size
            while hit < limit and hashes[hit] in self._cached:
                hit += 1
            self.stats.queries += len(tokens)
            self.stats.hits += hit * self.block_size
            if self.cpu_blocks and not remote_kv:
                while hit + restored < limit and hashes[hit + restored] in self._cpu:
                    self._cpu.move_to_end(hashes[hit + restored])
                    restored += 1
        # the connector is asked for what the GPU prefix cache did not have (vLLM: connector_prefix_cache_stats)
        self.stats.external_queries += len(tokens) - hit * self.block_size
        self.stats.external_hits += len(tokens) - hit * self.block_size if remote_kv else restored * self.block_size
        blocks = [self._hold(self._cached[h]) for h in hashes[:hit]]
        blocks += self._new_blocks(self.blocks_for(len(tokens)) - hit)
        return Allocation(request_id, tokens, hashes, blocks, hit, hit * self.block_size, restored * self.block_size)

    def grow(self, alloc: Allocation, num_tokens: int) -> None:
        """More blocks as generated tokens fill the last one."""
        if not alloc.freed:
            alloc.blocks += self._new_blocks(self.blocks_for(num_tokens) - len(alloc.blocks))

    def commit(self, alloc: Allocation, extra_tokens: Sequence[int] = ()) -> None:
        """The KV of the allocation's tokens (plus ``extra_tokens``, generated) is computed: cache its full
        blocks, reporting one Stored per run of newly cached blocks."""
        if alloc.freed or not self.enabled:
            return
        alloc.tokens += extra_tokens
        full = min(len(alloc.tokens) // self.block_size, len(alloc.blocks))
        if len(alloc.hashes) < full:
            alloc.hashes = prompt_block_hashes(alloc.tokens[: full * self.block_size], self.block_size, self.hash_algo)
        self._offload(alloc.hashes[alloc.cached:full])
        run: list[int] = []
        for i in range(alloc.cached, full):
            h = alloc.hashes[i]
            if h in self._cached:  # another request cached this content meanwhile: this copy stays uncached
                self._report_stored(alloc, run)
                run = []
                continue
            alloc.blocks[i].hash = h
            self._cached[h] = alloc.blocks[i]
            run.append(i)
        self._report_stored(alloc, run)
        alloc.cached = max(alloc.cached, full)

    def free(self, alloc: Allocation) -> None:
        """The request is done with its blocks: tail first, cached ones become evictable, the rest free."""
        if alloc.freed:
            return
        alloc.freed = True
        for block in reversed(alloc.blocks):
            block.ref -= 1
            if block.ref == 0:
                self.in_use -= 1
                if block.hash is not None and self._cached.get(block.hash) is block:
                    self._evictable[block.hash] = block

    def reset(self) -> bool:
        """``/reset_prefix_cache``: forget every cached block; refused (False) while any block is held."""
        if self.in_use:
            return False
        for block in self._cached.values():
            block.hash = None
        self._cached.clear()
        self._evictable.clear()
        self._events.append(Cleared())
        return True

    # -- internals
    def _offload(self, hashes: Sequence[bytes]) -> None:
        """The CPU tier stores the blocks just computed (or touches those it has), evicting its oldest."""
        if not self.cpu_blocks:
            return
        new = [h for h in hashes if h not in self._cpu]
        for h in hashes:
            self._cpu[h] = None
            self._cpu.move_to_end(h)
        if new:
            self._events.append(Stored(new, None, [], 0, MEDIUM_CPU))
        evicted = []
        while len(self._cpu) > self.cpu_blocks:
            evicted.append(self._cpu.popitem(last=False)[0])
        if evicted:
            self._events.append(Removed(evicted, MEDIUM_CPU))

    def _hold(self, block: Block) -> Block:
        if block.ref == 0:
            self.in_use += 1
            if block.hash is not None:
                self._evictable.pop(block.hash, None)
        block.ref += 1
        return block

    def _new_blocks(self, n: int) -> list[Block]:
        if n <= 0:
            return []
        while self._evictable and self.in_use + len(self._evictable) + n > self.num_blocks:
            h, block = self._evictable.popitem(last=False)
            del self._cached[h]
            block.hash = None
            self._events.append(Removed([h]))
        self.in_use += n
        return [Block(ref=1) for _ in range(n)]

    def _report_stored(self, alloc: Allocation, run: list[int]) -> None:
        if not run:
            return
        first, last = run[0], run[-1] + 1
        self._events.append(
            Stored(
                block_hashes=alloc.hashes[first:last],
                parent_block_hash=alloc.hashes[first - 1] if first else None,
                token_ids=alloc.tokens[first * self.block_size:last * self.block_size],
                block_size=self.block_size,
            )
        )


# --- the wire structs: vLLM 0.33.0's, as the router decodes them (one definition; the tests decode what the
# simulator sends with vLLM's own classes)
from disagg_connector.router.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventBatch,
)

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVCacheEvent", "KVEventBatch"]


def wire_event(event: CacheEvent, int_hashes: bool) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """The struct vLLM's BlockPool builds for it, as kv_cache_manager annotates it (one full-attention group;
    ``extra_keys`` one None per block, as ``to_event_extra_keys`` makes of plain requests' keys)."""
    if isinstance(event, Stored):
        parent = None if event.parent_block_hash is None else event_hash(event.parent_block_hash, int_hashes)
        return BlockStored(
            block_hashes=[event_hash(h, int_hashes) for h in event.block_hashes], parent_block_hash=parent, token_ids=list(event.token_ids),
            block_size=event.block_size, lora_id=None, medium=event.medium, lora_name=None,
            extra_keys=[None] * len(event.block_hashes), group_idx=0, kv_cache_spec_kind=FULL_ATTENTION,
        )
    if isinstance(event, Removed):
        return BlockRemoved(block_hashes=[event_hash(h, int_hashes) for h in event.block_hashes], medium=event.medium, group_idx=0)
    return AllBlocksCleared()


def wire_batch(events: Sequence[CacheEvent], data_parallel_rank: int, ts: float, int_hashes: bool) -> KVEventBatch:
    """One engine step's events as ZmqEventPublisher sends them (``ts``: the step's wall-clock time)."""
    return KVEventBatch(ts=ts, events=[wire_event(e, int_hashes) for e in events], data_parallel_rank=data_parallel_rank)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The payload frame, as ZmqEventPublisher packs it (``msgspec.msgpack.Encoder().encode``)."""
    return msgspec.msgpack.encode(batch)
