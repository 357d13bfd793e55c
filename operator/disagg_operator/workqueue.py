"""A work queue of model keys with the guarantees of controller-runtime's workqueue, in small.

- A key is queued at most once; adding a queued key does nothing (bursts of child events fold into one pass).
- A key added while a worker processes it is processed again right after (no trigger is ever lost: the
  flag is set under the same lock that `done` reads).
- `add_rate_limited` brings a key back after an exponential backoff (base x 2^(failures-1), capped); `forget`
  resets it after a pass that needs no retry.
- Two workers never process the same key at once.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self, base_delay: float = 1.0, max_delay: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._clock = clock
        self._cond = threading.Condition()
        self._ready: deque[K] = deque()
        self._queued: set[K] = set()  # in _ready
        self._processing: set[K] = set()
        self._again: set[K] = set()  # added while processing
        self._delayed: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self._failures: dict[K, int] = {}
        self._shut = False
        self.adds = 0
        self.retries = 0

    def add(self, key: K) -> None:
        with self._cond:
            self._add_locked(key)

    def _add_locked(self, key: K) -> None:
        if self._shut:
            return
        self.adds += 1
        if key in self._processing:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._ready.append(key)
            self._cond.notify()

    def add_after(self, key: K, delay: float) -> None:
        with self._cond:
            heapq.heappush(self._delayed, (self._clock() + delay, next(self._seq), key))
            self._cond.notify()

    def add_rate_limited(self, key: K) -> float:
        with self._cond:
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
            self.retries += 1
        delay = min(self.base_delay * 2 ** (failures - 1), self.max_delay)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: K) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    def get(self, timeout: float | None = None) -> K | None:
        """The next key to process (now owned by the caller until `done`), or None on shutdown/timeout."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                now = self._clock()
                while self._delayed and self._delayed[0][0] <= now:
                    self._add_locked(heapq.heappop(self._delayed)[2])
                if self._ready:
                    key = self._ready.popleft()
                    self._queued.discard(key)
                    self._processing.add(key)
                    return key
                if self._shut:
                    return None
                waits = [d - now for d in (deadline,) if d is not None]
                if self._delayed:
                    waits.append(self._delayed[0][0] - now)
                if deadline is not None and now >= deadline:
                    return None
                self._cond.wait(max(0.0, min(waits)) if waits else None)

    def done(self, key: K) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._again:
                self._again.discard(key)
                self._add_locked(key)

    def shutdown(self) -> None:
        with self._cond:
            self._shut = True
            self._cond.notify_all()

    def __len__(self) -> int:
        """Every key it holds: ready, or waiting out a retry's delay."""
        with self._cond:
            return len(self._ready) + len(self._delayed)

    @property
    def depth(self) -> int:
        """Keys ready for a worker: client-go's workqueue depth, which leaves out those waiting out a delay (a
        model that keeps failing waits minutes between passes: it is no backlog)."""
        with self._cond:
            return len(self._ready)
