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

A pod of an engine that spans pods (one LeaderWorkerSet group, LWS's ``LWS_GROUP_SIZE`` > 1 in its env) waits
for the whole group: its ranks and every other pod's run collectives together at each step, so the first pod to
get SIGTERM ends every request the group carries. Its drain reads, each poll, its own engine and every other
pod of the group at the names LWS gives them (``contract.lws_pod_address``, same port) and is idle only when all
are. A pod of the group that does not listen or whose name no longer resolves means the group is already
broken (its collectives fail without it): nothing of it can finish, so the drain returns at once. Typical
case: a node drain evicts one pod of a group while the others keep serving their streams; the router sends
the group nothing new the moment one pod terminates, and this pod's SIGTERM waits for the group's streams.

It prints one short line per change of state to stdout (the kubelet shows a hook's output only in the
FailedPreStopHook event).

Metrics text is parsed with ``prometheus_client``: vLLM depends on it, so the engine image, which
installs this package with ``--no-deps`` next to vLLM, has it.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

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
    """Nothing listens on the engine's port, or (a pod of its group) its name no longer resolves: no engine,
    nothing in flight."""


# getaddrinfo's "no such name": a pod of a group whose DNS record is gone (the pod is)
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def fetch_metrics(url: str, timeout: float) -> str:
    """The body of ``url``; :class:`Unreachable` if the connection is refused or the host's name does not
    resolve; another exception (timeouts, HTTP errors, resets, DNS failing otherwise) otherwise."""
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            return r.read().decode("utf-8", errors="replace")
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            raise Unreachable(str(e.reason)) from e
        if isinstance(e.reason, socket.gaierror) and e.reason.errno in _NO_SUCH_NAME:
            raise Unreachable(f"the name does not resolve ({e.reason})") from e
        raise
    except ConnectionRefusedError as e:
        raise Unreachable(str(e)) from e


def metrics_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def group_peer_urls(env: Mapping[str, str], port: int) -> list[str]:
    """The /metrics of every other pod of this pod's engine group, from the env LWS gives each pod; [] for an
    engine of one pod (no LWS env, or a group of one)."""
    leader, size, index = (env.get(k) for k in (contract.LWS_LEADER_ADDRESS_ENV, contract.LWS_GROUP_SIZE_ENV,
                                                 contract.LWS_WORKER_INDEX_ENV))  # fmt: skip
    if not leader or not size or index is None or int(size) < 2:
        return []
    return [metrics_url(contract.lws_pod_address(leader, i), port) for i in range(int(size)) if i != int(index)]


def _read(url: str, fetch: Callable[[str, float], str], timeout: float) -> Verdict:
    """One engine's verdict; :class:`Unreachable` goes up."""
    try:
        text = fetch(url, timeout)
    except Unreachable:
        raise
    except Exception as e:  # noqa: BLE001 - timeout, HTTP error, reset: it may be busy, keep watching
        return Verdict(False, (("unreadable", f"/metrics unreadable ({type(e).__name__}: {e})"),))
    return decide(text)


def drain(
    url: str,
    deadline_seconds: float,
    *,
    peers: Sequence[str] = (),
    interval: float = INTERVAL_SECONDS,
    idle_reads: int = IDLE_READS,
    fetch: Callable[[str, float], str] = fetch_metrics,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    out: Callable[[str], None] = print,
) -> str:
    """Poll ``url`` (and ``peers``: the other pods of its engine's group) until every one is idle on
    ``idle_reads`` consecutive reads, one does not listen, or ``deadline_seconds`` passed. Returns the
    outcome: ``"idle"``, ``"unreachable"`` (this engine), ``"group-broken"`` (a peer) or ``"deadline"``.
    Writes one line per change of state through ``out``."""
    start = clock()
    end = start + max(0.0, deadline_seconds)
    state: tuple[bool, tuple[str, ...]] | None = None
    idle_in_a_row = 0
    while True:
        now = clock()
        timeout = max(0.1, min(FETCH_TIMEOUT_SECONDS, end - now))
        try:
            verdict = _read(url, fetch, timeout)
        except Unreachable as e:
            out(f"disagg-drain: the engine does not listen at {url} ({e}): nothing in flight")
            return "unreachable"
        for peer in peers:
            try:
                of_peer = _read(peer, fetch, timeout)
            except Unreachable as e:
                out(f"disagg-drain: a pod of this engine's group does not answer at {peer} ({e}): the group's "
                    f"collectives cannot go on without it, nothing in flight can finish")  # fmt: skip
                return "group-broken"
            if not of_peer.idle:
                host = peer.split("//", 1)[1].split("/", 1)[0]
                verdict = Verdict(False, (*verdict.reasons, *((f"{host}:{k}", f"{host}: {t}") for k, t in of_peer.reasons)))
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
    try:
        peers = group_peer_urls(os.environ, args.port)
    except ValueError as e:  # an LWS env this cannot read: drain this engine alone rather than fail the hook
        print(f"disagg-drain: cannot tell this engine's group from its LWS env ({e}): waiting for this pod alone", flush=True)
        peers = []
    if peers:
        print(f"disagg-drain: a pod of a {len(peers) + 1}-pod engine group: waiting for the whole group", flush=True)
    drain(metrics_url(args.host, args.port), args.deadline_seconds, peers=peers, interval=args.interval_seconds,
          out=lambda line: print(line, flush=True))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
