"""Simulated vLLM 0.33.0 engine (prefill or decode, NIXL push or pull) for tests and benchmarks.

Its behaviour follows vLLM 0.33.0's code (file names below are under ``vllm/``; NIXL files under
``distributed/kv_transfer/kv_connector/v1/nixl/``); ``--push-match transfer-id`` follows vLLM main.

**HTTP protocol (vLLM's OpenAI server).** ``POST /v1/completions`` and ``/v1/chat/completions``, streamed
(SSE, ``data: [DONE]``) or not; ``GET /v1/models``; ``GET /health`` (503 once the engine is dead); ``GET
/version`` (``--vllm-version``).
``X-Request-Id: <id>`` gives the engine request id ``cmpl-<id>-0`` (completions; the response id is
``cmpl-<id>``) or ``chatcmpl-<id>`` (chat), to which the engine appends ``-<8 hex>`` unless
``--disable-request-id-randomization`` (``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``). ``kv_transfer_params`` is a top-level request and response field. Errors use
``{"error": {"message", "type", "param", "code"}}``; a failed KV load under ``--kv-load-failure-policy fail``
is HTTP 500 "Internal server error" (non-streaming) or an error event then ``data: [DONE]`` (streaming: vLLM
has already sent 200 and its headers).

**Data parallel** (``--dp-size`` N; docs/vllm-protocol.md, "Data parallel across pods"). One simulator is
one pod's ``vllm serve``: it runs the ranks [``--dp-start-rank`` S, S + ``--dp-size-local`` L) (unset: all N,
the one-pod engine), each an engine of its own with the global rank in its NIXL identity (engine_id
``<engine-id>_dp<rank>`` when N > 1, side channel on ``--side-channel-port`` + rank) and in the ``engine`` label
of its metrics. As under vLLM's hybrid load balancing, ``X-data-parallel-rank`` is an index into the pod's own
ranks (``core_engines[value]``, ``v1/engine/core_client.py``): rank S + value; a value outside [0, L) is a 400
"data_parallel_rank R is out of range [0, L)" (``v1/engine/input_processor.py``), a header that is no integer
is ignored (``_get_data_parallel_rank``, ``entrypoints/generate/base/serving.py``). Without it the pod balances
over its own ranks: the one with the fewest requests in flight, ties in turn (vLLM 0.33.0 scores in-flight,
waiting and running requests per rank).

**The P/D side channel** (vLLM: ZMQ + NIXL notifications; here: HTTP on ``--side-channel-port + rank``).
The NIXL compatibility hash stands in as ``--compat-hash`` (one per revision) plus the transfer mode, a
factor of the hash in 0.33.0 (``metadata.py``): a push engine and a pull engine never pair; so is the vLLM release
(``vllm_version``, read in the 0.26.0, 0.33.0 and 0.34.0 wheels): engines of two releases never pair.
- Push: D schedules the request (allocates blocks) at an engine step, then sends ``PUSH_REG`` (``POST
  /push_reg`` on P's port = ``remote_port``) carrying D's internal request id, the ``transfer_id``, D's
  identity, the ``remote_engine_id``, ``tp_size``, ``pp_size`` from the decode leg and the hash. P refuses a
  wrong ``remote_engine_id`` ("Remote NIXL agent engine ID mismatch") or hash: D's recv fails.
  P matches registration and finished blocks, whichever comes second, by request id: exact, then equal
  after stripping the trailing ``-<8hex>`` of both (0.26.0, 0.33.0); with ``--push-match transfer-id``
  by the router's ``transfer_id`` that both legs carry, falling back to the request id. Then P "writes" the
  KV (sleeps the transfer time) and sends completion notices (``POST /push_done`` on D's side channel). D
  completes after ``pp_size * max(1, tp_size // D_tp)`` notices (from the decode leg's params); P sends
  ``P_pp * max(1, min(tp_size, P_tp) // D_tp)`` (its real topology, limited to the ranks D addressed).
  Too few: D never completes. Enough with a wrong tp/pp: D completes with a wrong KV (garbage tokens ``??``).
- Pull: P's prefill answer carries its ``kv_transfer_params`` (``remote_block_ids``, ``remote_engine_id``,
  ``remote_request_id`` = P's internal id, host, port, sizes, expiry, ``transfer_mode: "pull"``; push's answer
  ``transfer_mode: "push"``; ``--vllm-version 0.26.0`` or older: no ``transfer_mode``, as those releases,
  so that vllm-router, which moves a prefill URL to concurrent push on seeing it, stays sequential). D without
  ``remote_block_ids`` prefills locally without a word (``pull_scheduler.py``: nothing to read); with block
  ids but another key missing it logs "Got invalid KVTransferParams" and prefills locally; otherwise it reads
  (``POST /pull_read``).

**Leases and heartbeats** (``base_scheduler.py``, ``base_worker.py``). P holds a finished request's blocks
for ``--lease-seconds`` (kv_lease_duration), then frees them ("Releasing expired KV blocks"). D heartbeats
every request waiting for a remote KV whose params carry all remote fields, every ``lease // 6`` seconds
(at most once per engine step), to P (``POST /heartbeat`` = NIXL notif ``HB:<ids>``); each heartbeat sets the
lease of every listed request P holds *under exactly that id* to at least now + ``lease * 2 // 3``. A push
decode leg's ``remote_request_id`` (the router's ``cmpl-<id>-0``) lacks P's random suffix, so it extends
nothing; pull's is P's own id. **A pull read after expiry** still reads: NIXL READ is one-sided and D reads
the block ids it holds, whoever owns those blocks now; P logs "Potentially invalid KV blocks for
unrecognized request ... They may have expired." (``pull_worker.py``, counted as
``notifications_after_expiry``) and D answers normally with what it read (here: garbage tokens ``??``).
Only a bidirectional turn-2 read checks the expiry first.

**Failure semantics.**
- Push decode leg missing one of ``remote_engine_id remote_host remote_port tp_size remote_request_id``:
  read with ``[]`` (``push_scheduler.py``, ``metadata.py``; ``pp_size`` defaults to 1) -> ``KeyError`` in
  the engine core: the engine dies (below).
- **Death** (that, or ``POST /sim/control {"die": ...}``): every request in flight fails (500, or an error
  event), the side channel closes with the engine core, ``/health`` answers 503, a new request gets 500
  "The server had an error while processing your request." and makes the API server exit (the port closes;
  ``terminate_if_errored``), as the watchdog does anyway within ``--watchdog-seconds``. The process exits 1.
- **An engine that spans pods fails as one** (``--group-leader``: a worker pod's leader). Its ranks run
  collectives together at every step, so when one pod's engine stops answering, every other pod's engine dies at
  its next collective (NCCL: the remote process is gone) and every stream on every rank of the group ends; the
  LWS (``RecreateGroupOnPodRestart``) then recreates the whole group. Workers join their leader and watch it, the
  leader watches every worker that joined (``/sim/group/member`` every ``GROUP_WATCH_SECONDS``). A peer is a
  process, not an address (NCCL's connections are to a process): the leader refuses a worker that names another
  leader (``--group-leader-engine-id``: a rank of an earlier incarnation of the group, whose leader's pod IP the new
  leader took), and that worker dies (its rendezvous failed); a peer whose address answers with another engine id
  is gone.
- Legs whose ids don't match never rendezvous: D waits in WAITING_FOR_REMOTE_KVS forever (after
  ``--push-registration-timeout`` it only logs and counts), until the client disconnects.
- A registration arriving after P's lease ended finds nothing: push D waits forever.
- A client disconnect aborts the request (counted in ``cancelled``); an aborted prefill never pushes.
- ``POST /sim/control {"fail_transfers": true}`` fails every KV receive of this engine (a failed NIXL
  handshake or transfer: 500 / error event under policy fail); ``{"unavailable": true}`` answers new
  requests 503 as a paused engine does; ``{"stall": true}`` hangs the engine loop.

**Prefix cache** (``--enable-prefix-caching``, on by default as in vLLM; ``--no-enable-prefix-caching``):
one cache per DP rank of ``--num-gpu-blocks`` blocks of ``--block-size`` tokens, with vLLM's rules and hashes
(prefix_cache.py, which also says how prompts become token ids). A request takes its blocks when it is
scheduled (P: when its prefill gets the accelerator; D: at the step boundary that schedules it, whatever its
path) and computes only the tokens past its cached prefix; its prompt's full blocks are cached when its KV is
there (P: the prefill is done; D: its first token, computed or received), its generated tokens' full blocks
when it finishes. P holds a prefill's blocks until its lease ends, D has read them or P has written them.
The KV transfer still moves the whole prompt (vLLM would move only what D lacks).
``POST /reset_prefix_cache`` empties every rank's cache (``{"success": false}`` while blocks are held).
A CPU tier (``--cpu-offload-bytes``: the OffloadingConnector's ``cpu_bytes_to_use`` of a rendered MultiConnector,
over ``--kv-bytes-per-token`` x ``--block-size`` per block) keeps every computed block in host memory, LRU; the
blocks past a prompt's GPU hit that it holds are copied back at ``--cpu-restore-gbps`` instead of computed, and
counted as vLLM counts a connector's hits (``vllm:external_prefix_cache_*``: the connector is asked for the tokens
past the GPU hit; a decode's KV received over NIXL counts as its hits, as on the H200, h200-issue31-cpu-tier.md).

**KV events** (``--kv-events-config '<json>'``, vLLM's KVEventsConfig): per DP rank a copy of vLLM 0.33.0's
``ZmqEventPublisher`` (PUB at the endpoint, its port plus the global rank; ROUTER replay likewise), one
``KVEventBatch`` per engine step that has events: BlockStored when blocks are cached, BlockRemoved when one is
evicted, AllBlocksCleared on a reset; the CPU tier's stores and evictions likewise, with medium ``CPU``.

**Timing model** (every duration multiplied by ``--time-scale``):
- P has one accelerator: prefills run one at a time, FIFO, ``prefill_base_ms + prefill_us_per_token *
  tokens`` each, ``tokens`` being those past the prompt's cached prefix (at least one).
- D runs an engine loop of steps of ``tpot_ms``; each step emits one token to every running request.
  Requests are scheduled (and push registrations sent) at step boundaries, and a request whose KV arrived
  joins the batch at the next boundary, ``kv_pickup_ms`` after it arrived (``pull_pickup_ms`` in pull, when
  given; 0 by default; vLLM 0.26.0 on one H200: bench/disagg_bench/vllm_sim/calibration.json). Work that vLLM does
  inline in D's loop stalls the step for everyone: pull's descriptor prep + transfer submission
  (vLLM's "post time"), ``descriptor_prep_us_per_block * blocks``
  (blocks of ``block_size`` tokens), and local (re)compute of a prompt, ``prefill_us_per_token *
  tokens`` (past its cached prefix). Push preps descriptors in P's background writer thread, which merges contiguous blocks
  into larger transfer regions (the AWS article): one region's prep, on the request's path, stalling nobody.
- KV transfer: ``prompt_tokens * kv_bytes_per_token * 8 / (link_gbps * 1e9)`` seconds for P's background
  WRITE in push, the same over ``read_gbps`` (when given) for D's READ in pull. Each side-channel message
  costs half of ``registration_rtt_ms``. A READ is one-sided (``pull_worker.py``: D posts it and polls its
  own completion; P hears of it by a notification off D's path), so D's path in pull is the inline prep,
  the READ and the pick-up, with no side-channel message.
- D's API server takes a prompt in (tokenizing and processing it) for ``intake_us_per_token`` per prompt token
  before its engine sees the request: on D's path when its leg is sent after the prefill (pull, sequential
  push), behind the prefill in concurrent push. (P's own intake is inside its fitted prefill time.)
- P notices a notification at its next engine step: at the end of the prefill it is computing, or,
  when idle, at the next multiple of ``step_ms``. This is the engine step boundary that push pays when
  the legs are sequential (the registration reaches an idle P after the prefill); concurrent push hides
  it behind the prefill.
Defaults approximate Qwen3-32B (256 KiB of KV per token), TP8 H200 prefill, 100 GB/s EFA.

**Metrics** (``GET /metrics``, Prometheus text by prometheus_client, as vLLM's ``PrometheusStatLogger``
in ``v1/metrics/loggers.py``): ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``, labels ``engine`` (the DP rank) and ``model_name``, computed at scrape time.
Running: a prefill computing, a request in D's batch. Waiting: everything else handed to the engine and
not finished: queued for P's accelerator or D's next step, waiting for its remote KV (vLLM counts
WAITING_FOR_REMOTE_KVS in this gauge), KV arrived but not yet in the batch; and split as vLLM splits it,
``vllm:num_requests_waiting_by_reason``: ``reason="deferred"`` the requests scheduled whose remote KV has not
arrived, ``reason="capacity"`` the rest. KV blocks in use (of
``--num-gpu-blocks`` per rank, ``BlockPool.get_usage``): those of every scheduled, unfinished request
(prompt plus generated tokens; a block two requests share counts once), and those P still holds for a
finished prefill: under its lease until D reads them (pull) or while it writes them (push); cached blocks
nobody holds count as free. ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens
looked up / found cached, per rank) and ``vllm:cache_config_info`` (CacheConfig's fields as labels, plus
``engine``) as vLLM's.

Test hooks: ``GET /sim/stats`` (counters), ``GET /sim/events`` (ordered event log),
``GET /sim/body/{xid}`` (the exact bytes this engine sent for a request), ``POST /sim/control`` (faults),
all on the HTTP port.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import logging
import math
import queue
import re
import secrets
import signal
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from disagg_connector import contract
from disagg_connector.contract import kv_blocks
from disagg_bench.vllm_sim import prefix_cache as pc

log = logging.getLogger("vllm_sim")

PULL_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")  # with remote_block_ids
ENGINE_DEAD_MESSAGE = "The server had an error while processing your request."  # EngineDeadError.CLIENT_MESSAGE
UVICORN_TICK = 0.1  # uvicorn checks should_exit once per tick
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def strip_suffix(rid: str) -> str:
    """vLLM's push matching fallback: drop the random ``-<8hex>`` the engine appends (nixl/utils.py)."""
    return _SUFFIX.sub("", rid)


