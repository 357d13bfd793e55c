"""Which KV blocks each engine holds, learned from vLLM's KV cache events: the wire structs and their
decoder, the index (pure), and the subscriber that feeds it (the I/O).

vLLM engines started with ``--kv-events-config`` publish, per DP rank, batches of ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared`` events on a ZMQ PUB socket, each message three frames
``(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)``; a ROUTER socket replays the last
``buffer_steps`` batches from a given seq (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``).

- **Structs** mirror vLLM 0.33.0's: the batch is an array ``[ts, events, data_parallel_rank]``, each event
  a map tagged ``"type": "BlockStored"`` etc. 0.26.0's events are the same fields minus 0.33.0's trailing
  ones, so both decode. An event of a tag this module does not know (a newer vLLM) is counted and skipped.
- **:class:`KvIndex`** keeps, per backend key (a pod's DP rank), the set of block hashes it holds, keyed by
  :func:`disagg_connector.contract.kv_blocks.hash_key` (either form vLLM publishes, int or bytes, folds to
  the same int), with a reverse map from hash to backends so one pass scores every backend. It follows each
  backend's sequence numbers: a gap holds later batches and asks for a replay; a replay that cannot cover
  the gap (vLLM's buffer is too short) resets that backend's blocks, since the removals in between are
  lost. Memory is bounded by a global cap on stored (backend, hash) pairs, least recently stored out first
  (vLLM 0.33.0 re-reports a reused prefix as ``BlockStored``, so "stored" tracks "used"). A pair costs
  about 280 bytes (measured with tracemalloc: 16 backends sharing half their blocks), so the default cap,
  2**18 pairs, is about 70 MiB; size it as the engines' ``num_gpu_blocks`` summed, which is all they
  can hold.
- **:class:`KvEventSubscriber`** runs in the router's event loop with ``zmq.asyncio``: one SUB socket per
  backend and a DEALER opened for each replay. The loop rather than a thread, because the router reads the
  index on every request: in one loop the index needs no lock and a batch is applied whole between two
  requests, and posting each batch from a thread into the loop would cost a wake-up per batch for the same
  CPU (the GIL serialises the decoding either way). A replay runs inside the backend's task, so live
  batches wait in the SUB socket meanwhile and are applied in order after it. An engine whose publisher
  cannot be reached simply sends nothing: its key holds no blocks and matches 0.
- **Catching up.** A subscriber joins a publisher that has been running: right after connecting, it asks
  for a replay from the first seq it lacks, so a router that starts (or follows a new pod) learns the
  blocks stored in the last ``buffer_steps`` batches. The replay also covers ZMQ's slow joiner: a PUB drops
  what it publishes until the SUB's subscription reaches it, with no gap to show for it if nothing follows.
  A batch lost between the replay's answer and the subscription is learned at the next batch (a gap).
  :meth:`KvEventSubscriber.caught_up` says whether a backend's first replay has ended.
- **Restarts.** A live seq that is not above the previous one is a restarted publisher (vLLM counts from
  0): the backend starts over. One that has already published past the old seq cannot be told from its
  seqs, so the router calls ``KvIndex.reset`` when discovery sees a new engine identity.

The GPU tier (``medium`` GPU or unset) is indexed under the backend's key, and the CPU tier (``medium``
CPU: vLLM's OffloadingConnector, whose events the scheduler publishes in the same batches) under
:class:`CpuTier` of that key, so a query tells a hit the engine reuses as it is from one it must first copy
back; other media (storage) are not indexed. Hash groups (``group_idx``) are not told apart: plain models
have one KV-cache group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from disagg_connector.contract.kv_blocks import hash_key

log = logging.getLogger(__name__)

BackendKey = Hashable  # e.g. (pod name, DP rank): whatever the router names a backend by
MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"


@dataclass(frozen=True)
class CpuTier:
    """The CPU tier of a backend, a key of its own in the index (a backend's GPU tier is its key)."""

    backend: BackendKey


_HASH_MASK = (1 << 64) - 1
# ZmqEventPublisher.END_SEQ: the replay's last message carries seq -1 (signed), empty topic and payload.
REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- vLLM 0.33.0's wire structs (vllm/distributed/kv_events.py), fields in their order ----------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class of the events; the tag (``"type"``) is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KvEvent]  # type: ignore[assignment]


class _RawEventBatch(EventBatch):
    """The batch with its events left encoded: the slow path, one event at a time."""

    events: list[msgspec.Raw]  # type: ignore[assignment]


class _EventTag(msgspec.Struct):
    type: str = ""


@dataclass
class DecodedBatch:
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None
    skipped: int = 0  # events of an unknown tag or shape (a newer vLLM), left out


class KvEventDecoder:
    """msgpack ``KVEventBatch`` bytes to a :class:`DecodedBatch`; never raises on an unknown event."""

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(KVEventBatch)
        self._raw_batch = msgspec.msgpack.Decoder(_RawEventBatch)
        self._event = msgspec.msgpack.Decoder(KvEvent)
        self._tag = msgspec.msgpack.Decoder(_EventTag)
        self.skipped_by_tag: dict[str, int] = {}

    def decode(self, payload: bytes) -> DecodedBatch:
        """Raises ``msgspec.DecodeError`` (a ``ValueError``) only when the batch itself is not one."""
        try:
            batch = self._batch.decode(payload)
            return DecodedBatch(batch.ts, batch.events, batch.data_parallel_rank)
        except msgspec.ValidationError:
            pass  # some event is not one we know: decode them one by one
        raw = self._raw_batch.decode(payload)
        events: list[KvEvent] = []
        skipped = 0
        for item in raw.events:
            try:
                events.append(self._event.decode(item))
            except msgspec.ValidationError:
                skipped += 1
                try:
                    tag = self._tag.decode(item).type or "?"
                except msgspec.DecodeError:
                    tag = "?"
                self.skipped_by_tag[tag] = self.skipped_by_tag.get(tag, 0) + 1
        return DecodedBatch(raw.ts, events, raw.data_parallel_rank, skipped)


# --- the index (pure) ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayNeeded:
    """A backend's batches skipped from ``from_seq``: ask its publisher to replay from there."""

    key: BackendKey
    from_seq: int


@dataclass
class _Stream:
    """Where one backend's sequence stands."""

    expected: int = 0  # the next seq to apply; a new backend expects its publisher's first, 0
    last_live: int = -1  # the last seq its PUB socket delivered: live seqs only go up, unless it restarted
    gap_open: bool = False  # a replay was asked for and is not done
    held: list[tuple[int, DecodedBatch]] = field(default_factory=list)  # live batches past the gap, in order


@dataclass(frozen=True)
class KvIndexStats:
    backends: int
    stored: int  # (backend, hash) pairs held
    distinct_hashes: int
    evicted: int
    gaps: int
    resets: int  # backends whose blocks were dropped (restart, uncovered gap, AllBlocksCleared)
    skipped_events: int


class KvIndex:
    """Per backend key, the block hashes (``hash_key`` ints) it holds; at most ``max_stored`` pairs.

    Layout, for memory (``test_router_kv_events`` measures it): each backend key gets a small id; the
    reverse map holds, per hash, a bitmask of the ids holding it (so scoring every backend is a few integer
    ANDs per block); the LRU is one ordered dict of ``id << 64 | hash`` ints; and a set per backend lets a
    backend that leaves be dropped in time proportional to what it held.
    """

    def __init__(self, max_stored: int = 1 << 18, max_held_batches: int = 10_000) -> None:
        if max_stored <= 0:
            raise ValueError("max_stored must be positive")
        self.max_stored = max_stored
        self.max_held_batches = max_held_batches
        self._ids: dict[BackendKey, int] = {}
        self._keys: list[BackendKey | None] = []  # id -> key; None where an id is free
        self._free_ids: list[int] = []
        self._lru: OrderedDict[int, None] = OrderedDict()  # id << 64 | hash, least recently stored first
        self._by_hash: dict[int, int] = {}  # hash -> bitmask of ids holding it
        self._by_id: dict[int, set[int]] = {}  # id -> hashes it holds
        self._streams: dict[BackendKey, _Stream] = {}
        self._evicted = 0
        self._gaps = 0
        self._resets = 0
        self._skipped = 0

    # -- sequence --------------------------------------------------------------------------------------------
    def apply(self, key: BackendKey, seq: int, batch: DecodedBatch, live: bool = True) -> ReplayNeeded | None:
        """Apply batch ``seq`` from ``key``'s publisher (``live``: its PUB socket; else a replay).

        In order: applied. Already applied: ignored (a replay and the live socket overlap). Past a gap:
        held, and the first such batch returns :class:`ReplayNeeded` (the index keeps what it has
        meanwhile). A live seq not above the previous live one means the publisher restarted (vLLM numbers
        from 0 again): the backend is reset and starts over.
        """
        stream = self._streams.setdefault(key, _Stream())
        if live:
            if seq <= stream.last_live:
                self.reset(key)
                stream = self._streams[key]
            stream.last_live = seq
        self._skipped += batch.skipped
        if seq < stream.expected:
            return None
        if seq == stream.expected:
            self._apply_batch(key, batch)
            stream.expected = seq + 1
            self._drain_held(key, stream)
            return None
        if not live:
            # The replay starts past what we miss: vLLM's buffer no longer has it. What was stored or
            # removed in between is unknown, so the backend starts over from here.
            self._start_over(key)
            self._apply_batch(key, batch)
            stream.expected = seq + 1
            self._drain_held(key, stream)
            return None
        if len(stream.held) >= self.max_held_batches:  # a replay that never ends: give up on the gap
            self._close_gap(key, stream)
            return self.apply(key, seq, batch, live)
        stream.held.append((seq, batch))
        if stream.gap_open:
            return None
        stream.gap_open = True
        self._gaps += 1
        return ReplayNeeded(key, stream.expected)

    def replay_done(self, key: BackendKey) -> None:
        """The replay for ``key`` ended (its end marker, a timeout, or no replay socket): a gap it did not
        fill resets the backend and continues from the batches held."""
        stream = self._streams.get(key)
        if stream is None:
            return
        self._drain_held(key, stream)
        if stream.held:
            self._close_gap(key, stream)
        stream.gap_open = False

    def _close_gap(self, key: BackendKey, stream: _Stream) -> None:
        self._start_over(key)
        if stream.held:
            stream.expected = stream.held[0][0]
        stream.gap_open = False
        self._drain_held(key, stream)

    def _drain_held(self, key: BackendKey, stream: _Stream) -> None:
        while stream.held and stream.held[0][0] <= stream.expected:
            seq, batch = stream.held.pop(0)
            if seq == stream.expected:
                self._apply_batch(key, batch)
                stream.expected = seq + 1
        if not stream.held:
            stream.gap_open = False

    def _start_over(self, key: BackendKey) -> None:
        self._drop_blocks(key)
        self._drop_blocks(CpuTier(key))
        self._resets += 1

    # -- membership ------------------------------------------------------------------------------------------
    def reset(self, key: BackendKey) -> None:
        """``key``'s engine restarted (a new engine identity): its blocks are gone, its seq starts at 0."""
        self._start_over(key)
        self._streams[key] = _Stream()

    def forget(self, key: BackendKey) -> None:
        """``key`` left the backend table."""
        self._streams.pop(key, None)
        for tier in (key, CpuTier(key)):
            self._drop_blocks(tier)
            bid = self._ids.pop(tier, None)
            if bid is not None:
                self._keys[bid] = None
                self._free_ids.append(bid)

    def _id(self, key: BackendKey) -> int:
        bid = self._ids.get(key)
        if bid is None:
            if self._free_ids:
                bid = self._free_ids.pop()
                self._keys[bid] = key
            else:
                bid = len(self._keys)
                self._keys.append(key)
            self._ids[key] = bid
        return bid

    def _drop_blocks(self, key: BackendKey) -> None:
        bid = self._ids.get(key)
        if bid is None:
            return
        high = bid << 64
        for h in self._by_id.pop(bid, ()):
            del self._lru[high | h]
            self._unlink(h, bid)

    def _unlink(self, h: int, bid: int) -> None:
        mask = self._by_hash.get(h, 0) & ~(1 << bid)
        if mask:
            self._by_hash[h] = mask
        else:
            self._by_hash.pop(h, None)

    # -- events ----------------------------------------------------------------------------------------------
    def _apply_batch(self, key: BackendKey, batch: DecodedBatch) -> None:
        ids = {None: self._id(key), MEDIUM_GPU: self._id(key)}
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):  # vLLM's prefix-cache reset: the CPU tier is forgotten too,
                self._start_over(key)  # as a stale entry misroutes while a missing one only costs a hit
                continue
            if event.medium not in ids:
                if event.medium != MEDIUM_CPU:
                    continue  # storage tiers: not indexed
                ids[MEDIUM_CPU] = self._id(CpuTier(key))
            bid = ids[event.medium]
            apply = self._store if isinstance(event, BlockStored) else self._remove
            for raw in event.block_hashes:
                apply(bid, hash_key(raw))

    def _store(self, bid: int, h: int) -> None:
        pair = bid << 64 | h
        if pair in self._lru:
            self._lru.move_to_end(pair)
            return
        self._lru[pair] = None
        self._by_id.setdefault(bid, set()).add(h)
        self._by_hash[h] = self._by_hash.get(h, 0) | 1 << bid
        while len(self._lru) > self.max_stored:
            old, _ = self._lru.popitem(last=False)
            old_bid, old_h = old >> 64, old & _HASH_MASK
            self._by_id[old_bid].discard(old_h)
            self._unlink(old_h, old_bid)
            self._evicted += 1

    def _remove(self, bid: int, h: int) -> None:
        pair = bid << 64 | h
        if pair in self._lru:
            del self._lru[pair]
            self._by_id[bid].discard(h)
            self._unlink(h, bid)

    # -- queries ---------------------------------------------------------------------------------------------
    def match(self, key: BackendKey, hashes: Iterable[int]) -> int:
        """How many leading ``hashes`` (``hash_key`` ints, a request's blocks in order) ``key`` holds."""
        bid = self._ids.get(key)
        if bid is None:
            return 0
        bit = 1 << bid
        by_hash = self._by_hash
        n = 0
        for h in hashes:
            if not by_hash.get(h, 0) & bit:
                break
            n += 1
        return n

    def hits_by_backend(self, hashes: Iterable[int]) -> dict[BackendKey, int]:
        """``match`` for every backend at once (those holding the first block; the rest match 0). Reads
        ``hashes`` no further than the longest match, so a lazy iterator is hashed no further either."""
        hits: dict[BackendKey, int] = {}
        by_hash = self._by_hash
        alive = 0
        n = 0
        for h in hashes:
            mask = by_hash.get(h, 0)
            if n:
                dropped = alive & ~mask
                if dropped:
                    self._record(hits, dropped, n)
                    alive &= mask
            else:
                alive = mask
            if not alive:
                break
            n += 1
        self._record(hits, alive, n)
        return hits

    def _record(self, hits: dict[BackendKey, int], mask: int, n: int) -> None:
        while mask:
            low = mask & -mask
            hits[self._keys[low.bit_length() - 1]] = n
            mask ^= low

    def held(self, key: BackendKey) -> int:
        bid = self._ids.get(key)
        return 0 if bid is None else len(self._by_id.get(bid, ()))

    def next_seq(self, key: BackendKey) -> int | None:
        stream = self._streams.get(key)
        return None if stream is None else stream.expected

    @property
    def size(self) -> int:
        """Stored (backend, hash) pairs: what ``max_stored`` bounds."""
        return len(self._lru)

    def bytes_estimate(self) -> int:
        """The index's memory, roughly: its containers' own sizes plus the int objects they hold (a pair's
        LRU key, each distinct hash and its mask). ``test_router_kv_events`` checks it against tracemalloc."""
        big_int = sys.getsizeof(1 << 70)  # an LRU key: id << 64 | hash
        hash_int = sys.getsizeof(1 << 63)
        containers = sys.getsizeof(self._lru) + sys.getsizeof(self._by_hash) + sys.getsizeof(self._by_id)
        sets = sum(map(sys.getsizeof, self._by_id.values()))
        masks = len(self._by_hash) * sys.getsizeof(1 << max(len(self._keys) - 1, 0))
        return len(self._lru) * big_int + len(self._by_hash) * hash_int + masks + containers + sets

    def stats(self) -> KvIndexStats:
        return KvIndexStats(
            backends=sum(1 for bid in self._by_id if not isinstance(self._keys[bid], CpuTier)),
            stored=len(self._lru),
            distinct_hashes=len(self._by_hash),
            evicted=self._evicted,
            gaps=self._gaps,
            resets=self._resets,
            skipped_events=self._skipped,
        )


