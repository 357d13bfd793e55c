"""The work queue: bursts fold, no trigger is lost, failures back off, one worker per key, its depth."""

from __future__ import annotations

import threading

from disagg_operator.workqueue import WorkQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_of_adds_is_one_pass() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for _ in range(50):
        queue.add("m")
    assert queue.get(timeout=0) == "m" and queue.get(timeout=0) is None


def test_an_add_during_a_pass_runs_once_more_after_it() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("m")
    assert queue.get(timeout=0) == "m"
    queue.add("m")  # the world changed while the pass ran
    queue.add("m")
    assert queue.get(timeout=0) is None  # not twice at once
    queue.done("m")
    assert queue.get(timeout=0) == "m"
    queue.done("m")
    assert queue.get(timeout=0) is None


def test_no_trigger_is_lost_under_concurrency() -> None:
    """Every add is followed by a pass that starts after it (the race the old trigger had)."""
    queue: WorkQueue[str] = WorkQueue()
    added = 0
    seen_at_start: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set() or len(queue):
            key = queue.get(timeout=0.05)
            if key is None:
                continue
            with lock:
                seen_at_start.append(added)
            queue.done(key)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(2000):
        with lock:
            added += 1
        queue.add("m")
    stop.set()
    for t in threads:
        t.join()
    assert seen_at_start and seen_at_start[-1] == added


def test_failures_back_off_exponentially_up_to_a_cap() -> None:
    clock = Clock()
    queue: WorkQueue[str] = WorkQueue(base_delay=1.0, max_delay=8.0, clock=clock)
    delays = [queue.add_rate_limited("m") for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert queue.get(timeout=0) is None  # not before its time
    clock.now = 1.0
    assert queue.get(timeout=0) == "m"
    queue.done("m")
    queue.forget("m")
    assert queue.add_rate_limited("m") == 1.0


def test_its_depth_is_the_keys_ready_not_those_waiting_out_a_retry() -> None:
    """client-go's workqueue depth (the metric and the backlog alert): a model that keeps failing is no backlog."""
    clock = Clock()
    queue: WorkQueue[str] = WorkQueue(base_delay=10.0, clock=clock)
    queue.add_rate_limited("failing")
    queue.add("fresh")
    assert (queue.depth, len(queue)) == (1, 2)
    assert queue.get(timeout=0) == "fresh"
    queue.done("fresh")
    assert (queue.depth, len(queue)) == (0, 1)
    clock.now = 10.0
    assert queue.get(timeout=0) == "failing"  # its time came: a worker takes it
    assert (queue.depth, len(queue)) == (0, 0)


def test_shutdown_wakes_idle_workers() -> None:
    queue: WorkQueue[str] = WorkQueue()
    got: list[str | None] = []
    t = threading.Thread(target=lambda: got.append(queue.get()))
    t.start()
    queue.shutdown()
    t.join(timeout=5)
    assert got == [None]
