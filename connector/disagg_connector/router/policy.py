"""Which prefill and which decode engine of a revision serve a request (``--prefill-policy``, ``--decode-policy``).

- **prefix-and-load** (prefill): the engine with the least expected work ahead of the request's first token:
  the prompt tokens it would not find cached (:mod:`prefix`) plus the requests queued or running there
  (:mod:`load`) times the uncached tokens an average request brings (a moving average of what this router sent).
  A long cached prefix wins on an idle engine and loses to a queue: a hit is worth nothing behind a long wait.
- **least-loaded** (decode): fewest requests running and waiting, as vLLM reports them, plus this router's legs
  since it read them.
- **least-outstanding** (either role): fewest legs in flight from this router.

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

from disagg_connector.router.discovery import Backend
from disagg_connector.router.load import LoadBoard
from disagg_connector.router.pairing import Balancer
from disagg_connector.router.prefix import PrefixIndex, PromptKey

# Weight of the newest request in the moving average of uncached prompt tokens per request.
_EWMA = 0.05


@dataclass(frozen=True)
class Pick:
    backend: Backend
    policy: str
    reason: str
    expected_hit_tokens: int = 0


class Policies:
    """The picks of one router; state is the balancer's in-flight counts, the load board and the prefix index."""

    def __init__(self, prefill: str, decode: str, balancer: Balancer, board: LoadBoard, index: PrefixIndex) -> None:
        self.prefill_policy, self.decode_policy = prefill, decode
        self.balancer, self.board, self.index = balancer, board, index
        self.mean_uncached_tokens = 0.0  # per prefill request sent: the unit a queued request costs

    def _load(self, b: Backend) -> float:
        return self.board.load(b.key, self.balancer.inflight.get(b.key, 0))

    def _fewest(self, cands: Sequence[Backend], cost: dict[str, float], role: str) -> Backend:
        low = min(cost[b.key] for b in cands)
        return self.balancer.least([b for b in cands if cost[b.key] == low], role)

    def prefill(self, cands: Sequence[Backend], key: PromptKey | None) -> Pick:
        if len(cands) == 1:
            return self._sent(Pick(cands[0], self.prefill_policy, "only", self._hit_tokens(cands[0], key)), key)
        if self.prefill_policy == "least-outstanding":
            b = self.balancer.least(cands, "prefill")
            return self._sent(Pick(b, self.prefill_policy, "in_flight", self._hit_tokens(b, key)), key)
        matched = self.index.match(key.chunks, (b.key for b in cands)) if key is not None and key.chunks else {}
        tokens = key.tokens if key is not None else 0
        per_chunk = key.tokens_per_chunk if key is not None else 0.0
        hits = {b.key: min(tokens, int(matched.get(b.key, 0) * per_chunk)) for b in cands}
        fresh = any(self.board.fresh(b.key) is not None for b in cands)
        if not fresh and not any(hits.values()):
            b = self.balancer.least(cands, "prefill")
            return self._sent(Pick(b, self.prefill_policy, "in_flight"), key)
        unit = max(self.mean_uncached_tokens, 1.0)
        cost = {b.key: (tokens - hits[b.key]) + self._load(b) * unit for b in cands}
        b = self._fewest(cands, cost, "prefill")
        best_hit = max(hits.values())
        reason = "cache_hit" if best_hit and hits[b.key] == best_hit else "load"
        return self._sent(Pick(b, self.prefill_policy, reason, hits[b.key]), key)

    def _hit_tokens(self, b: Backend, key: PromptKey | None) -> int:
        if key is None or not key.chunks:
            return 0
        return min(key.tokens, int(self.index.match(key.chunks, (b.key,)).get(b.key, 0) * key.tokens_per_chunk))

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
        self.board.dispatched(b.key)
        return pick

    def decode(self, cands: Sequence[Backend]) -> Pick:
        if len(cands) == 1:
            self.board.dispatched(cands[0].key)
            return Pick(cands[0], self.decode_policy, "only")
        if self.decode_policy == "least-outstanding" or not any(self.board.fresh(b.key) is not None for b in cands):
            b = self.balancer.least(cands, "decode")
            reason = "in_flight"
        else:
            b = self._fewest(cands, {c.key: self._load(c) for c in cands}, "decode")
            reason = "load"
        self.board.dispatched(b.key)
        return Pick(b, self.decode_policy, reason)