def match_basis(by_transfer_id: bool, a: tuple[str, str | None], b: tuple[str, str | None]) -> str | None:
    """Do P's finished request and D's registration, each ``(request id, transfer_id)``, belong together,
    and by which key ("transfer_id" / "request_id"; None: they don't)?

    vLLM main (``--push-match transfer-id``) compares the router's ``transfer_id`` when both sides carry
    one; otherwise, and always in 0.26.0/0.33.0, the request ids: exact, then without the random suffix.
    """
    if by_transfer_id and a[1] and b[1]:
        return "transfer_id" if a[1] == b[1] else None
    return "request_id" if a[0] == b[0] or strip_suffix(a[0]) == strip_suffix(b[0]) else None


def error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


def error_response(status: int, message: str, err_type: str) -> web.Response:
    return web.json_response(error_body(status, message, err_type), status=status)


@dataclass
class Timing:
    prefill_us_per_token: float = 6.0
    tpot_ms: float = 7.0
    kv_bytes_per_token: int = 262144
    link_gbps: float = 800.0
    registration_rtt_ms: float = 1.0
    step_ms: float = 10.0
    descriptor_prep_us_per_block: float = 400.0
    block_size: int = 128
    scale: float = 1.0
    prefill_base_ms: float = 0.0
    kv_pickup_ms: float = 0.0
    read_gbps: float = 0.0  # D's READ in pull; 0: link_gbps
    pull_pickup_ms: float | None = None  # D's pick-up of a READ's KV; None: kv_pickup_ms
    intake_us_per_token: float = 0.0  # D's API server taking in a prompt before its engine sees it
    cpu_restore_gbps: float = 400.0  # copying KV back from the CPU tier (PCIe Gen5 x16, ~50 GB/s)

    def prefill(self, n: int) -> float:
        return (self.prefill_base_ms * 1e3 + n * self.prefill_us_per_token) * 1e-6 * self.scale

    def restore(self, n: int) -> float:
        """Copying ``n`` tokens' KV back from the CPU tier, before the prefill goes on."""
        return n * self.kv_bytes_per_token * 8 / (self.cpu_restore_gbps * 1e9) * self.scale

    def cpu_tier_blocks(self, cpu_bytes: int, block_size: int) -> int:
        """The blocks a CPU tier of ``cpu_bytes`` (vLLM's cpu_bytes_to_use) holds; none without a tier (also for
        zero-cost engines, whose KV has no size)."""
        if not cpu_bytes:
            return 0
        if self.kv_bytes_per_token * block_size <= 0:
            raise SystemExit("a CPU tier (--cpu-offload-bytes) needs --kv-bytes-per-token > 0 to size its blocks")
        return cpu_bytes // (self.kv_bytes_per_token * block_size)

    def kv_pickup(self, pull: bool = False) -> float:
        ms = self.pull_pickup_ms if pull and self.pull_pickup_ms is not None else self.kv_pickup_ms
        return ms / 1000 * self.scale

    def intake(self, n: int) -> float:
        return n * self.intake_us_per_token * 1e-6 * self.scale

    def xfer(self, n: int, read: bool = False) -> float:
        gbps = self.read_gbps if read and self.read_gbps > 0 else self.link_gbps
        return n * self.kv_bytes_per_token * 8 / (gbps * 1e9) * self.scale

    def half_rtt(self) -> float:
        return self.registration_rtt_ms / 2000 * self.scale

    def tpot(self) -> float:
        return self.tpot_ms / 1000 * self.scale

    def step(self) -> float:
        return self.step_ms / 1000 * self.scale

    def blocks(self, n: int) -> int:
        return max(1, math.ceil(n / self.block_size))

    def descriptor_prep(self, n: int) -> float:
        return self.blocks(n) * self.descriptor_prep_us_per_block * 1e-6 * self.scale


