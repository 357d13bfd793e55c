"""Engine preStop: wait until the vLLM engine in this pod is idle, so SIGTERM cuts nothing.

The operator renders this as the ``vllm`` container's preStop hook::

    disagg-drain --port 8000 --deadline-seconds N

The kubelet runs it when the pod starts terminating (deletion, eviction by a node drain, Karpenter
consolidation, a spot interruption) and sends SIGTERM to vLLM only once it returns. vLLM aborts whatever
is still in flight on SIGTERM (docs/vllm-protocol.md), so this waits for nothing to be in flight: it
polls the engine's own Prometheus endpoint ``http://<host>:<port>/metrics`` about once a second and
calls the engine idle when, summed over every label set (one per engine: DP ranks),

- ``vllm:num_requests_running`` is 0 (requests in the batch),
- ``vllm:num_requests_waiting`` is 0 (queued, and waiting for a remote KV cache: vLLM counts its
  ``skipped_waiting`` queue, where WAITING_FOR_REMOTE_KVS requests sit, in this gauge), and
- ``vllm:kv_cache_usage_perc`` is 0: a prefill engine keeps a finished request's KV blocks referenced
  until its decode has read them (pull) or they were written (push), or the lease expires; those blocks
  count as used. Prefix-cached blocks nobody references count as free (vLLM's ``BlockPool.get_usage``),
  so the gauge does reach 0 with prefix caching on.

on two consecutive reads (:data:`IDLE_READS`). It then exits 0 and the kubelet sends SIGTERM.

It always exits 0, so the kubelet goes on to SIGTERM in every case:
- idle: at once;
- the engine does not listen (connection refused): nothing to protect, at once;
- ``--deadline-seconds`` passed: it gives up and says what was still in flight. The operator renders the
  deadline as the pod's terminationGracePeriodSeconds minus a margin for vLLM's own shutdown.

It prints one short line per change of state to stdout (the kubelet shows a hook's output only in the
FailedPreStopHook event).

Metrics text is parsed with ``prometheus_client``: vLLM depends on it, so the engine image, which
installs this package with ``--no-deps`` next to vLLM, has it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Sequence

from disagg_connector import contract
from disagg_connector.vllm_metrics import KV_USAGE, RUNNING, WAITING, read_samples

GAUGES = (RUNNING, WAITING, KV_USAGE)

DEFAULT_HOST = "127.0.0.1"
INTERVAL_SECONDS = 1.0
# Idle twice in a row, a poll apart: vLLM sets the gauges from the stats of its last engine step, and a
# request the API server has accepted but not handed to the engine core yet (still tokenizing) shows in
# none of them; nor do the last bytes of a stream whose request just finished.
IDLE_READS = 2
# One scrape must not eat the deadline: a hung engine answers nothing.
FETCH_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class Verdict:
    """What one read of /metrics says: idle, or busy with what is in flight (``kind``: a stable key for
    state changes; ``text``: for people)."""

    idle: bool
    reasons: tuple[tuple[str, str], ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(kind for kind, _ in self.reasons)

    def describe(self) -> str:
        return ", ".join(text for _, text in self.reasons) if self.reasons else "nothing running or waiting, KV cache free"


def gauge_sums(text: str) -> dict[str, float]:
    """The value of each of :data:`GAUGES` summed over its label sets; a gauge absent from ``text`` is
    absent here. Raises (ValueError, mostly) if the text is not Prometheus text format."""
    sums: dict[str, float] = {}
    for sample in read_samples(text, GAUGES):
        sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def decide(text: str) -> Verdict:
    """Is the engine whose /metrics answered ``text`` idle? Busy, with the reasons, otherwise.

    A gauge that is missing (vLLM started with ``--disable-log-stats``, or not vLLM) or not a number
    counts as busy: this cannot tell, and waiting until the deadline is the safe side."""
    try:
        sums = gauge_sums(text)
    except Exception as e:  # noqa: BLE001 - whatever answered is not readable metrics: keep waiting
        return Verdict(False, (("unreadable", f"/metrics is not Prometheus text ({e})"),))
    reasons: list[tuple[str, str]] = []
    for name in GAUGES:
        if name not in sums:
            reasons.append((f"missing:{name}", f"no {name} in /metrics"))
        elif math.isnan(sums[name]):
            reasons.append((f"nan:{name}", f"{name} is NaN"))
    running, waiting, usage = (sums.get(name, 0.0) for name in GAUGES)
    if running > 0:
        reasons.append(("running", f"{running:g} running"))
    if waiting > 0:
        reasons.append(("waiting", f"{waiting:g} waiting"))
    if usage > 0:
        # summed over engines (each its own cache's used fraction): held blocks of finished requests too
        reasons.append(("kv", f"KV blocks in use (usage {usage:.3g})"))
    return Verdict(not reasons, tuple(reasons))


# The engine is on this pod's loopback (or, in tests, a pod IP): never through an HTTP(S)_PROXY of the pod.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Unreachable(Exception):
    """Nothing listens on the engine's port: no engine, nothing in flight."""


