"""Decode side: push (register destination blocks, count DONE notices) and pull (READ).

All methods run on the caller's thread (the decode engine's), except pull with
``prep="background"``: then descriptor preparation, posting and state checks run on the
``kvxfer-pull`` thread and the caller only enqueues and drains results. The time spent in the
caller's thread is accounted per request (``XferResult.caller_s``): the stall a transfer puts on
the decode loop.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import messages as M
from .endpoint import Endpoint, KVXferError, UnknownPeer, XferResult, now
from .layout import LayoutMismatch, coalesce, peer_ranks, plan_transfer
from .memory import KVMemory


@dataclass
class _Recv:
    rid: str
    tid: str
    mode: str
    prefill_engine: str
    ranks: list[int]  # prefill ranks expected to answer
    deadline: float
    t_start: float
    answered: dict[int, str] = field(default_factory=dict)  # prefill rank -> status
    messages: list[str] = field(default_factory=list)
    t_pd: float | None = None
    nbytes: int = 0
    atoms: int = 0
    descs: int = 0
    caller_s: float = 0.0
    setup_s: float = 0.0
    worker_s: float = 0.0
    handles: dict[int, Any] = field(default_factory=dict)  # pull: prefill rank -> xfer handle
    cancelled: bool = False


class KVConsumer(Endpoint):
    role = "decode"

    def __init__(
        self,
        engine_id: str,
        memory: KVMemory,
        backend: str = "UCX",
        prep: str = "inline",
        coalesce_descs: bool = True,
        max_desc_bytes: int | None = None,
        default_deadline_s: float = 480.0,
        num_threads: int = 0,
        reg_send: str = "background",
    ) -> None:
        if prep not in ("inline", "background"):
            raise ValueError("prep must be inline or background")
        if reg_send not in ("inline", "background"):
            raise ValueError("reg_send must be inline or background")
        super().__init__(engine_id, memory, backend, num_threads)
        self.reg_send = reg_send
        self.prep = prep
        self.coalesce_descs = coalesce_descs
        self.max_desc_bytes = max_desc_bytes
        self.default_deadline_s = default_deadline_s
        self._recvs: dict[str, _Recv] = {}  # by transfer id
        self._tid_prefix = uuid.uuid4().hex[:12] + "-"
        self._tid_seq = itertools.count(1)
        self._target_cache: dict[tuple[str, int], list[tuple[int, str]]] = {}
        self._by_rid: dict[str, str] = {}  # request id -> live transfer id
        self._done: list[XferResult] = []
        self.stale_notifs = 0
        self.poll_calls = 0
        self.poll_base_s = 0.0
        self._bg_in: "queue.Queue[_Recv]" = queue.Queue()
        self._bg_out: "queue.Queue[tuple[str, int, str, str]]" = queue.Queue()
        self._bg_stop = threading.Event()
        self._bg_finished: set[str] = set()
        self._bg: threading.Thread | None = None
        if prep == "background":
            self._bg = threading.Thread(target=self._bg_run, name="kvxfer-pull", daemon=True)
            self._bg.start()
        # push registrations leave through a sender thread (blocking queue: idle costs nothing),
        # so the decode thread only encodes and enqueues; send errors come back through poll()
        self._send_q: "queue.Queue[tuple[str, int, str, bytes] | None]" = queue.Queue()
        self._send_err: "queue.Queue[tuple[str, int, str]]" = queue.Queue()
        self._sender: threading.Thread | None = None
        if reg_send == "background":
            self._sender = threading.Thread(target=self._send_run, name="kvxfer-reg-send", daemon=True)
            self._sender.start()

    # --- push ---------------------------------------------------------------------------------
    def register(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        prefill_engine: str,
        prefill_tp: int,
        deadline_s: float | None = None,
    ) -> str:
        """Tell the prefill ranks where to write this request's KV; returns the transfer id.

        Sent while the prefill is still running. The request is received once every prefill rank
        that holds some of this rank's KV heads has sent DONE; :meth:`poll` reports it.
        """
        t0 = time.perf_counter()
        if request_id in self._by_rid:
            raise KVXferError(f"request {request_id!r} already has a live transfer; a retry needs a fresh request id")
        targets = self._targets(prefill_engine, prefill_tp)  # UnknownPeer before anything is sent
        tid = self._new_tid()
        t = now()
        rec = _Recv(request_id, tid, "push", prefill_engine, [r for r, _ in targets], t + (deadline_s or self.default_deadline_s), t)
        payload = {
            "rid": request_id,
            "tid": tid,
            "eng": self.engine_id,
            "rank": self.layout.tp_rank,
            "tp": self.layout.tp_size,
            "blocks": list(block_ids),
            "ntok": int(num_tokens),
        }
        self._recvs[tid] = rec
        self._by_rid[request_id] = tid
        if self._sender is not None:
            # encoding and sending happen on the sender thread; the decode thread only enqueues
            self._send_q.put((tid, targets, M.REGISTER, payload))
        else:
            msg = M.encode(M.REGISTER, payload)
            for rank, name in targets:
                err = self._send_reg(name, msg)
                if err:
                    self._reg_failed(rec, rank, err)
        rec.setup_s = time.perf_counter() - t0
        rec.caller_s += rec.setup_s
        return tid

    def add_peer(self, peer: Any, connect: bool = False) -> Any:
        info = super().add_peer(peer, connect)
        self._target_cache.clear()  # a re-handshaken peer has a new agent name
        return info

    def _send_reg(self, agent_name: str, msg: bytes) -> str:
        try:
            self._send(agent_name, msg)
            return ""
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def _reg_failed(self, rec: _Recv, rank: int, err: str) -> None:
        rec.answered[rank] = "failed"
        rec.messages.append(f"registration to prefill rank {rank} of {rec.prefill_engine} could not be sent (prefill engine unreachable or gone): {err}")

    def _send_run(self) -> None:
        while True:
            item = self._send_q.get()
            if item is None:
                return
            tid, targets, kind, payload = item
            payload["blocks"] = [int(b) for b in payload.get("blocks", ())]
            msg = M.encode(kind, payload)
            for rank, name in targets:
                err = self._send_reg(name, msg)
                if err:
                    self._send_err.put((tid, rank, err))

    def _targets(self, prefill_engine: str, prefill_tp: int) -> list[tuple[int, str]]:
        """(prefill rank, agent name) of the ranks holding this rank's heads; cached per engine."""
        key = (prefill_engine, prefill_tp)
        hit = self._target_cache.get(key)
        if hit is None:
            ranks = peer_ranks(self.layout.num_kv_heads, self.layout.tp_size, self.layout.tp_rank, prefill_tp)
            hit = [(r, self.peer(prefill_engine, r).agent_name) for r in ranks]
            self._target_cache[key] = hit
        return hit

    def _new_tid(self) -> str:
        # unique per attempt: a random per-endpoint prefix and a counter (cheaper than uuid4)
        return f"{self._tid_prefix}{next(self._tid_seq):x}"

    def cancel(self, request_id: str) -> None:
        """Abort: ask the prefill ranks to drop the registration. The request is reported
        (``cancelled``) once every rank answered or the deadline passed; only then may the
        decode engine reuse the blocks (a WRITE may be in flight until then)."""
        tid = self._by_rid.get(request_id)
        if tid is None:
            return
        rec = self._recvs[tid]
        rec.cancelled = True
        if rec.mode == "push":
            msg = M.encode(M.CANCEL, {"rid": rec.rid, "tid": tid, "eng": self.engine_id, "rank": self.layout.tp_rank})
            for r in rec.ranks:
                if r not in rec.answered:
                    name = self.peer(rec.prefill_engine, r).agent_name
                    if self._sender is not None:  # same queue as the registration: order kept
                        self._send_q.put((tid, [(r, name)], M.CANCEL, {"rid": rec.rid, "tid": tid, "eng": self.engine_id, "rank": self.layout.tp_rank}))
                    elif self._send_reg(name, msg):
                        rec.answered[r] = "cancelled"

    # --- pull ---------------------------------------------------------------------------------
    def pull(self, params: dict[str, Any], block_ids: Sequence[int], deadline_s: float | None = None) -> str:
        """Start reading a request's KV from the prefill ranks named in ``params`` (what
        :meth:`KVProducer.prefill_done` returned, relayed by the router)."""
        t0 = time.perf_counter()
        rid = params["request_id"]
        if rid in self._by_rid:
            raise KVXferError(f"request {rid!r} already has a live transfer; a retry needs a fresh request id")
        ranks = peer_ranks(self.layout.num_kv_heads, self.layout.tp_size, self.layout.tp_rank, int(params["tp_size"]))
        tid = self._new_tid()
        t = now()
        rec = _Recv(rid, tid, "pull", params["engine_id"], ranks, t + (deadline_s or self.default_deadline_s), t)
        rec.t_pd = params.get("t_prefill_done")
        self._recvs[tid] = rec
        self._by_rid[rid] = tid
        job = (rec, params["block_ids"], list(block_ids), int(params["num_tokens"]))
        if self.prep == "inline":
            self._post_reads(*job)
        else:
            self._bg_in.put(job)
        rec.setup_s = time.perf_counter() - t0
        rec.caller_s += rec.setup_s
        return tid

    def _post_reads(self, rec: _Recv, src_blocks: Sequence[int], dst_blocks: Sequence[int], ntok: int) -> list[tuple[int, str, str]]:
        """Plan, coalesce and post one READ per prefill rank; returns immediate failures."""
        fails = []
        for r in rec.ranks:
            try:
                peer = self.peer(rec.prefill_engine, r)
                plan = plan_transfer(peer.layout, self.layout, src_blocks, dst_blocks, ntok, self._peer_bases[(peer.engine_id, r)], self.memory.region_bases)
                merged = coalesce(plan, self.max_desc_bytes) if self.coalesce_descs else plan
                notif = M.encode(M.READ_DONE, {"rid": rec.rid, "tid": rec.tid, "eng": self.engine_id, "rank": self.layout.tp_rank, "tp": self.layout.tp_size, "bytes": merged.nbytes})
                h, state = self._post("READ", merged.descs("dst", self.memory.dev_id), merged.descs("src", peer.dev_id), peer, notif)
            except (UnknownPeer, LayoutMismatch) as e:
                fails.append((r, "failed", str(e)))
                continue
            except Exception as e:
                fails.append((r, "failed", f"posting the READ failed: {type(e).__name__}: {e}"))
                continue
            rec.nbytes += merged.nbytes
            rec.atoms += plan.atoms
            rec.descs += len(merged)
            if state == "ERR":
                self._release(h)
                fails.append((r, "failed", "NIXL READ failed at post"))
            else:
                rec.handles[r] = h
        for r, st, m in fails:
            rec.answered[r] = st
            rec.messages.append(m)
        return fails

    def _check_reads(self, rec: _Recv) -> None:
        for r, h in list(rec.handles.items()):
            st = self._state(h)
            if st == "PROC":
                continue
            del rec.handles[r]
            self._release(h)
            if st == "DONE":
                rec.answered[r] = "ok"
            else:
                rec.answered[r] = "failed"
                rec.messages.append(f"NIXL READ from prefill rank {r} failed")

    def _bg_run(self) -> None:
        live: list[_Recv] = []
        while not self._bg_stop.is_set():
            try:
                job = self._bg_in.get(timeout=0.0002 if live else 0.01)
                t0 = time.perf_counter()
                self._post_reads(*job)
                job[0].worker_s += time.perf_counter() - t0
                live.append(job[0])
            except queue.Empty:
                pass
            for rec in list(live):
                self._check_reads(rec)
                if len(rec.answered) >= len(rec.ranks) or rec.cancelled or now() > rec.deadline:
                    live.remove(rec)
                    self._bg_out.put((rec.tid, 0, "", ""))  # wake the caller's poll

    # --- both ---------------------------------------------------------------------------------
    def poll(self) -> list[XferResult]:
        """Process notifications and transfer states; return requests that finished (any status).

        Accounting: the fixed cost of asking NIXL for notifications once per call is the engine
        step's overhead (``poll_calls``/``poll_base_s``, the same in push and pull); the work done
        for a request (its notices, its transfer-state checks) is added to that request.
        """
        t0 = time.perf_counter()
        notifs = self._notifs()
        t1 = time.perf_counter()
        self.poll_calls += 1
        self.poll_base_s += t1 - t0
        while True:
            try:
                tid, rank, err = self._send_err.get_nowait()
            except queue.Empty:
                break
            rec = self._recvs.get(tid)
            if rec is not None and rank not in rec.answered:
                self._reg_failed(rec, rank, err)
        for sender, raw in notifs:
            ts = time.perf_counter()
            dec = M.decode(raw)
            if dec is None:
                self.stale_notifs += 1
                continue
            kind, p = dec
            rec = self._recvs.get(p.get("tid", ""))
            if rec is None or rec.rid != p.get("rid"):
                self.stale_notifs += 1  # a stale attempt's notice never completes a new one
                continue
            rank = int(p.get("prank", -1))
            if rank not in rec.ranks or rank in rec.answered:
                self.stale_notifs += 1
                continue
            if kind == M.DONE:
                rec.answered[rank] = "ok"
                rec.nbytes += int(p.get("bytes", 0))
                rec.atoms += int(p.get("atoms", 0))
                rec.descs += int(p.get("descs", 0))
                if p.get("t_pd") is not None:
                    rec.t_pd = p["t_pd"] if rec.t_pd is None else min(rec.t_pd, p["t_pd"])
            elif kind == M.FAILED:
                rec.answered[rank] = p.get("status", "failed")
                rec.messages.append(f"prefill rank {rank}: {p.get('message', '')}")
            rec.caller_s += time.perf_counter() - ts
        if self.prep == "inline":
            for rec in self._recvs.values():
                if rec.mode == "pull" and rec.handles:
                    ts = time.perf_counter()
                    self._check_reads(rec)
                    rec.caller_s += time.perf_counter() - ts
        else:
            while True:
                try:
                    self._bg_finished.add(self._bg_out.get_nowait()[0])
                except queue.Empty:
                    break
        t = now()
        finished: list[_Recv] = []
        for rec in list(self._recvs.values()):
            if rec.mode == "pull" and self.prep == "background":
                # the pull thread owns this record until it hands it back
                if rec.tid in self._bg_finished:
                    self._bg_finished.discard(rec.tid)
                    finished.append(rec)
                continue
            if rec.mode == "pull" and rec.handles:
                if t > rec.deadline:
                    finished.append(rec)
                continue
            if len(rec.answered) >= len(rec.ranks) or t > rec.deadline:
                finished.append(rec)
        return [self._finish(rec, t) for rec in finished]

    def _finish(self, rec: _Recv, t: float) -> XferResult:
        self._recvs.pop(rec.tid, None)
        if self._by_rid.get(rec.rid) == rec.tid:
            del self._by_rid[rec.rid]
        missing = [r for r in rec.ranks if r not in rec.answered]
        statuses = set(rec.answered.values())
        for h in rec.handles.values():
            self._release(h)
        if rec.cancelled:
            status, msg = "cancelled", "cancelled by the decode side" + (f"; no answer from prefill ranks {missing}" if missing else "")
        elif missing:
            status = "timeout"
            if rec.mode == "push":
                msg = (
                    f"no completion from prefill ranks {missing} of {rec.prefill_engine} within "
                    f"{rec.deadline - rec.t_start:.3g} s of registering request {rec.rid} "
                    "(prefill engine dead or unreachable, or it never ran this request)"
                )
            else:
                msg = f"READ of request {rec.rid} from prefill ranks {missing} of {rec.prefill_engine} did not finish within {rec.deadline - rec.t_start:.3g} s"
            if rec.messages:
                msg += "; " + "; ".join(rec.messages)
        elif statuses == {"ok"}:
            status, msg = "ok", ""
        elif "failed" in statuses:
            status, msg = "failed", "; ".join(rec.messages)
        elif "expired" in statuses:
            status, msg = "expired", "; ".join(rec.messages)
        else:
            status, msg = sorted(statuses - {"ok"})[0], "; ".join(rec.messages)
        return XferResult(
            request_id=rec.rid,
            transfer_id=rec.tid,
            status=status,
            message=msg,
            mode=rec.mode if rec.mode == "push" else f"pull-{self.prep}",
            t_start=rec.t_start,
            t_prefill_done=rec.t_pd,
            t_done=t,
            nbytes=rec.nbytes,
            descs_before=rec.atoms,
            descs_after=rec.descs,
            caller_s=rec.caller_s,
            caller_setup_s=rec.setup_s,
            worker_s=rec.worker_s,
        )

    def wait(self, transfer_ids: Sequence[str], timeout_s: float, idle_s: float = 0.0005) -> dict[str, XferResult]:
        """Poll until all ``transfer_ids`` finished (or ``timeout_s``); convenience for tests/tools."""
        want = set(transfer_ids)
        got: dict[str, XferResult] = {}
        end = now() + timeout_s
        while want - set(got) and now() < end:
            for r in self.poll():
                got[r.transfer_id] = r
            time.sleep(idle_s)
        return got

    def close(self) -> None:
        self._send_q.put(None)
        if self._sender is not None and self._sender.is_alive():
            self._sender.join(5)
        self._bg_stop.set()
        if self._bg is not None and self._bg.is_alive():
            self._bg.join(5)
        super().close()