class EngineDead(Exception):
    pass


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM 0.33.0's ``--kv-events-config`` (``vllm/config/kv_events.py``), its fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """EventPublisherFactory.create: a ZMQ publisher only when enabled and not "null"."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError("--kv-events-config must be a JSON object")
    known = set(KVEventsConfig.__dataclass_fields__)
    if unknown := sorted(set(raw) - known):
        raise argparse.ArgumentTypeError(f"--kv-events-config has unknown fields {unknown} (known: {sorted(known)})")
    config = KVEventsConfig(**raw)
    if config.publisher not in (None, "null", "zmq"):
        raise argparse.ArgumentTypeError(f"Unknown event publisher '{config.publisher}'")
    return config


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """ZmqEventPublisher.offset_endpoint_port: rank r's endpoint (vLLM passes the global DP rank,
    ``parallel_config.data_parallel_index``): a tcp port plus r (0 stays 0), an inproc name plus ``_dp<r>``."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            base, port = endpoint.rsplit(":", 1)
            return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
        return endpoint
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def on_host(endpoint: str, bind_host: str | None) -> str:
    """The simulator's ``--kv-events-host``: a wildcard tcp endpoint bound on one address instead, so that
    simulated pods sharing a machine (each on its own loopback address) can use the same ports. vLLM binds
    every interface (a pod has its own network namespace)."""
    if bind_host is None or not endpoint.startswith("tcp://*:"):
        return endpoint
    return f"tcp://{bind_host}:{endpoint.removeprefix('tcp://*:')}"


class KVEventPublisher:
    """vLLM 0.33.0's ``ZmqEventPublisher`` for one DP rank (``vllm/distributed/kv_events.py``): a PUB socket
    sends (topic, 8-byte big-endian seq, msgpack KVEventBatch) per batch from a thread fed by a queue; the last
    ``buffer_steps`` payloads are kept for a ROUTER replay socket, which answers a request (empty frame, 8-byte
    start seq) with every buffered batch from that seq on, then (empty, -1 as 8 bytes, empty)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int, bind_host: str | None = None) -> None:
        import zmq  # only an engine that publishes needs pyzmq

        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self.rank = data_parallel_rank
        self._queue: queue.Queue[pc.KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        assert self.endpoint is not None
        if "*" in self.endpoint or "::" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(on_host(self.endpoint, bind_host))
        else:
            self._pub.connect(self.endpoint)
        self._replay = None
        if self.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._replay.bind(on_host(self.replay_endpoint, bind_host))
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"zmq-publisher-dp{data_parallel_rank}")
        self._thread.start()

    def publish(self, batch: pc.KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            log.warning("KV event queue full (dp rank %d): batch dropped", self.rank)

    def _run(self) -> None:
        seqs = itertools.count()
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                break
            seq = next(seqs)
            payload = pc.encode_batch(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("Invalid replay request: %s", frames)
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))

    def shutdown(self) -> None:
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=1.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


@dataclass
class Seq:
    xid: str
    rid: str
    resp_id: str
    kind: str
    prompt_tokens: int
    max_tokens: int
    rank: int
    params: dict[str, Any] | None
    token_ids: list[int] = field(default_factory=list)
    path: str = "local"  # local | push | pull | prefill
    blocks: pc.Allocation | None = None  # its KV blocks on this rank, from scheduling until freed
    kept: bool = False  # P: blocks held past the answer (lease, write), freed by whoever ends that
    q: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    emitted: int = 0
    done: bool = False
    wrong: bool = False
    notices: int = 0
    expected: int = 1
    kv_ready: bool = False
    computing: bool = False  # P: this prefill has the accelerator
    start: int = 0  # the number of the first token it writes (prefix_cache.generated_run of its prompt)

    def generated_id(self, i: int) -> int:
        """The id of the i-th token this request writes."""
        return pc.generated_token_id(i if self.wrong else self.start + i, self.wrong)

    @property
    def transfer_id(self) -> str | None:
        tid = (self.params or {}).get("transfer_id")
        return tid if isinstance(tid, str) else None


GROUP_WATCH_SECONDS = 0.1  # how often a pod of an engine that spans pods checks the others (its collective's step)
GROUP_PEER_TIMEOUT = 2.0  # a peer that does not answer its /health within this is gone


@dataclass
class Held:
    seq: Seq
    expiry: float


class _SchedulerGauges:
    """vLLM's scheduler gauges (names, help texts and labels of PrometheusStatLogger), read at scrape time."""

    HELP = {
        "vllm:num_requests_running": "Number of requests in model execution batches.",
        "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
        "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    }
    BY_REASON = ("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: 'capacity' = "
                 "waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
                 "blocked status). Sum of all reasons equals vllm:num_requests_waiting.")  # fmt: skip

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Any:
        running, capacity, deferred, usage = self.engine.scheduler_gauges()
        waiting = {rank: capacity[rank] + deferred[rank] for rank in capacity}
        model = self.engine.a.served_model_name
        for (name, doc), per_rank in zip(self.HELP.items(), (running, waiting, usage)):
            family = GaugeMetricFamily(name, doc, labels=["engine", "model_name"])
            for rank, value in sorted(per_rank.items()):
                family.add_metric([str(rank), model], float(value))
            yield family
        by_reason = GaugeMetricFamily(*self.BY_REASON, labels=["engine", "model_name", "reason"])
        for reason, per_rank in (("capacity", capacity), ("deferred", deferred)):
            for rank, value in sorted(per_rank.items()):
                by_reason.add_metric([str(rank), model, reason], float(value))
        yield by_reason


class _PrefixCacheMetrics:
    """vLLM's prefix-cache counters (tokens) and ``vllm:cache_config_info`` (CacheConfig.metrics_info() as
    labels plus ``engine``; the label set of 0.33.0), read at scrape time."""

    COUNTERS = {
        "vllm:prefix_cache_queries": ("Prefix cache queries, in terms of number of queried tokens.", "queries"),
        "vllm:prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.", "hits"),
        # the connector's: the NIXL KV a decode receives, the CPU tier's blocks (vLLM exports them with a connector)
        "vllm:external_prefix_cache_queries": ("External prefix cache queries from KV connector cross-instance cache "
                                               "sharing, in terms of number of queried tokens.", "external_queries"),
        "vllm:external_prefix_cache_hits": ("External prefix cache hits from KV connector cross-instance cache sharing, "
                                            "in terms of number of cached tokens.", "external_hits"),
    }

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def cache_config(self) -> dict[str, str]:
        a = self.engine.a
        return {**CACHE_CONFIG_INFO, "block_size": str(a.block_size), "num_gpu_blocks": str(a.num_gpu_blocks),
                "enable_prefix_caching": str(a.enable_prefix_caching), "prefix_caching_hash_algo": a.prefix_caching_hash_algo}

    def collect(self) -> Any:
        model = self.engine.a.served_model_name
        for name, (doc, attr) in self.COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["engine", "model_name"])
            for rank, cache in sorted(self.engine.caches.items()):
                family.add_metric([str(rank), model], float(getattr(cache.stats, attr)))
            yield family
        labels = self.cache_config()
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=[*labels, "engine"])
        for rank in self.engine.ranks:
            info.add_metric([*labels.values(), str(rank)], 1.0)
        yield info


# CacheConfig.metrics_info() of vLLM 0.33.0 (keys in its order; values of a default config). The simulator
# sets block_size, num_gpu_blocks, enable_prefix_caching and prefix_caching_hash_algo from its flags.
CACHE_CONFIG_INFO = {
    "block_size": "16", "user_specified_block_size": "True", "kv_cache_layout": "None", "prefix_match_unit": "None",
    "gpu_memory_utilization": "0.92", "cache_dtype": "auto", "is_attention_free": "False",
    "num_gpu_blocks_override": "None", "sliding_window": "None", "enable_prefix_caching": "True",
    "prefix_caching_hash_algo": "sha256", "prefix_cache_retention_interval": "0",
    "kv_cache_dtype_skip_layers": "[]", "mamba_page_size_padded": "None", "skip_page_size_padded": "None",
    "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
    "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16", "use_replayssm": "False",
    "use_kda_recoverssm": "False", "num_gpu_blocks": "None", "num_cpu_blocks": "None",
    "simple_cpu_offload_num_blocks": "None", "effective_attention_block_size": "None", "kv_cache_size_tokens": "None",
    "kv_cache_max_concurrency": "None", "hash_block_size": "None", "cache_hit_alignment_tokens": "None",
    "kv_sharing_fast_prefill": "False", "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None",
    "kv_offloading_size": "None", "kv_offloading_backend": "native", "_block_size_resolved": "True",
}  # fmt: skip