def fetch_metrics(url: str, timeout: float) -> str:
    """The body of ``url``; :class:`Unreachable` if the connection is refused; another exception (timeouts,
    HTTP errors, resets) otherwise."""
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            return r.read().decode("utf-8", errors="replace")
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            raise Unreachable(str(e.reason)) from e
        raise
    except ConnectionRefusedError as e:
        raise Unreachable(str(e)) from e


def drain(
    url: str,
    deadline_seconds: float,
    *,
    interval: float = INTERVAL_SECONDS,
    idle_reads: int = IDLE_READS,
    fetch: Callable[[str, float], str] = fetch_metrics,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    out: Callable[[str], None] = print,
) -> str:
    """Poll ``url`` until the engine is idle on ``idle_reads`` consecutive reads, it does not listen, or
    ``deadline_seconds`` passed. Returns the outcome: ``"idle"``, ``"unreachable"`` or ``"deadline"``.
    Writes one line per change of state through ``out``."""
    start = clock()
    end = start + max(0.0, deadline_seconds)
    state: tuple[bool, tuple[str, ...]] | None = None
    idle_in_a_row = 0
    while True:
        now = clock()
        try:
            text = fetch(url, max(0.1, min(FETCH_TIMEOUT_SECONDS, end - now)))
        except Unreachable as e:
            out(f"disagg-drain: the engine does not listen at {url} ({e}): nothing in flight")
            return "unreachable"
        except Exception as e:  # noqa: BLE001 - timeout, HTTP error, reset: it may be busy, keep watching
            verdict = Verdict(False, (("unreadable", f"/metrics unreadable ({type(e).__name__}: {e})"),))
        else:
            verdict = decide(text)
        idle_in_a_row = idle_in_a_row + 1 if verdict.idle else 0
        key = (verdict.idle, verdict.kinds)
        elapsed = clock() - start
        if idle_in_a_row >= idle_reads:
            out(f"disagg-drain: idle after {elapsed:.0f}s ({verdict.describe()}): exit for SIGTERM")
            return "idle"
        if key != state:
            state = key
            out(f"disagg-drain: {'idle' if verdict.idle else 'busy'} at {elapsed:.0f}s: {verdict.describe()}")
        now = clock()
        if now >= end:
            out(f"disagg-drain: deadline of {deadline_seconds:g}s passed, still in flight: {verdict.describe()}")
            return "deadline"
        sleep(min(interval, end - now))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=contract.DRAIN_COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default=DEFAULT_HOST, help="where the engine listens (default %(default)s: this pod)")
    ap.add_argument("--port", type=int, default=contract.HTTP_PORT, help="the engine's HTTP port (default %(default)s)")
    ap.add_argument(
        "--deadline-seconds",
        type=float,
        required=True,
        help="give up after this long (the operator renders terminationGracePeriodSeconds minus vLLM's shutdown margin)",
    )
    ap.add_argument("--interval-seconds", type=float, default=INTERVAL_SECONDS, help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}/metrics"
    drain(url, args.deadline_seconds, interval=args.interval_seconds, out=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
