"""Which prefill and which decode serve a request: one revision, least outstanding requests.

- A revision is **eligible** when it has at least one usable prefill and one usable decode backend.
- Policy ``newest`` (default): the newest eligible revision (see ``discovery`` for "newest") takes all new
  requests; an older revision keeps serving only until the newer one is eligible.
  Policy ``spread``: the prefill with the least outstanding requests over all eligible revisions, then a
  decode of *its* revision.
- Within a revision: least outstanding requests (this router's own in-flight count per backend), ties
  broken round-robin.
- "Usable": not excluded by the current request (a backend that already failed it) and not ejected (a
  connection error in the last ``eject_seconds``). When nothing usable remains, exclusions and ejections
  are ignored rather than failing the request outright.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from disagg_connector.router.discovery import Backend, RevisionView, Snapshot


class Balancer:
    def __init__(
        self,
        policy: str = "newest",
        eject_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_inflight: Callable[[Backend, int], None] | None = None,
    ) -> None:
        self.policy = policy
        self.eject_seconds = eject_seconds
        self.clock = clock
        self.inflight: dict[str, int] = defaultdict(int)
        self._ejected: dict[str, float] = {}
        # One round-robin counter per role: a shared one alternates between the roles and pins
        # every sequential request to the same pair.
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self._on_inflight = on_inflight

    # --- load accounting -----------------------------------------------------------------------------
    def acquire(self, b: Backend) -> None:
        self.inflight[b.key] += 1
        if self._on_inflight:
            self._on_inflight(b, self.inflight[b.key])

    def release(self, b: Backend) -> None:
        n = self.inflight[b.key] = max(0, self.inflight[b.key] - 1)
        if n == 0:
            del self.inflight[b.key]
        if self._on_inflight:
            self._on_inflight(b, n)

    @contextmanager
    def track(self, b: Backend) -> Iterator[None]:
        self.acquire(b)
        try:
            yield
        finally:
            self.release(b)

    def eject(self, b: Backend) -> None:
        self._ejected[b.key] = self.clock() + self.eject_seconds

    def _usable(self, b: Backend, exclude: set[str]) -> bool:
        if b.key in exclude:
            return False
        until = self._ejected.get(b.key)
        if until is None:
            return True
        if until <= self.clock():
            del self._ejected[b.key]
            return True
        return False

    # --- selection -----------------------------------------------------------------------------------
    def _least(self, candidates: Sequence[Backend], role: str) -> Backend | None:
        if not candidates:
            return None
        low = min(self.inflight.get(b.key, 0) for b in candidates)
        best = [b for b in candidates if self.inflight.get(b.key, 0) == low]
        return best[next(self._rr[role]) % len(best)]

    def _filtered(self, r: RevisionView, exclude: set[str]) -> tuple[list[Backend], list[Backend]]:
        return [b for b in r.prefill if self._usable(b, exclude)], [b for b in r.decode if self._usable(b, exclude)]

    def _eligible(self, snap: Snapshot, exclude: set[str]) -> list[tuple[RevisionView, list[Backend], list[Backend]]]:
        out = []
        for r in snap.revisions:  # newest first
            p, d = self._filtered(r, exclude)
            if p and d:
                out.append((r, p, d))
        if not out and (exclude or self._ejected):
            out = [(r, list(r.prefill), list(r.decode)) for r in snap.revisions if r.eligible]
        return out

    def choose_prefill(self, snap: Snapshot, exclude: set[str] | None = None) -> Backend | None:
        eligible = self._eligible(snap, exclude or set())
        if not eligible:
            return None
        if self.policy == "newest":
            return self._least(eligible[0][1], "prefill")
        return self._least([p for _, ps, _ in eligible for p in ps], "prefill")

    def choose_decode(self, snap: Snapshot, revision: str, exclude: set[str] | None = None) -> Backend | None:
        r = snap.revision(revision)
        if r is None or not r.decode:
            return None
        usable = [b for b in r.decode if self._usable(b, exclude or set())]
        return self._least(usable or list(r.decode), "decode")

    def choose_pair(self, snap: Snapshot, exclude: set[str] | None = None) -> tuple[Backend, Backend] | None:
        exclude = exclude or set()
        p = self.choose_prefill(snap, exclude)
        if p is None:
            return None
        d = self.choose_decode(snap, p.revision, exclude)
        return (p, d) if d is not None else None