class Engine:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.t = Timing(
            a.prefill_us_per_token, a.tpot_ms, a.kv_bytes_per_token, a.link_gbps, a.registration_rtt_ms,
            a.step_ms, a.descriptor_prep_us_per_block, a.block_size, a.time_scale,
            prefill_base_ms=a.prefill_base_ms, kv_pickup_ms=a.kv_pickup_ms, read_gbps=a.read_gbps,
            pull_pickup_ms=a.pull_pickup_ms, intake_us_per_token=a.intake_us_per_token, cpu_restore_gbps=a.cpu_restore_gbps,
        )
        self.compute = asyncio.Lock()
        self.compute_until = 0.0
        self.arrivals: deque[Seq] = deque()
        self.ready: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.wake = asyncio.Event()
        self.by_rid: dict[str, Seq] = {}
        self.pushing = 0  # KV writes under way (P)
        self.ranks = dp_ranks(a)  # the global DP ranks this pod serves
        self.held: dict[int, dict[str, Held]] = {r: {} for r in self.ranks}
        self.regs: dict[int, dict[str, dict[str, Any]]] = {r: {} for r in self.ranks}
        self.counters: Counter[str] = Counter()
        self.events: deque[dict[str, Any]] = deque(maxlen=20000)
        self.bodies: dict[str, bytes] = {}
        self.dead: str | None = None
        self.stop = asyncio.Event()  # set: the API server exits (serve() returns, the ports close)
        self.side_runners: list[web.AppRunner] = []
        self.faults: dict[str, bool] = {"fail_transfers": False, "unavailable": False, "stall": False}
        # D: requests whose P leases this engine heartbeats (base_scheduler.on_new_request), by P's engine id
        self.heartbeats: dict[str, tuple[str, int, set[str]]] = {}
        self._rr = itertools.count()
        self._ev = itertools.count()
        self.session: aiohttp.ClientSession | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        pc.generated_index()  # built before the engine listens, not on its first request's path
        self.group_peers: dict[str, str] = {}  # the other pods of an engine that spans pods: URL -> engine id (group_watch)
        self.group_task: asyncio.Task[None] | None = None
        self.inflight: dict[int, Seq] = {}  # id(seq) -> every request handed to the engine, until its answer is sent
        self.writing: dict[int, Seq] = {}  # id(seq) -> prefills whose KV P is writing (push)
        cpu_blocks = self.t.cpu_tier_blocks(a.cpu_offload_bytes, a.block_size)
        self.caches = {r: pc.PrefixCache(a.num_gpu_blocks, a.block_size, a.enable_prefix_caching, a.prefix_caching_hash_algo, cpu_blocks=cpu_blocks)
                       for r in self.ranks}
        self.publishers: dict[int, KVEventPublisher] = {}  # by rank, with --kv-events-config (serve() starts them)
        self.int_event_hashes = pc.int_event_hashes()
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerGauges(self))
        self.registry.register(_PrefixCacheMetrics(self))

    # --- bookkeeping -------------------------------------------------------------------------------
    def engine_id(self, rank: int) -> str:
        return f"{self.a.engine_id}_dp{rank}" if self.a.dp_size > 1 else self.a.engine_id

    @property
    def compat_hash(self) -> str:
        """vLLM's NIXL compatibility hash has the release (``vllm_version``) and, from 0.33.0 on, the transfer mode as
        factors: engines of two releases never pair, nor push with pull (``nixl/metadata.py``)."""
        return f"{self.a.compat_hash}/{self.a.mode}/vllm-{self.a.vllm_version}"

    @property
    def heartbeat_interval(self) -> float:
        return max(self.a.lease_seconds // 6, self.t.step())  # base_scheduler.py:88, checked once per step

    @property
    def lease_extension(self) -> float:
        return self.a.lease_seconds * 2 // 3  # base_worker.py:631

    def event(self, kind: str, **kw: Any) -> None:
        ev = {"n": next(self._ev), "t": time.monotonic(), "kind": kind, **kw}
        self.events.append(ev)
        if self.a.log_events:
            log.info("%s", json.dumps(ev, default=str))

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def post(self, host: str, port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert self.session is not None
        async with self.session.post(f"http://{host}:{port}{path}", json=body) as r:
            return r.status, await r.json(content_type=None)

    def die(self, why: str) -> None:
        """An exception in vLLM's engine-core busy loop: the engine is dead, then its API server exits.

        As vLLM 0.33.0 does it: every request in flight fails (500, or an error event in a stream), the
        engine core process (and with it the NIXL side channel) is gone, ``/health`` answers 503
        (``serve/instrumentator/health.py``), a new request gets 500 and makes the server exit
        (``terminate_if_errored`` in the error handler; uvicorn notices ``should_exit`` at its next tick),
        and the watchdog does the same within ``--watchdog-seconds`` (``launchers/launcher.py``).
        """
        if self.dead:
            return
        self.dead = why
        self.counters["engine_dead"] += 1
        self.event("engine_dead", why=why)
        log.error("EngineCore failed: %s", why)
        for seq in [*self.arrivals, *self.ready, *self.running, *self.by_rid.values()]:
            self.fail(seq, ENGINE_DEAD_MESSAGE)
        side, self.side_runners = self.side_runners, []
        for r in side:
            self.spawn(r.cleanup())
        asyncio.get_running_loop().call_later(self.a.watchdog_seconds, self.stop.set)

    def exit_soon(self) -> None:
        asyncio.get_running_loop().call_later(UVICORN_TICK, self.stop.set)

    def fail(self, seq: Seq, message: str) -> None:
        if not seq.done:
            seq.done = True
            self.free_blocks(seq)
            seq.q.put_nowait(EngineDead(message))
            self.by_rid.pop(seq.rid, None)
            self.stop_heartbeat(seq)

    # --- the prefix cache of each rank (prefix_cache.py) and its KV events ------------------------------
    def take_blocks(self, seq: Seq) -> float:
        """Schedule ``seq``'s prompt on its rank's cache (again, after a failed KV load); returns the time its
        prefill takes: the tokens past its cached prefix (the event records both)."""
        cache = self.caches[seq.rank]
        if seq.blocks is not None:
            cache.free(seq.blocks)
        seq.blocks = cache.allocate(seq.rid, seq.token_ids, remote_kv=seq.path in ("push", "pull"))
        restored = seq.blocks.restored_tokens
        computed = seq.prompt_tokens - seq.blocks.hit_tokens - restored
        seconds = self.t.prefill(computed) + self.t.restore(restored)
        self.event("prompt_scheduled", xid=seq.xid, rid=seq.rid, rank=seq.rank, hit_tokens=seq.blocks.hit_tokens,
                   restored_tokens=restored, computed_tokens=computed, prefill_seconds=seconds)  # fmt: skip
        return seconds

    def free_blocks(self, seq: Seq, finished: bool = False) -> None:
        """``seq`` is done with its blocks; a finished request first caches the blocks its generated tokens
        filled (all but the last token's KV is computed)."""
        if seq.blocks is None:
            return
        cache = self.caches[seq.rank]
        if finished:
            cache.commit(seq.blocks, [seq.generated_id(i) for i in range(seq.emitted - 1)])
        cache.free(seq.blocks)

    def publish_events(self) -> None:
        """End of an engine step: each rank's cache events as one KVEventBatch (vLLM publishes one per step
        that has events); without --kv-events-config they are dropped, as vLLM does not collect them."""
        for rank, cache in self.caches.items():
            events = cache.take_events()
            publisher = self.publishers.get(rank)
            if events and publisher is not None:
                publisher.publish(pc.wire_batch(events, rank, time.time(), self.int_event_hashes))

    # --- heartbeats (D) and leases (P) ----------------------------------------------------------------
    def track_heartbeat(self, seq: Seq) -> None:
        """base_scheduler.on_new_request: a remote-prefill request with every remote field is heartbeated."""
        p = seq.params or {}
        if not p.get("do_remote_prefill") or any(p.get(k) is None for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")):
            return
        host, port, rids = self.heartbeats.setdefault(str(p["remote_engine_id"]), (str(p["remote_host"]), int(p["remote_port"]), set()))
        rids.add(str(p["remote_request_id"]))
        if len(self.heartbeats) == 1 and len(rids) == 1:
            self.spawn(self.send_heartbeats())

    def stop_heartbeat(self, seq: Seq) -> None:
        p = seq.params or {}
        entry = self.heartbeats.get(str(p.get("remote_engine_id")))
        if entry is not None:
            entry[2].discard(str(p.get("remote_request_id")))
            if not entry[2]:
                del self.heartbeats[str(p.get("remote_engine_id"))]

    async def send_heartbeats(self) -> None:
        """"HB:<P request ids>" to each P whose blocks a waiting request needs, every lease // 6 seconds."""
        while self.heartbeats and not self.dead:
            await asyncio.sleep(self.heartbeat_interval)
            for engine, (host, port, rids) in list(self.heartbeats.items()):
                if rids:
                    self.counters["heartbeats_sent"] += 1
                    self.spawn(self._post_quietly(host, port, "/heartbeat", {"remote_engine_id": engine, "req_ids": sorted(rids)}))

    async def _post_quietly(self, host: str, port: int, path: str, body: dict[str, Any]) -> None:
        try:
            await self.post(host, port, path, body)
        except (aiohttp.ClientError, OSError, ValueError):
            pass  # vLLM logs heartbeat failures at debug level only

    # --- the engine loop (decode batch; also local generation) --------------------------------------
    async def loop(self) -> None:
        while not self.dead:
            stall = 0.0
            while self.arrivals:
                seq = self.arrivals.popleft()
                if not seq.done:
                    stall += self.schedule(seq)
            self.publish_events()
            if self.dead:
                return
            while self.ready:
                seq = self.ready.popleft()
                if not seq.done:
                    self.running.append(seq)
            self.running = [s for s in self.running if not s.done]
            if not self.running:
                if stall:
                    await asyncio.sleep(stall)
                if not (self.arrivals or self.ready):
                    self.wake.clear()
                    await self.wake.wait()
                continue
            await asyncio.sleep(self.t.tpot() + stall)
            while self.faults["stall"] and not self.dead:  # a hung engine step: nobody gets a token
                await asyncio.sleep(0.05)
            for seq in self.running:
                if not seq.done:
                    self.emit(seq)
            self.publish_events()

    def emit(self, seq: Seq) -> None:
        i = seq.emitted
        seq.emitted += 1
        cache = self.caches[seq.rank]
        if i == 0:
            self.event("first_token", xid=seq.xid, rid=seq.rid)
            if seq.blocks is not None:  # the prompt's KV is here (computed, or received): its blocks are cached
                cache.commit(seq.blocks)
        if seq.blocks is not None:
            cache.grow(seq.blocks, seq.prompt_tokens + seq.emitted)
        seq.q.put_nowait(i)
        if seq.emitted >= seq.max_tokens:
            seq.done = True
            self.free_blocks(seq, finished=True)
            seq.q.put_nowait(None)

    def make_ready(self, seq: Seq) -> None:
        seq.kv_ready = True
        self.stop_heartbeat(seq)
        self.by_rid.pop(seq.rid, None)
        pickup = self.t.kv_pickup(seq.path == "pull")  # D's engine notices the received KV this much later
        if pickup > 0:
            asyncio.get_running_loop().call_later(pickup, self.join_batch, seq)
        else:
            self.join_batch(seq)

    def join_batch(self, seq: Seq) -> None:
        if not seq.done:
            self.ready.append(seq)
            self.wake.set()

    def schedule(self, seq: Seq) -> float:
        """At a step boundary: allocate blocks and start what the request needs; returns inline work (s)."""
        prefill_seconds = self.take_blocks(seq)
        if seq.path == "local":
            self.ready.append(seq)
            return prefill_seconds
        if seq.path == "push":
            p = seq.params or {}
            try:  # read with [] by NixlPushScheduler (push_scheduler.py:177-189) and metadata.py:333-337
                reg = {
                    "request_id": seq.rid,
                    "transfer_id": seq.transfer_id,
                    "remote_engine_id": p["remote_engine_id"],
                    "remote_host": p["remote_host"],
                    "remote_port": p["remote_port"],
                    "tp_size": p["tp_size"],
                    "pp_size": p.get("pp_size", 1),
                    "remote_request_id": p["remote_request_id"],
                }
            except KeyError as e:
                self.fail(seq, "Internal server error")
                self.die(f"KeyError: {e}")
                return 0.0
            reg.update(
                decode_engine_id=self.engine_id(seq.rank),
                decode_host=self.a.host,
                decode_port=self.a.side_channel_port + seq.rank,
                decode_tp=self.a.tp_size,
                compat_hash=self.compat_hash,
                num_tokens=seq.prompt_tokens,
            )
            seq.expected = int(reg["pp_size"]) * max(1, int(reg["tp_size"]) // self.a.tp_size)
            self.by_rid[seq.rid] = seq
            self.spawn(self.register(seq, reg))
            return 0.0
        # pull: descriptor prep and transfer submission happen inline in D's loop
        setup = self.t.descriptor_prep(seq.prompt_tokens)
        self.spawn(self.pull_read(seq, setup))
        return setup

    async def register(self, seq: Seq, reg: dict[str, Any]) -> None:
        self.event("registration_sent", xid=seq.xid, rid=seq.rid, to=f"{reg['remote_host']}:{reg['remote_port']}")
        self.counters["registrations_sent"] += 1
        await asyncio.sleep(self.t.half_rtt())
        if self.faults["fail_transfers"]:
            self.load_failed(seq, "push_reg_notif_failed", "injected by /sim/control")
            return
        try:
            status, answer = await self.post(str(reg["remote_host"]), int(reg["remote_port"]), "/push_reg", reg)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            status, answer = 0, {"error": f"{type(e).__name__}: {e}"}
        if status != 200:
            self.load_failed(seq, "push_reg_handshake_failed", str(answer.get("error")))
            return
        self.spawn(self.watchdog(seq))

    async def watchdog(self, seq: Seq) -> None:
        await asyncio.sleep(self.a.push_registration_timeout)
        if not seq.done and not seq.kv_ready:
            self.counters["registration_timeouts"] += 1
            self.event("registration_timeout", xid=seq.xid, rid=seq.rid)
            log.warning("NixlPushConnector: registration for request %s timed out", seq.rid)

    async def pull_read(self, seq: Seq, setup: float) -> None:
        p = seq.params or {}
        await asyncio.sleep(setup)  # the READ is posted at the end of the inline prep: no side-channel message
        if self.faults["fail_transfers"]:
            self.load_failed(seq, "transfer_setup_failed", "injected by /sim/control")
            return
        body = {
            "remote_engine_id": p["remote_engine_id"],
            "remote_request_id": p["remote_request_id"],
            "compat_hash": self.compat_hash,
            "num_tokens": seq.prompt_tokens,
        }
        try:
            status, answer = await self.post(str(p["remote_host"]), int(p["remote_port"]), "/pull_read", body)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            status, answer = 0, {"error": f"{type(e).__name__}: {e}"}
        if seq.done:
            return
        if status != 200:
            self.load_failed(seq, "pull_read_failed", str(answer.get("error")))
            return
        seq.wrong |= not answer.get("valid", True)
        self.counters["kv_received"] += 1
        self.event("kv_received", xid=seq.xid, rid=seq.rid, wrong=seq.wrong)
        self.make_ready(seq)

    def load_failed(self, seq: Seq, what: str, why: str) -> None:
        if seq.done:
            # aborted (its client closed the leg) while the transfer ran: vLLM's scheduler no longer holds the
            # request, so no load fails for it (counting one ended a cancelled leg twice)
            self.event("transfer_failed_after_abort", xid=seq.xid, rid=seq.rid, what=what)
            return
        self.counters["kv_load_failures"] += 1
        self.event("kv_load_failed", xid=seq.xid, rid=seq.rid, what=what, why=why)
        log.warning("NIXL transfer failure: %s | Context: {request_id: %s, error: %s}", what, seq.rid, why)
        self.by_rid.pop(seq.rid, None)
        if self.a.kv_load_failure_policy == "recompute":
            self.counters["recomputed"] += 1
            seq.path = "local"
            self.arrivals.append(seq)
            self.wake.set()
        else:
            self.fail(seq, "Internal server error")

    # --- prefill side ------------------------------------------------------------------------------
    async def prefill(self, seq: Seq) -> None:
        async with self.compute:
            cost = self.take_blocks(seq)
            self.compute_until = time.monotonic() + cost
            self.event("prefill_start", xid=seq.xid, rid=seq.rid, rank=seq.rank)
            seq.computing = True
            try:
                await asyncio.sleep(cost)
            finally:
                seq.computing = False
        if seq.blocks is not None:
            self.caches[seq.rank].commit(seq.blocks)
        self.publish_events()
        seq.kept = True  # its blocks stay held until the lease ends or the write is done
        regs = self.regs[seq.rank]
        reg = next((regs.pop(k) for k, r in list(regs.items()) if self.matches(seq, r)), None)
        self.counters["prefills"] += 1
        self.event("prefill_done", xid=seq.xid, rid=seq.rid, rank=seq.rank, registration_waiting=reg is not None)
        if reg is not None:
            self.counters["registrations_before_prefill_done"] += 1
            self.start_push(seq, reg)
            return
        held = Held(seq, time.monotonic() + self.a.lease_seconds)
        self.held[seq.rank][seq.rid] = held
        self.spawn(self.expire(seq.rank, seq.rid, held))

    async def expire(self, rank: int, rid: str, held: Held) -> None:
        """P's lease on finished blocks; heartbeats move ``held.expiry`` (base_worker._reap_expired_send_leases)."""
        while self.held[rank].get(rid) is held:
            now = time.monotonic()
            if now >= held.expiry:
                del self.held[rank][rid]
                self.free_blocks(held.seq)
                self.counters["expired"] += 1
                self.event("expired", rid=rid, rank=rank)
                log.warning("Releasing expired KV blocks for request %s which were retrieved by 0 remote worker(s) before lease expired.", rid)
                return
            await asyncio.sleep(held.expiry - now)

    def matches(self, seq: Seq, reg: dict[str, Any]) -> str | None:
        return match_basis(self.a.push_match == "transfer-id", (seq.rid, seq.transfer_id), (reg["request_id"], reg.get("transfer_id")))

    def match_held(self, rank: int, reg: dict[str, Any]) -> Held | None:
        held = self.held[rank]
        key = next((k for k, h in held.items() if self.matches(h.seq, reg)), None)
        return held.pop(key) if key is not None else None

    async def step_boundary(self) -> None:
        """Wait until P's engine loop looks at notifications: end of the current step or next idle tick."""
        now = time.monotonic()
        if self.compute.locked() and self.compute_until > now:
            await asyncio.sleep(self.compute_until - now)
        elif self.t.step() > 0:
            period = self.t.step()
            await asyncio.sleep(period - (now % period))

    async def on_push_reg(self, rank: int, reg: dict[str, Any]) -> None:
        await self.step_boundary()
        held = self.match_held(rank, reg)
        self.event("registration_matched" if held else "registration_pending", rid=reg["request_id"], rank=rank)
        if held is not None:
            self.start_push(held.seq, reg)
        else:
            self.regs[rank][reg["request_id"]] = reg

    def start_push(self, seq: Seq, reg: dict[str, Any]) -> None:
        """The blocks P held stay in use, without a gap, until the write is done."""
        self.writing[id(seq)] = seq
        self.spawn(self.push_write(seq, reg))

    async def push_write(self, seq: Seq, reg: dict[str, Any]) -> None:
        """P's nixl-push-writer: WRITE the blocks to D, then the completion notices."""
        self.counters["pushes"] += 1
        self.pushing += 1
        self.writing[id(seq)] = seq
        try:
            await self._push_write(seq, reg)
        finally:
            self.pushing -= 1
            self.writing.pop(id(seq), None)
            self.free_blocks(seq)

    async def _push_write(self, seq: Seq, reg: dict[str, Any]) -> None:
        # the writer merges contiguous blocks into one transfer region: one descriptor's prep, not one per block
        await asyncio.sleep(self.t.descriptor_prep(1) + self.t.xfer(seq.prompt_tokens))
        tp_router, pp_router = int(reg["tp_size"]), int(reg["pp_size"])
        notices = self.a.pp_size * max(1, min(tp_router, self.a.tp_size) // int(reg["decode_tp"]))
        wrong = (tp_router, pp_router) != (self.a.tp_size, self.a.pp_size)
        await asyncio.sleep(self.t.half_rtt())
        msg = {"request_id": reg["request_id"], "notices": notices, "wrong": wrong, "from": self.engine_id(seq.rank)}
        try:
            await self.post(reg["decode_host"], int(reg["decode_port"]), "/push_done", msg)
            self.event("push_done", rid=reg["request_id"], notices=notices, matched_by=self.matches(seq, reg))
        except (aiohttp.ClientError, OSError, ValueError) as e:
            self.counters["failed_transfers"] += 1
            self.event("push_failed", rid=reg["request_id"], why=str(e))

    # --- side channel (one listener per DP rank) ------------------------------------------------------
    def side_app(self, rank: int) -> web.Application:
        async def push_reg(request: web.Request) -> web.Response:
            reg = await request.json()
            if self.dead:
                return web.json_response({"error": "engine dead"}, status=503)
            if reg.get("remote_engine_id") != self.engine_id(rank):
                self.counters["handshake_failures"] += 1
                return web.json_response({"error": "Remote NIXL agent engine ID mismatch"}, status=409)
            if reg.get("compat_hash") != self.compat_hash or self.a.role != "prefill":
                self.counters["handshake_failures"] += 1
                return web.json_response({"error": "NIXL compatibility hash mismatch"}, status=409)
            rid = reg["request_id"]
            done = any(self.matches(h.seq, reg) for h in self.held[rank].values())
            self.counters["registrations_received"] += 1
            self.event("registration_received", rid=rid, rank=rank, prefill_done=done, remote_engine_id=reg["remote_engine_id"])
            self.spawn(self.on_push_reg(rank, reg))
            return web.json_response({"ok": True})

        async def push_done(request: web.Request) -> web.Response:
            msg = await request.json()
            seq = self.by_rid.get(msg["request_id"])
            if seq is None or seq.done:
                self.counters["notifications_unmatched"] += 1
                return web.json_response({"ok": False})
            seq.notices += int(msg["notices"])
            seq.wrong |= bool(msg.get("wrong")) or seq.notices > seq.expected
            if seq.notices >= seq.expected and not seq.kv_ready:
                self.counters["kv_received"] += 1
                if seq.wrong:
                    self.counters["kv_wrong"] += 1
                self.event("kv_received", xid=seq.xid, rid=seq.rid, wrong=seq.wrong)
                self.make_ready(seq)
            return web.json_response({"ok": True})

        async def pull_read(request: web.Request) -> web.Response:
            msg = await request.json()
            if msg.get("remote_engine_id") != self.engine_id(rank):
                self.counters["handshake_failures"] += 1
                return web.json_response({"error": "Remote NIXL agent engine ID mismatch"}, status=409)
            if msg.get("compat_hash") != self.compat_hash:
                self.counters["handshake_failures"] += 1
                return web.json_response({"error": "NIXL compatibility hash mismatch"}, status=409)
            # A READ is one-sided: D reads the block ids it was given whether or not P still holds them.
            # P learns of it only from D's completion notice (pull_worker._get_new_notifs).
            await asyncio.sleep(self.t.xfer(int(msg.get("num_tokens", 0)), read=True))
            rid = msg.get("remote_request_id")
            held = self.held[rank].pop(rid, None)
            if held is None:
                self.counters["notifications_after_expiry"] += 1
                self.event("read_after_expiry", rid=rid, rank=rank)
                log.error("Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode worker. They may have expired.", rid)
                return web.json_response({"ok": True, "valid": False})
            self.free_blocks(held.seq)
            self.counters["reads"] += 1
            self.event("read_done", rid=held.seq.rid, rank=rank)
            return web.json_response({"ok": True, "valid": True})

        async def heartbeat(request: web.Request) -> web.Response:
            msg = await request.json()
            if msg.get("remote_engine_id") != self.engine_id(rank):
                return web.json_response({"error": "Remote NIXL agent engine ID mismatch"}, status=409)
            self.counters["heartbeats_received"] += 1
            new_expiry = time.monotonic() + self.lease_extension
            for rid in msg.get("req_ids") or ():  # exact P-side ids only (base_worker._handle_heartbeat)
                held = self.held[rank].get(rid)
                if held is not None:
                    held.expiry = max(held.expiry, new_expiry)
                    self.counters["leases_extended"] += 1
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post("/push_reg", push_reg)
        app.router.add_post("/push_done", push_done)
        app.router.add_post("/pull_read", pull_read)
        app.router.add_post("/heartbeat", heartbeat)
        return app

    # --- OpenAI HTTP ----------------------------------------------------------------------------------
    def http_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", functools.partial(self.generate, kind="completions"))
        app.router.add_post("/v1/chat/completions", functools.partial(self.generate, kind="chat"))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/version", self.version)
        app.router.add_get("/sim/stats", self.stats)
        app.router.add_get("/sim/events", self.get_events)
        app.router.add_get("/sim/body/{xid}", self.body)
        app.router.add_post("/sim/control", self.control)
        app.router.add_post("/sim/group/join", self.group_join)
        app.router.add_get("/sim/group/member", self.group_member)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        return app

    # --- an engine that spans pods ----------------------------------------------------------------------
    async def group_join(self, request: web.Request) -> web.Response:
        """A worker pod of this (leader's) engine joins its collectives: from now on this engine watches it too. A
        worker that names another leader belongs to another incarnation of the group (its leader's pod IP is now this
        engine's): refused, as its collectives never connect to this process."""
        body = await request.json()
        url, peer, leader = body["url"], body["engine_id"], body["leader"]
        if leader != self.a.engine_id:
            log.warning("refused rank %s at %s: it belongs to the group of leader %s", peer, url, leader)
            return web.json_response({"error": f"this is engine {self.a.engine_id}, not {leader}"}, status=409)
        if self.group_peers.get(url) != peer:
            self.group_peers[url] = peer
            self.event("group_joined", peer=url, engine_id=peer)
            if self.group_task is None:
                self.group_task = asyncio.create_task(self.group_watch())
        return web.json_response({"joined": True})

    async def group_member(self, request: web.Request) -> web.Response:
        """What a peer's watch asks: this engine's id while it lives (503 once dead, as ``/health``)."""
        if self.dead:
            return web.Response(status=503)
        return web.json_response({"engine_id": self.a.engine_id})

    async def _peer_alive(self, url: str, engine_id: str) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=GROUP_PEER_TIMEOUT)
            async with self.session.get(url + "/sim/group/member", timeout=timeout) as r:  # type: ignore[union-attr]
                return r.status == 200 and (await r.json())["engine_id"] == engine_id
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return False

    async def group_watch(self) -> None:
        """The collectives of an engine that spans pods (expert/data parallel over an LWS group): every rank takes
        part in every step, so when one pod's engine stops answering, the others fail at their next collective
        (NCCL reports the remote process gone) and die: every stream on every rank of the group ends, as in vLLM.
        A worker joins its leader (``--group-leader``, ``--group-leader-engine-id``) and watches it; the leader
        watches every worker that joined. A peer whose address answers as another engine is gone too."""
        assert self.session is not None
        if self.a.group_leader:
            self.group_peers[self.a.group_leader] = self.a.group_leader_engine_id
            me = f"http://{self.a.host}:{self.a.port}"
            join = {"url": me, "engine_id": self.a.engine_id, "leader": self.a.group_leader_engine_id}
            while not self.dead:
                try:
                    async with self.session.post(self.a.group_leader + "/sim/group/join", json=join) as r:
                        if r.status == 200:
                            break
                        if r.status == 409:  # another engine listens where its leader was: its group is gone
                            self.die(f"the engine's group cannot form: {(await r.json())['error']} (NCCL: the rendezvous failed)")
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(GROUP_WATCH_SECONDS)
        while not self.dead:
            await asyncio.sleep(GROUP_WATCH_SECONDS)
            for url, engine_id in list(self.group_peers.items()):
                if not await self._peer_alive(url, engine_id):
                    self.die(f"a collective of the engine's group failed: the rank at {url} ({engine_id}) is gone (NCCL: remote process exited)")
                    return

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /version``: the release this engine answers as (``--vllm-version``)."""
        return web.json_response({"version": self.a.vllm_version})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev endpoint: every rank forgets its cached blocks (AllBlocksCleared), or nothing changes
        where some rank has blocks held (``{"success": false}``, as BlockPool.reset_prefix_cache)."""
        success = all(cache.in_use == 0 for cache in self.caches.values())
        if success:
            for cache in self.caches.values():
                cache.reset()
            self.publish_events()
        log.info("Resetting prefix cache: %s", "done" if success else "blocks are still held")
        return web.json_response({"success": success})

    async def control(self, request: web.Request) -> web.Response:
        """Test hook: ``{"die": why}`` kills the engine; ``{"fail_transfers": bool}`` makes every KV receive
        fail (as a failed NIXL handshake/transfer would); ``{"unavailable": bool}`` answers new requests with
        503 as a paused engine does (``RetryableRequestError``); ``{"stall": bool}`` hangs the engine
        loop (no token for anyone, the connections stay open)."""
        msg = await request.json()
        for fault in self.faults:
            if fault in msg:
                self.faults[fault] = bool(msg[fault])
        if msg.get("die"):
            self.die(str(msg["die"]))
        return web.json_response({"faults": self.faults, "dead": self.dead})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.a.served_model_name, "object": "model", "owned_by": "vllm", "max_model_len": 131072}]}
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.dead else 200)

    def scheduler_gauges(self) -> tuple[dict[int, int], dict[int, int], dict[int, int], dict[int, float]]:
        """Per DP rank of this pod (global): requests running, requests waiting for capacity, requests waiting on
        their remote KV (deferred), fraction of KV blocks in use (module docstring)."""
        running, capacity, deferred = dict.fromkeys(self.ranks, 0), dict.fromkeys(self.ranks, 0), dict.fromkeys(self.ranks, 0)
        in_batch = {id(s) for s in self.running}
        for key, seq in self.inflight.items():
            if seq.done:
                continue
            if seq.computing or key in in_batch:
                running[seq.rank] += 1
            elif seq.path in ("push", "pull") and seq.blocks is not None and not seq.kv_ready:
                deferred[seq.rank] += 1  # scheduled, its KV on the way: vLLM's WAITING_FOR_REMOTE_KVS
            else:
                capacity[seq.rank] += 1
        return running, capacity, deferred, {rank: cache.usage for rank, cache in self.caches.items()}

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "role": self.a.role,
                "mode": self.a.mode,
                "ranks": list(self.ranks),
                "engine_ids": [self.engine_id(r) for r in self.ranks],
                "dead": self.dead,
                "counters": dict(self.counters),
                "held": sum(len(h) for h in self.held.values()),
                "pending_registrations": sum(len(r) for r in self.regs.values()),
                "waiting_for_kv": len(self.by_rid),
                "pushing": self.pushing,
                "active": sum(1 for q in (self.arrivals, self.ready, self.running) for seq in q if not seq.done),
                "in_flight": sorted({seq.xid for q in (self.arrivals, self.ready, self.running, self.by_rid.values())
                                     for seq in q if not seq.done}),
            }
        )

    async def get_events(self, request: web.Request) -> web.Response:
        return web.json_response({"events": list(self.events)})

    async def body(self, request: web.Request) -> web.Response:
        data = self.bodies.get(request.match_info["xid"])
        return web.Response(body=data) if data is not None else web.Response(status=404)

    def _parse(self, body: Any, kind: str) -> tuple[list[int], int] | web.Response:
        if not isinstance(body, dict):
            return error_response(400, "The request body must be a JSON object", "BadRequestError")
        if body.get("model") != self.a.served_model_name:
            return error_response(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        if kind == "completions":
            prompt = body.get("prompt")
            if prompt is None:
                return error_response(400, "Field required: prompt", "BadRequestError")
            token_ids = pc.completion_token_ids(prompt)
            max_tokens = body.get("max_tokens", 16)
        else:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                return error_response(400, "Field required: messages", "BadRequestError")
            token_ids = pc.chat_token_ids(msgs)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return error_response(400, "max_tokens must be at least 1", "BadRequestError")
        return token_ids or [pc.word_token_id("")], max_tokens  # an empty prompt still counts one token

    async def generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        if self.dead:
            self.exit_soon()
            return error_response(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
        if self.faults["unavailable"]:
            self.counters["answered_503"] += 1
            return error_response(503, "Request failed; please retry", "ServiceUnavailableError")
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            return error_response(400, f"Invalid JSON: {e}", "BadRequestError")
        parsed = self._parse(body, kind)
        if isinstance(parsed, web.Response):
            return parsed
        token_ids, max_tokens = parsed
        prompt_tokens = len(token_ids)
        xid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        base = f"cmpl-{xid}-0" if kind == "completions" else f"chatcmpl-{xid}"
        rid = base if self.a.disable_request_id_randomization else f"{base}-{secrets.token_hex(4)}"
        resp_id = f"cmpl-{xid}" if kind == "completions" else base
        rank_header = request.headers.get("X-data-parallel-rank")
        index = dp_rank_header(rank_header)
        if index is not None and not 0 <= index < len(self.ranks):
            return error_response(400, f"data_parallel_rank {index} is out of range [0, {len(self.ranks)})", "BadRequestError")
        rank = self.ranks[index] if index is not None else self.balance()
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, dict) else None
        stream = bool(body.get("stream", False))
        seq = Seq(xid, rid, resp_id, kind, prompt_tokens, max_tokens, rank, params, token_ids)
        seq.start = pc.generated_run(token_ids)
        self.inflight[id(seq)] = seq
        self.counters["requests"] += 1
        self.event(
            "leg_received", xid=xid, rid=rid, endpoint=kind, rank=rank, rank_header=rank_header, stream=stream,
            kv_transfer_params=params, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
        )
        try:
            if params and params.get("do_remote_decode") and self.a.role == "prefill":
                seq.path = "prefill"
                seq.max_tokens = 1
                await self.prefill(seq)
                seq.done = True
                return await self.respond(request, body, seq, stream, [0], self.returned_params(seq))
            if params and params.get("do_remote_prefill"):
                self.track_heartbeat(seq)
                if self.a.mode == "push":
                    seq.path = "push"
                elif not params.get("remote_block_ids"):
                    # pull_scheduler: no block ids means nothing to read; the request prefills here, silently
                    self.counters["recomputed"] += 1
                elif all(k in params for k in PULL_KEYS):
                    seq.path = "pull"
                else:
                    log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params)
                    self.counters["invalid_kv_params"] += 1
                    self.counters["recomputed"] += 1
            if (intake := self.t.intake(seq.prompt_tokens)) > 0:
                await asyncio.sleep(intake)
            self.arrivals.append(seq)
            self.wake.set()
            return await self.respond(request, body, seq, stream, None, None)
        except (asyncio.CancelledError, ConnectionResetError) as gone:
            # The client went: vLLM aborts the request. Most often aiohttp cancels this handler; when the handler
            # first meets the closed connection (writing the answer's headers), the same, and quietly: aiohttp
            # logs any other exception as an unhandled error and counts nothing cancelled.
            if not seq.done:
                self.counters["cancelled"] += 1
                self.event("cancelled", xid=xid, rid=rid, path=seq.path)
            seq.done = True
            self.by_rid.pop(seq.rid, None)
            self.stop_heartbeat(seq)
            if isinstance(gone, ConnectionResetError):
                raise asyncio.CancelledError from gone
            raise
        finally:
            self.inflight.pop(id(seq), None)
            if not seq.kept:
                self.free_blocks(seq)

    def balance(self) -> int:
        """The rank of a request without X-data-parallel-rank: this pod's least busy, ties in turn."""
        load = Counter(seq.rank for seq in self.inflight.values() if not seq.done)
        first, n = next(self._rr), len(self.ranks)
        return min((self.ranks[(first + i) % n] for i in range(n)), key=lambda r: load[r])

    def returned_params(self, seq: Seq) -> dict[str, Any]:
        """What P returns in kv_transfer_params (pull_scheduler.py:278-293, push_scheduler.py:281-294)."""
        d: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(self.t.blocks(seq.prompt_tokens))),
            "remote_engine_id": self.engine_id(seq.rank),
            "remote_request_id": seq.rid,
            "remote_host": self.a.host,
            "remote_port": self.a.side_channel_port + seq.rank,
            "tp_size": self.a.tp_size,
            "dcp_size": 1,
            "pp_size": self.a.pp_size,
            "remote_num_tokens": seq.prompt_tokens,
        }
        if self.a.mode == "pull":
            d["remote_blocks_expiry_time"] = time.time() + self.a.lease_seconds
            d["remote_registration_generation"] = 0
        if contract.VllmProtocol(self.a.vllm_version).returns_transfer_mode:  # 0.33.0 on; a peer router learns push from it
            d["transfer_mode"] = self.a.mode
        return d

    def _text(self, seq: Seq, i: int) -> str:
        return f" ??{i}" if seq.wrong else f" tok{seq.start + i}"

    def _chunk(self, seq: Seq, created: int, i: int | None, final: bool, first: bool, ids: bool) -> dict[str, Any]:
        """One streamed event. ``ids`` (the request's ``return_token_ids``): as vLLM's, the prompt's token ids in the
        first event (completions: in its choice; chat: at the top, on the role's event) and each event's own."""
        fr = "length" if final else None
        if seq.kind == "completions":
            choice = {"index": 0, "text": "" if i is None else self._text(seq, i), "logprobs": None, "finish_reason": fr, "stop_reason": None}
            if ids:
                choice["prompt_token_ids"] = seq.token_ids if first else None
                choice["token_ids"] = [] if i is None else [seq.generated_id(i)]
            return {"id": seq.resp_id, "object": "text_completion", "created": created, "model": self.a.served_model_name, "choices": [choice]}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {"content": self._text(seq, i or 0)}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fr}
        if ids and not first:
            choice["token_ids"] = [seq.generated_id(i or 0)]
        out = {"id": seq.resp_id, "object": "chat.completion.chunk", "created": created, "model": self.a.served_model_name, "choices": [choice]}
        if ids and first:
            out["prompt_token_ids"] = seq.token_ids
        return out

    async def respond(
        self, request: web.Request, body: dict[str, Any], seq: Seq, stream: bool, tokens: list[int] | None, kvp: dict[str, Any] | None
    ) -> web.StreamResponse:
        created = int(time.time())
        ids = bool(body.get("return_token_ids"))
        usage = lambda n: {"prompt_tokens": seq.prompt_tokens, "total_tokens": seq.prompt_tokens + n, "completion_tokens": n}  # noqa: E731
        if not stream:
            got: list[int] = []
            if tokens is not None:
                got = tokens
            else:
                while (item := await seq.q.get()) is not None:
                    if isinstance(item, EngineDead):
                        return self._record(seq, error_response(500, str(item), "InternalServerError"))
                    got.append(item)
            text = "".join(self._text(seq, i) for i in got)
            if seq.kind == "completions":
                choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None, "prompt_logprobs": None}
                out = {"id": seq.resp_id, "object": "text_completion", "created": created, "model": self.a.served_model_name, "choices": [choice]}
                if ids:
                    choice["prompt_token_ids"] = seq.token_ids
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": "length", "stop_reason": None}
                out = {"id": seq.resp_id, "object": "chat.completion", "created": created, "model": self.a.served_model_name, "choices": [choice]}
                if ids:
                    out["prompt_token_ids"] = seq.token_ids
            if ids:
                choice["token_ids"] = [seq.generated_id(i) for i in got]
            out["usage"] = usage(len(got))
            out["kv_transfer_params"] = kvp
            self.counters["completed"] += 1
            self.event("finished", xid=seq.xid, rid=seq.rid, tokens=len(got), wrong=seq.wrong)
            return self._record(seq, web.json_response(out))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        sent = bytearray()

        async def send(obj: Any) -> None:
            # pydantic's model_dump_json, as vLLM writes its chunks: compact, UTF-8 as is
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()) + b"\n\n"
            sent.extend(data)
            await resp.write(data)

        n = 0
        it = iter(tokens) if tokens is not None else None
        while True:
            item = (next(it, None) if it is not None else await seq.q.get())
            if item is None:
                break
            if isinstance(item, EngineDead):
                await send(error_body(500, str(item), "InternalServerError"))
                break
            if n == 0 and seq.kind == "chat":
                await send(self._chunk(seq, created, None, False, True, ids))
            n += 1
            await send(self._chunk(seq, created, item, n >= seq.max_tokens, n == 1 and seq.kind == "completions", ids))
        opts = body.get("stream_options") or {}
        if n and isinstance(opts, dict) and opts.get("include_usage"):
            await send({"id": seq.resp_id, "object": "text_completion" if seq.kind == "completions" else "chat.completion.chunk",
                        "created": created, "model": self.a.served_model_name, "choices": [], "usage": usage(n)})
        await send(b"[DONE]")
        await resp.write_eof()
        if self.a.record_bodies:
            self.bodies[seq.xid] = bytes(sent)
        self.counters["completed"] += 1
        self.event("finished", xid=seq.xid, rid=seq.rid, tokens=n, wrong=seq.wrong)
        return resp

    def _record(self, seq: Seq, resp: web.Response) -> web.Response:
        if self.a.record_bodies and resp.body is not None:
            self.bodies[seq.xid] = bytes(resp.body)  # type: ignore[arg-type]
        return resp


