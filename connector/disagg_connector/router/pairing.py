"""Which prefill and which decode serve a request: one revision, chosen in proportion to its ready pairs.

- A backend is **usable** when it is not draining, not ejected (see :class:`Ejections`), and not excluded by
  the request (a backend blamed for one of its failed attempts: a retry never goes back to it).
- A revision's **ready pairs** = min(usable prefills, usable decodes); it takes new requests only when that
  is at least one and its transfer mode is known. Revisions share new requests in proportion to their ready
  pairs (smooth weighted round robin: deterministic, and exact over any window of sum-of-weights requests),
  so during a rollout the old and the new revision serve side by side in the ratio of their capacity.
- Within a revision the role's policy picks (:mod:`policy`); :meth:`Balancer.least` is their common ground:
  least outstanding requests (this router's own in-flight count per backend), ties broken round-robin per
  role. A pair never spans two revisions.
- **Ejections never leave the router with nothing.** When no revision has a pair and ejections are the reason, a
  role whose every backend is ejected is routed as if none were (Envoy's panic routing: ejection is a guess
  from failures and timeouts, and a CPU stall that times out every probe at once ejects healthy engines; trying
  them beats a sure 503). A dead engine then fails the attempt at once, and the retry avoids it.
- Nothing usable means no pair: the caller answers 503 (or, on a retry, the failure it already has); a stream
  whose decode failed mid-stream waits for one instead (``dispatch``, :class:`Comeback`).
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from disagg_connector.router.discovery import Backend, RevisionView, Snapshot


class Ejections:
    """Backends taken out of rotation after a failure, and when to probe each again.

    A backend is ejected when it answers 503, refuses or drops a connection, or fails its health probe.
    It is re-probed after ``first`` seconds, then after twice as long each time the probe fails (at most
    ``longest``); the first good probe re-admits it. A backend that answered another 5xx is *suspect*:
    probed at once, ejected only if that probe fails (vLLM answers 500 for a single failed request, and
    also while its engine is dead; only the latter fails /health). Pure state; :mod:`probe` runs the probes.
    """

    def __init__(self, first: float = 0.25, longest: float = 8.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.first, self.longest, self.clock = first, longest, clock
        self._next: dict[str, float] = {}  # ejected key -> when to probe it next
        self._delay: dict[str, float] = {}
        self._suspects: set[str] = set()
        self.version = 0  # moves whenever the set of ejected backends does
        self.listeners: list[Callable[[], None]] = []  # called on every ejection, suspicion and re-admission

    def __contains__(self, key: str) -> bool:
        return key in self._next

    def _notify(self) -> None:
        for listener in self.listeners:
            listener()

    def __len__(self) -> int:
        return len(self._next)

    def eject(self, key: str) -> None:
        if key not in self._next:
            self._delay[key] = self.first
            self._next[key] = self.clock() + self.first
            self.version += 1
            self._notify()

    def suspect(self, key: str) -> None:
        if key not in self._next and key not in self._suspects:
            self._suspects.add(key)
            self._notify()

    def probed(self, key: str, ok: bool) -> None:
        """The result of a probe: re-admit, or eject (first failure) and back off."""
        self._suspects.discard(key)
        if ok:
            if self._next.pop(key, None) is not None:
                self.version += 1
                self._notify()
            self._delay.pop(key, None)
        elif key not in self._next:
            self.eject(key)
        else:
            self._delay[key] = min(self._delay[key] * 2, self.longest)
            self._next[key] = self.clock() + self._delay[key]

    def due(self) -> list[str]:
        now = self.clock()
        return sorted(self._suspects | {k for k, t in self._next.items() if t <= now})

    def next_due(self) -> float | None:
        if self._suspects:
            return self.clock()
        return min(self._next.values(), default=None)

    def forget(self, keep: set[str]) -> None:
        """Drop backends that left the table."""
        gone = [k for k in self._next if k not in keep]
        for key in gone:
            del self._next[key], self._delay[key]
            self.version += 1
        self._suspects &= keep
        if gone:
            self._notify()


@dataclass
class Comeback:
    """The engines a stream's continuation avoids because they failed it, until each is seen gone and back: out of
    the table (not ready, deleted) or ejected, then in it and admitted again. That is a new engine (a restarted
    container, a recreated LWS group: fresh KV, nothing of the failed one's blocks or request ids), which the
    continuation may use; an engine that failed but never went (a hang, its own error event) stays avoided."""

    failed: set[str]
    away: set[str] = field(default_factory=set)

    def observe(self, present: set[str], ejected: Ejections) -> set[str]:
        """One look at the table's backend keys and the ejections: the failed engines' keys now back."""
        self.away |= {k for k in self.failed if k not in present or k in ejected}
        back = {k for k in self.away if k in present and k not in ejected}
        self.failed -= back
        self.away -= back
        return back


@dataclass(frozen=True)
class Candidates:
    revision: RevisionView
    prefill: tuple[Backend, ...]
    decode: tuple[Backend, ...]
    despite_ejections: bool = False  # a role's ejected backends stand in: none of them is left (panic routing)

    @property
    def pairs(self) -> int:
        """Ready pairs: none while the revision's transfer mode is in doubt."""
        return min(len(self.prefill), len(self.decode)) if self.revision.mode is not None else 0


class InFlight:
    """One leg counted in flight on a backend while the ``with`` lasts (a class, not a generator: two of
    them per request)."""

    __slots__ = ("balancer", "backend")

    def __init__(self, balancer: Balancer, backend: Backend) -> None:
        self.balancer, self.backend = balancer, backend

    def __enter__(self) -> None:
        self.balancer.acquire(self.backend)

    def __exit__(self, *exc: object) -> None:
        self.balancer.release(self.backend)


class Balancer:
    def __init__(self, ejections: Ejections | None = None) -> None:
        self.ejections = ejections if ejections is not None else Ejections()
        self.inflight: dict[str, int] = defaultdict(int)
        self.inflight_backends: dict[str, Backend] = {}  # the backend behind each in-flight count
        # One round-robin counter per role: a shared one alternates between the roles and pins
        # every sequential request to the same pair.
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self._current: dict[str, float] = defaultdict(float)  # smooth weighted round robin state
        self._cached: tuple[Snapshot, int, list[Candidates]] | None = None  # candidates without exclusions

    # --- load accounting -----------------------------------------------------------------------------
    def acquire(self, b: Backend) -> None:
        self.inflight[b.key] += 1
        self.inflight_backends[b.key] = b

    def release(self, b: Backend) -> None:
        n = self.inflight[b.key] = max(0, self.inflight[b.key] - 1)
        if n == 0:
            del self.inflight[b.key]
            self.inflight_backends.pop(b.key, None)

    def track(self, b: Backend) -> InFlight:
        """``with balancer.track(b):`` one leg in flight on ``b``."""
        return InFlight(self, b)

    # --- what may serve ------------------------------------------------------------------------------
    def usable(self, b: Backend, exclude: frozenset[str] | set[str] = frozenset()) -> bool:
        return not b.draining and b.key not in exclude and b.key not in self.ejections

    def _usable_or_ejected(self, backends: Sequence[Backend], exclude: frozenset[str] | set[str]) -> tuple[tuple[Backend, ...], bool]:
        """The role's usable backends; when ejection took every one of them, the ejected ones (and True)."""
        usable = tuple(b for b in backends if self.usable(b, exclude))
        if usable:
            return usable, False
        ejected = tuple(b for b in backends if not b.draining and b.key not in exclude)
        return ejected, bool(ejected)

    def candidates(self, snap: Snapshot, exclude: frozenset[str] | set[str] = frozenset()) -> list[Candidates]:
        """Every revision with its usable backends, newest first (also those with no pair: /health).
        Without exclusions (every first attempt) computed once per table and ejection change."""
        if not exclude:
            c = self._cached
            if c is None or c[0] is not snap or c[1] != self.ejections.version:
                c = self._cached = (snap, self.ejections.version, self._candidates(snap, exclude))
            return c[2]
        return self._candidates(snap, exclude)

    def _candidates(self, snap: Snapshot, exclude: frozenset[str] | set[str]) -> list[Candidates]:
        return [
            Candidates(
                r,
                tuple(b for b in r.prefill if self.usable(b, exclude)),
                tuple(b for b in r.decode if self.usable(b, exclude)),
            )
            for r in snap.revisions
        ]

    @staticmethod
    def weights(cands: Sequence[Candidates]) -> dict[str, float]:
        """Each serving revision's share of new requests: its ready pairs over all ready pairs."""
        serving = {c.revision.revision: c.pairs for c in cands if c.pairs}
        total = sum(serving.values())
        return {rev: n / total for rev, n in serving.items()}

    def _despite_ejections(self, snap: Snapshot, exclude: frozenset[str] | set[str]) -> list[Candidates]:
        """Every revision as if the ejections of a role that has nothing else did not stand (panic routing)."""
        cands = []
        for r in snap.revisions:
            (prefill, p_panic), (decode, d_panic) = self._usable_or_ejected(r.prefill, exclude), self._usable_or_ejected(r.decode, exclude)
            cands.append(Candidates(r, prefill, decode, p_panic or d_panic))
        return cands

    def pick(self, snap: Snapshot, exclude: frozenset[str] | set[str] = frozenset(), despite_ejections: bool = False) -> Candidates | None:
        """The revision of the next request, in proportion to ready pairs; None when none can serve.
        ``despite_ejections``: the last resort, where a role's ejected backends stand in when none is left."""
        cands = self._despite_ejections(snap, exclude) if despite_ejections else self.candidates(snap, exclude)
        serving = [c for c in cands if c.pairs]
        if len(serving) <= 1:
            return serving[0] if serving else None
        total = sum(c.pairs for c in serving)
        for c in serving:
            self._current[c.revision.revision] += c.pairs
        best = max(serving, key=lambda c: self._current[c.revision.revision])
        self._current[best.revision.revision] -= total
        live = {c.revision.revision for c in serving}
        for rev in [r for r in self._current if r not in live]:
            del self._current[rev]
        return best

    def least(self, candidates: Sequence[Backend], role: str) -> Backend:
        """Least outstanding legs, ties round-robin."""
        low = min(self.inflight.get(b.key, 0) for b in candidates)
        best = [b for b in candidates if self.inflight.get(b.key, 0) == low]
        return best[next(self._rr[role]) % len(best)]

    def choose_pair(self, snap: Snapshot, exclude: frozenset[str] | set[str] = frozenset()) -> tuple[Backend, Backend] | None:
        c = self.pick(snap, exclude)
        return None if c is None else (self.least(c.prefill, "prefill"), self.least(c.decode, "decode"))

    def usable_decodes(self, snap: Snapshot, revision: str, exclude: frozenset[str] | set[str] = frozenset()) -> tuple[tuple[Backend, ...], bool]:
        """Pull: the decode is chosen after the prefill answered, within the prefill's revision; when ejection took
        every decode of it, the ejected ones (and True: panic routing, as in :meth:`pick`)."""
        r = snap.revision(revision)
        return self._usable_or_ejected(r.decode, exclude) if r is not None else ((), False)