# --- the subscriber (I/O) ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoints:
    endpoint: str  # the publisher's PUB, e.g. tcp://10.0.0.5:5557 (vLLM offsets the port by the DP rank)
    replay_endpoint: str | None  # its ROUTER, or None: a gap then resets the backend


class KvEventSubscriber:
    """Feeds a :class:`KvIndex` from each backend's vLLM publisher, in the running event loop."""

    def __init__(
        self,
        index: KvIndex,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.decoder = KvEventDecoder()
        # Its own context, not the process's shared instance (which may be a synchronous one).
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._backends: dict[BackendKey, Endpoints] = {}
        self._tasks: dict[BackendKey, asyncio.Task[None]] = {}
        self._caught_up: set[BackendKey] = set()
        self._cancelled: set[asyncio.Task[None]] = set()  # removed backends' tasks, closing their sockets
        self._started = False
        self.replays = 0
        self.bad_messages = 0

    def add(self, key: BackendKey, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Follow ``key``'s publisher (again, if its endpoints changed)."""
        endpoints = Endpoints(endpoint, replay_endpoint)
        if self._backends.get(key) == endpoints:
            return
        self.remove(key)
        self._backends[key] = endpoints
        if self._started:
            self._spawn(key)

    def followed(self) -> list[BackendKey]:
        """The backends whose publishers are followed."""
        return list(self._backends)

    def caught_up(self, key: BackendKey) -> bool:
        """Whether ``key``'s publisher is followed and its first replay (what it published before) ended."""
        return key in self._caught_up

    def remove(self, key: BackendKey) -> None:
        """Stop following ``key`` and forget its blocks."""
        self._backends.pop(key, None)
        self._caught_up.discard(key)
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()
            self._cancelled.add(task)
            task.add_done_callback(self._cancelled.discard)
        self.index.forget(key)

    def start(self) -> None:
        """Start following every added backend; call from within the event loop."""
        self._started = True
        for key in self._backends:
            if key not in self._tasks:
                self._spawn(key)

    async def stop(self) -> None:
        """Stop following every backend and close the sockets (the subscriber is not started again)."""
        self._started = False
        tasks = [*self._tasks.values(), *self._cancelled]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    def _spawn(self, key: BackendKey) -> None:
        self._tasks[key] = asyncio.get_running_loop().create_task(
            self._follow(key, self._backends[key]), name=f"kv-events {key}"
        )

    async def _follow(self, key: BackendKey, endpoints: Endpoints) -> None:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(endpoints.endpoint)
            await self._replay(ReplayNeeded(key, self.index.next_seq(key) or 0), endpoints.replay_endpoint)
            self._caught_up.add(key)
            while True:
                frames = await sub.recv_multipart()
                replay = self._take(key, frames, live=True)
                if replay is not None:
                    await self._replay(replay, endpoints.replay_endpoint)
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one backend's stream take the router down
            log.exception("kv events from %s (%s) stopped", key, endpoints.endpoint)
        finally:
            sub.close(linger=0)

    def _take(self, key: BackendKey, frames: list[bytes], live: bool) -> ReplayNeeded | None:
        """Decode one ``(topic, seq, payload)`` message and apply it; a malformed one is counted, dropped."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_messages += 1
            return None
        try:
            batch = self.decoder.decode(frames[2])
        except (msgspec.DecodeError, ValueError):
            self.bad_messages += 1
            return None
        return self.index.apply(key, int.from_bytes(frames[1], "big"), batch, live=live)

    async def _replay(self, need: ReplayNeeded, replay_endpoint: str | None) -> None:
        """vLLM's replay: a DEALER sends ``("", from_seq as 8 bytes)``; the ROUTER answers with
        ``("", topic, seq, payload)`` for each buffered batch from there, then ``("", "", END_SEQ, "")``."""
        if replay_endpoint is None:
            self.index.replay_done(need.key)
            return
        self.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(replay_endpoint)
            await dealer.send_multipart((b"", need.from_seq.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(self.replay_timeout_s * 1000, zmq.POLLIN):
                    log.warning("kv events replay from %s timed out", replay_endpoint)
                    break
                frames = await dealer.recv_multipart()
                if len(frames) == 4 and frames[2] == REPLAY_END_SEQ:
                    break
                self._take(need.key, frames[1:], live=False)
        finally:
            dealer.close(linger=0)
            self.index.replay_done(need.key)