def dp_rank_header(value: str | None) -> int | None:
    """X-data-parallel-rank as vLLM reads it: an integer, or nothing (any other value is ignored)."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def dp_ranks(a: argparse.Namespace) -> range:
    """The global ranks one pod serves: [start, start + local), or all of the engine's without a local size
    (vLLM then ignores the start rank)."""
    if a.dp_size_local is None:
        return range(a.dp_size)
    start = a.dp_start_rank or 0
    return range(start, start + a.dp_size_local)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm_sim", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--mode", choices=("push", "pull"), default="push")
    p.add_argument("--host", default="127.0.0.1", help="listen address, also the advertised side-channel host")
    p.add_argument("--http-host", help="the HTTP API's listen address if not --host ('' = every interface, as vLLM "
                                       "without --host: a pod's own preStop reaches it on 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--side-channel-port", type=int, default=5600, help="base port; rank r listens on base+r")
    p.add_argument("--engine-id", required=True)
    p.add_argument("--served-model-name", default="sim-model")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1, help="the engine's data-parallel size, over all its pods")
    p.add_argument("--dp-start-rank", type=int, default=None, help="this pod's first global rank (with --dp-size-local)")
    p.add_argument("--dp-size-local", type=int, default=None, help="ranks this pod serves (unset: all of --dp-size)")
    p.add_argument("--lease-seconds", type=float, default=30.0, help="kv_lease_duration")
    p.add_argument("--num-gpu-blocks", type=int, default=65536, help="KV cache blocks per DP rank (vllm:kv_cache_usage_perc)")
    p.add_argument("--cpu-offload-bytes", type=int, default=0,
                   help="a CPU tier per rank (vLLM's OffloadingConnector cpu_bytes_to_use; its blocks: this / (--kv-bytes-per-token "
                   "x --block-size)); 0: none")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's automatic prefix caching (on by default, as in vLLM)")
    p.add_argument("--prefix-caching-hash-algo", choices=kv_blocks.HASH_ALGOS, default="sha256",
                   help="vLLM's block hash function (its default: sha256); the seed is PYTHONHASHSEED, as in vLLM")
    p.add_argument("--kv-events-config", type=parse_kv_events_config, default=None,
                   help="vLLM's KVEventsConfig as JSON: publish KV cache events over ZMQ")
    p.add_argument("--kv-events-host", default=None,
                   help="simulator only: bind the wildcard (tcp://*:port) KV event endpoints on this address")
    p.add_argument("--push-registration-timeout", type=float, default=480.0)
    p.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail")
    p.add_argument("--compat-hash", default="sim", help="stands for vLLM's NIXL compatibility hash (one per revision)")
    p.add_argument("--watchdog-seconds", type=float, default=5.0, help="vLLM's VLLM_WATCHDOG_TIME_S: a dead engine's server exits by then")
    p.add_argument("--disable-request-id-randomization", action="store_true")
    p.add_argument("--vllm-version", choices=contract.VLLM_VERSIONS, default="0.33.0",
                   help="the release whose answers P gives: transfer_mode in kv_transfer_params from 0.33.0 on "
                   "(the rest of the protocol is 0.33.0's either way)")
    p.add_argument(
        "--push-match",
        choices=("request-id", "transfer-id"),
        default="request-id",
        help="how P pairs a registration with its finished blocks: request-id (vLLM 0.26.0, 0.33.0) or "
        "transfer-id (vLLM main: the router's transfer_id, falling back to the request id)",
    )
    t = Timing()
    p.add_argument("--prefill-us-per-token", type=float, default=t.prefill_us_per_token)
    p.add_argument("--tpot-ms", type=float, default=t.tpot_ms, help="decode engine step = time per output token")
    p.add_argument("--kv-bytes-per-token", type=int, default=t.kv_bytes_per_token)
    p.add_argument("--link-gbps", type=float, default=t.link_gbps)
    p.add_argument("--registration-rtt-ms", type=float, default=t.registration_rtt_ms)
    p.add_argument("--step-ms", type=float, default=t.step_ms, help="P's idle engine step (notification pick-up)")
    p.add_argument("--descriptor-prep-us-per-block", type=float, default=t.descriptor_prep_us_per_block)
    p.add_argument("--block-size", type=int, default=t.block_size)
    p.add_argument("--prefill-base-ms", type=float, default=t.prefill_base_ms, help="fixed part of every prefill (API server, scheduling)")
    p.add_argument("--kv-pickup-ms", type=float, default=t.kv_pickup_ms, help="D notices received KV this much after the last notice")
    p.add_argument("--read-gbps", type=float, default=t.read_gbps, help="D's READ rate in pull (0: --link-gbps)")
    p.add_argument("--pull-pickup-ms", type=float, default=t.pull_pickup_ms, help="D notices a READ's KV this much later (unset: --kv-pickup-ms)")
    p.add_argument("--cpu-restore-gbps", type=float, default=t.cpu_restore_gbps, help="copying KV back from the CPU tier")
    p.add_argument("--intake-us-per-token", type=float, default=t.intake_us_per_token,
                   help="the decode engine's API server takes a prompt in this long per token before its engine sees it")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--record-bodies", action="store_true", help="keep every response's bytes for /sim/body")
    p.add_argument("--log-events", action="store_true")
    p.add_argument(
        "--group-leader", default=None,
        help="a worker pod of an engine that spans pods: the HTTP URL of its leader pod's engine (vLLM's "
        "--data-parallel-address). The ranks of one engine run collectives together: when a pod of the group stops, "
        "every other pod's engine dies with it (see Engine.group_watch)",
    )  # fmt: skip
    p.add_argument("--group-leader-engine-id", default=None,
                   help="with --group-leader: that leader's --engine-id (the incarnation of the group this pod belongs to)")
    return p


async def serve(a: argparse.Namespace) -> int:
    engine = Engine(a)
    engine.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
    # As vLLM starts: the engine core (its NIXL side channel, KV event publishers, loop) is up before the API
    # server listens (serve_http follows build_async_engine_client), so an engine that answers HTTP takes pushes.
    for rank in engine.ranks:
        r = web.AppRunner(engine.side_app(rank), access_log=None, shutdown_timeout=1)
        await r.setup()
        await web.TCPSite(r, a.host, a.side_channel_port + rank, reuse_address=True).start()
        engine.side_runners.append(r)
    if a.kv_events_config is not None and a.kv_events_config.publishes:
        engine.publishers = {rank: KVEventPublisher(a.kv_events_config, rank, a.kv_events_host) for rank in engine.ranks}
    loop_task = asyncio.create_task(engine.loop())
    main = web.AppRunner(engine.http_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1)
    await main.setup()
    http_host = a.host if a.http_host is None else a.http_host
    await web.TCPSite(main, http_host or None, a.port, reuse_address=True, backlog=1024).start()
    if a.group_leader:
        engine.group_task = asyncio.create_task(engine.group_watch())
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, engine.stop.set)
    log.info("vllm_sim %s/%s %s listening on %s:%d (DP ranks %s of %d, side channel %s:%d + rank)", a.role, a.mode,
             a.engine_id, http_host or "*", a.port, list(engine.ranks), a.dp_size, a.host, a.side_channel_port)
    await engine.stop.wait()
    loop_task.cancel()
    if engine.group_task is not None:
        engine.group_task.cancel()
    for r in (main, *engine.side_runners):
        await r.cleanup()
    await engine.session.close()
    for publisher in engine.publishers.values():
        publisher.shutdown()
    if engine.dead:
        log.error("API server exits: the engine is dead (%s)", engine.dead)
    return 1 if engine.dead else 0


def main() -> None:
    parser = build_parser()
    a = parser.parse_args()
    ranks = dp_ranks(a)
    if a.dp_size < 1 or not ranks or ranks.start < 0 or ranks.stop > a.dp_size:
        parser.error(f"data-parallel ranks [{ranks.start}, {ranks.stop}) are not within the engine's {a.dp_size}")
    if bool(a.group_leader) != bool(a.group_leader_engine_id):
        parser.error("--group-leader and --group-leader-engine-id go together: a worker joins one incarnation of its group")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s vllm_sim: %(message)s")
    try:
        import uvloop

        code = uvloop.run(serve(a))
    except ImportError:
        code = asyncio.run(serve(a))
    raise SystemExit(code)
