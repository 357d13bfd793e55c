"""Which prefill and which decode engine of a revision serve a request (``--prefill-policy``, ``--decode-policy``).

- **prefix-and-load** (prefill): the engine with the least expected work ahead of the request's first token:
  the prompt tokens it would not find cached (:mod:`prefix`) plus the requests queued or running there
  (:mod:`load`) times the uncached tokens an average request brings (a moving average of what this router sent).
  A long cached prefix wins on an idle engine and loses to a queue: a hit is worth nothing behind a long wait.
  Only engines within a slack of the least busy one's load compete (1 request, or half its load when more), so
  that no engine idles while another queues.
- **least-loaded** (decode): fewest requests running and waiting, as vLLM reports them, plus this router's legs
  since it read them.
- **least-outstanding** (either role): fewest legs in flight from this router.

**The expected cached prefix** comes from one of two indexes. Where the candidates publish vLLM's KV events
(:mod:`kv_events`) and the prompt is token ids, it is exact: the blocks of the prompt, hashed as the engine
hashes them (:mod:`contract.kv_blocks`, with the engine's seed and block size), that the engine says it holds.
Otherwise it is the approximate index of prompt text (:mod:`prefix`). Blocks an engine holds only in its CPU tier
(``kvCache.cpu``: vLLM's OffloadingConnector, KV events of medium CPU) count :data:`CPU_HIT_WORTH` of a block it
holds on the GPU, as vLLM copies them back before the prefill goes on: a GPU hit first, then a CPU hit, then load.

Ties (and every pick without data: no reading, nothing indexed) fall back to least-outstanding, ties round
robin, so with no data a pick is what it was before policies existed. A pick never waits: it uses what the
index and the last reads say now. Every pick says why (``reason``), counted per role and policy:

- ``cache_hit``: the chosen engine holds the longest expected prefix among the candidates;
- ``load``: it was chosen for its load (no candidate holds any of the prompt, or the longest hit queued longer);
- ``in_flight``: this router's in-flight counts decided (least-outstanding; or no fresh reading of any candidate and no hit);
- ``only``: one candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from disagg_connector.contract.kv_blocks import iter_block_hash_keys
from disagg_connector.router.discovery import Backend
from disagg_connector.router.kv_events import CpuTier, KvIndex
from disagg_connector.router.load import LoadBoard
from disagg_connector.router.pairing import Balancer
from disagg_connector.router.prefix import PrefixIndex, PromptKey

# Weight of the newest request in the moving average of uncached prompt tokens per request.
_EWMA = 0.05
# prefix-and-load considers only engines with at most this many requests more than the least busy one (or this
# share of its load, when that is more).
BALANCE_SLACK = 1.0
BALANCE_SLACK_SHARE = 0.5
# What a prompt block found only in an engine's CPU tier saves, against one in its GPU memory (1). Estimated,
# not measured: the copy back over PCIe (~50 GB/s; ~0.25 MB of KV per token of a 32B model with 8 KV heads) is
# about an order of magnitude faster than computing the block, but it runs before the prefill goes on. For a small
# model it is worth less: on an H200 a 0.6B model recomputed its history faster than vLLM 0.26.0 loaded it
# (bench/results/h200-issue31-cpu-tier.md).
CPU_HIT_WORTH = 0.8


@dataclass(frozen=True)
class Pick:
    backend: Backend
    policy: str
    reason: str
    expected_hit_tokens: int = 0


class Policies:
    """The picks of one router; state is the balancer's in-flight counts, the load board and the prefix index."""

    def __init__(
        self, prefill: str, decode: str, balancer: Balancer, board: LoadBoard, index: PrefixIndex, kv: KvIndex | None = None
    ) -> None:
        self.prefill_policy, self.decode_policy = prefill, decode
        self.balancer, self.board, self.index = balancer, board, index
        self.kv = kv if kv is not None else KvIndex()
        self.mean_uncached_tokens = 0.0  # per prefill request sent: the unit a queued request costs

    def _loads(self, cands: Sequence[Backend]) -> tuple[dict[str, float], bool]:
        """Each candidate's load, and whether any has a fresh reading."""
        return self.board.loads([b.key for b in cands], self.balancer.inflight)

    def _fewest(self, cands: Sequence[Backend], cost: dict[str, float], role: str) -> Backend:
        low = min(cost[b.key] for b in cands)
        return self.balancer.least([b for b in cands if cost[b.key] == low], role)

    def prefill(self, cands: Sequence[Backend], key: PromptKey | None) -> Pick:
        if len(cands) == 1:
            return self._sent(Pick(cands[0], self.prefill_policy, "only", self._hit_tokens(cands[0], key)), key)
        if self.prefill_policy == "least-outstanding":
            b = self.balancer.least(cands, "prefill")
            return self._sent(Pick(b, self.prefill_policy, "in_flight", self._hit_tokens(b, key)), key)
        hits = self._hits(cands, key)
        tokens = key.tokens if key is not None else 0
        load, fresh = self._loads(cands)
        if not fresh and not any(hits.values()):
            b = self.balancer.least(cands, "prefill")
            return self._sent(Pick(b, self.prefill_policy, "in_flight"), key)
        unit = max(self.mean_uncached_tokens, 1.0)
        # No engine idles while another queues: one busier than the least busy by more than the slack is out,
        # whatever it holds. Without this a shared system prompt draws every new session to the engine that
        # first cached it, and the other never caches it (vllm-router's cache_aware piles sessions so).
        least = min(load.values())
        eligible = [b for b in cands if load[b.key] <= least + max(BALANCE_SLACK, BALANCE_SLACK_SHARE * least)]
        cost = {b.key: (tokens - hits[b.key]) + load[b.key] * unit for b in eligible}
        b = self._fewest(eligible, cost, "prefill")
        best_hit = max(hits[c.key] for c in eligible)
        reason = "cache_hit" if best_hit and hits[b.key] == best_hit else "load"
        return self._sent(Pick(b, self.prefill_policy, reason, hits[b.key]), key)

    def _hits(self, cands: Sequence[Backend], key: PromptKey | None) -> dict[str, int]:
        """Expected cached prompt tokens per candidate: exact where its KV events are followed and the prompt
        is token ids, else from the approximate index."""
        hits = {b.key: 0 for b in cands}
        if key is None:
            return hits
        approx = self.index.match(key.chunks, hits) if key.chunks else {}
        for b in cands:
            hits[b.key] = min(key.tokens, int(approx.get(b.key, 0) * key.tokens_per_chunk))
        if key.token_ids is None:
            return hits
        by_hashing: dict[tuple[str, int], list[Backend]] = {}
        for b in cands:
            ident = b.identity
            if ident.kv_hash_seed is not None and ident.kv_block_size and self.kv.next_seq(b.key) is not None:
                by_hashing.setdefault((ident.kv_hash_seed, ident.kv_block_size), []).append(b)
        for (seed, block_size), group in by_hashing.items():
            blocks = self.kv.hits_by_backend(iter_block_hash_keys(key.token_ids, block_size, seed))
            for b in group:
                # vLLM stores each computed block to the CPU tier, so its CPU prefix, counted from the prompt's
                # start, usually covers the GPU one; what it holds beyond that is restored, not computed
                gpu = blocks.get(b.key, 0)
                cpu_only = max(blocks.get(CpuTier(b.key), 0) - gpu, 0)
                hits[b.key] = int((gpu + CPU_HIT_WORTH * cpu_only) * block_size)
        return hits

    def _hit_tokens(self, b: Backend, key: PromptKey | None) -> int:
        return self._hits((b,), key)[b.key]

    def _sent(self, pick: Pick, key: PromptKey | None) -> Pick:
        """The prompt goes to ``pick``: it will hold the prompt's chunks, and the average moves."""
        b = pick.backend
        if key is not None:
            if key.chunks:
                capacity = self.board.cache_tokens(b.key)
                if capacity:
                    self.index.set_capacity(b.key, capacity)
                self.index.insert(b.key, key.chunks)
            uncached = max(0, key.tokens - pick.expected_hit_tokens)
            self.mean_uncached_tokens += _EWMA * (uncached - self.mean_uncached_tokens)
        return pick

    def decode(self, cands: Sequence[Backend]) -> Pick:
        if len(cands) == 1:
            return Pick(cands[0], self.decode_policy, "only")
        load, fresh = self._loads(cands) if self.decode_policy != "least-outstanding" else ({}, False)
        if not fresh:
            b = self.balancer.least(cands, "decode")
            reason = "in_flight"
        else:
            b = self._fewest(cands, load, "decode")
            reason = "load"
        return Pick(b, self.decode_policy, reason)
