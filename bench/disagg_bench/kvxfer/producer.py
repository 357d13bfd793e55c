"""Prefill side: push (rendezvous + background writer) and pull (serve READs, free on read-done).

Threading: the engine's own thread only calls :meth:`KVProducer.prefill_done` (a queue put) and
:meth:`KVProducer.poll` (a queue drain). A background thread, ``kvxfer-producer``, owns all NIXL
work: it receives registrations, pairs them with finished prefills in either order, maps block ids
to descriptors, coalesces them, posts the WRITEs (the last notification of each carries DONE),
watches the handles, counts pull read-done notices and expires leases.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import messages as M
from .endpoint import Endpoint, UnknownPeer, XferResult, now
from .layout import LayoutMismatch, coalesce, peer_ranks, plan_transfer
from .memory import KVMemory


@dataclass
class _Reg:
    rid: str
    tid: str
    engine: str
    rank: int
    tp: int
    blocks: list[int]
    ntok: int
    t_recv: float


@dataclass
class _Entry:
    rid: str
    mode: str = "push"
    blocks: list[int] | None = None  # None until the prefill is done
    ntok: int = 0
    t_pd: float | None = None
    regs: dict[tuple[str, int], _Reg] = field(default_factory=dict)  # by (decode engine, decode rank)
    expected: int | None = None  # decode ranks that will fetch / be written
    served: set[tuple[str, int]] = field(default_factory=set)
    inflight: dict[tuple[str, int], Any] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    t_first: float = 0.0
    nbytes: int = 0
    atoms: int = 0
    descs: int = 0
    worker_s: float = 0.0


class KVProducer(Endpoint):
    role = "prefill"

    def __init__(
        self,
        engine_id: str,
        memory: KVMemory,
        backend: str = "UCX",
        lease_s: float = 30.0,
        coalesce_descs: bool = True,
        max_desc_bytes: int | None = None,
        num_threads: int = 0,
        idle_wait_s: float = 0.0002,
    ) -> None:
        super().__init__(engine_id, memory, backend, num_threads)
        self.lease_s = lease_s
        self.coalesce_descs = coalesce_descs
        self.max_desc_bytes = max_desc_bytes
        self.idle_wait_s = idle_wait_s
        self._inbox: "queue.Queue[tuple]" = queue.Queue()
        self._outbox: "queue.Queue[XferResult]" = queue.Queue()
        self._entries: dict[str, _Entry] = {}
        self._gone: "collections.OrderedDict[str, str]" = collections.OrderedDict()  # rid -> why, for late messages
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-producer", daemon=True)
        self.error: BaseException | None = None
        self.stats = collections.Counter()
        self._thread.start()

    # --- engine-thread API ------------------------------------------------------------------
    def prefill_done(self, request_id: str, block_ids: Sequence[int], num_tokens: int, mode: str = "push") -> dict[str, Any] | None:
        """Hand a finished prefill to the background thread; returns at once.

        push: the KV is written once the decode side's registration is here (or has been).
        pull: returns the parameters the router relays to the decode side.
        The engine may free ``block_ids`` only after :meth:`poll` reports this request.
        """
        if mode not in ("push", "pull"):
            raise ValueError("mode must be push or pull")
        t = now()
        blocks = [int(b) for b in block_ids]
        self._inbox.put(("done", request_id, blocks, int(num_tokens), t, mode))
        if mode == "pull":
            return {
                "request_id": request_id,
                "engine_id": self.engine_id,
                "tp_size": self.layout.tp_size,
                "block_ids": blocks,
                "num_tokens": int(num_tokens),
                "t_prefill_done": t,
            }
        return None

    def poll(self) -> list[XferResult]:
        """Finished requests (sent, expired, failed): their prefill blocks may be freed."""
        out = []
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        super().close()

    # --- background thread ------------------------------------------------------------------
    def _run(self) -> None:
        last_lease = 0.0
        try:
            while not self._stop.is_set():
                busy = self._drain_inbox()
                for sender, msg in self._notifs():
                    busy = True
                    self._on_notif(sender, msg)
                if self._check_inflight():
                    busy = True
                t = now()
                if t - last_lease > 0.005:
                    self._expire(t)
                    last_lease = t
                if not busy:
                    # Nothing to do: wait on the inbox briefly (wakes at once on prefill_done).
                    try:
                        # short wait while requests are pending (a notification may land any
                        # moment), longer when there is nothing at all to pair
                        item = self._inbox.get(timeout=self.idle_wait_s if self._entries else self.idle_wait_s * 10)
                        self._handle_inbox(item)
                    except queue.Empty:
                        pass
        except BaseException as e:  # surfaced through .error and a failed result per request
            self.error = e
            for entry in list(self._entries.values()):
                self._finish(entry, "failed", f"producer thread crashed: {type(e).__name__}: {e}")

    def _drain_inbox(self) -> bool:
        busy = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return busy
            busy = True
            self._handle_inbox(item)

    def _handle_inbox(self, item: tuple) -> None:
        kind = item[0]
        if kind == "done":
            _, rid, blocks, ntok, t, mode = item
            e = self._entries.get(rid)
            if e is None:
                e = self._entries[rid] = _Entry(rid=rid, mode=mode, t_first=t)
            if e.blocks is not None:
                self.stats["duplicate_prefill_done"] += 1
                return
            e.mode, e.blocks, e.ntok, e.t_pd = mode, blocks, ntok, t
            self._gone.pop(rid, None)
            if mode == "push":
                for key in list(e.regs):
                    self._start_write(e, key)

    def _on_notif(self, sender: str, raw: bytes) -> None:
        dec = M.decode(raw)
        if dec is None:
            self.stats["foreign_notifs"] += 1
            return
        kind, p = dec
        if kind == M.REGISTER:
            self._on_register(p)
        elif kind == M.CANCEL:
            self._on_cancel(p)
        elif kind == M.READ_DONE:
            self._on_read_done(p)
        else:
            self.stats["unexpected_notifs"] += 1

    def _reply_failed(self, engine: str, rank: int, tid: str, rid: str, status: str, message: str) -> None:
        try:
            peer = self.peer(engine, rank)
        except UnknownPeer:
            self.stats["reply_to_unknown_peer"] += 1
            return
        msg = M.encode(M.FAILED, {"tid": tid, "rid": rid, "prank": self.layout.tp_rank, "status": status, "message": message})
        try:
            self._send(peer.agent_name, msg)
        except Exception:
            self.stats["notif_send_failed"] += 1

    def _on_register(self, p: dict[str, Any]) -> None:
        reg = _Reg(p["rid"], p["tid"], p["eng"], int(p["rank"]), int(p["tp"]), [int(b) for b in p["blocks"]], int(p["ntok"]), now())
        self.stats["registrations"] += 1
        if reg.rid in self._gone and reg.rid not in self._entries:
            why = self._gone[reg.rid]
            self._reply_failed(reg.engine, reg.rank, reg.tid, reg.rid, "expired", f"prefill rank {self.layout.tp_rank} of {self.engine_id} no longer holds request {reg.rid}: {why}")
            return
        e = self._entries.get(reg.rid)
        if e is None:
            e = self._entries[reg.rid] = _Entry(rid=reg.rid, mode="push", t_first=reg.t_recv)
        key = (reg.engine, reg.rank)
        old = e.regs.get(key)
        if old is not None and old.tid != reg.tid:
            if key in e.inflight or key in e.served:
                self._reply_failed(reg.engine, reg.rank, reg.tid, reg.rid, "failed", f"request {reg.rid} was already pushed to this decode rank under another registration")
                return
            self._reply_failed(old.engine, old.rank, old.tid, old.rid, "cancelled", "superseded by a newer registration")
        e.regs[key] = reg
        try:
            e.expected = len(peer_ranks(self.layout.num_kv_heads, self.layout.tp_size, self.layout.tp_rank, reg.tp))
        except LayoutMismatch as err:
            self._reply_failed(reg.engine, reg.rank, reg.tid, reg.rid, "failed", str(err))
            e.regs.pop(key, None)
            return
        if e.blocks is not None and e.mode == "push":
            self._start_write(e, key)

    def _on_cancel(self, p: dict[str, Any]) -> None:
        rid, tid, key = p["rid"], p["tid"], (p["eng"], int(p["rank"]))
        e = self._entries.get(rid)
        reg = e.regs.get(key) if e else None
        if reg is not None and reg.tid == tid and key not in e.inflight and key not in e.served:
            del e.regs[key]
            self._reply_failed(key[0], key[1], tid, rid, "cancelled", "registration dropped on request")
            self.stats["cancelled"] += 1
            if not e.regs and e.blocks is None:
                del self._entries[rid]
        elif reg is None or reg.tid != tid:
            self._reply_failed(key[0], key[1], tid, rid, "cancelled", "no pending registration")
        # in flight or served: the DONE notification answers the cancel

    def _start_write(self, e: _Entry, key: tuple[str, int]) -> None:
        if key in e.inflight or key in e.served:
            return
        reg = e.regs[key]
        t0 = time.perf_counter()
        if reg.ntok != e.ntok:
            self._fail_reg(e, key, f"token count differs: decode registered {reg.ntok}, prefill produced {e.ntok}")
            return
        try:
            peer = self.peer(reg.engine, reg.rank)
            plan = plan_transfer(self.layout, peer.layout, e.blocks, reg.blocks, e.ntok, self.memory.region_bases, self._peer_bases[key])
            merged = coalesce(plan, self.max_desc_bytes) if self.coalesce_descs else plan
            done = M.encode(
                M.DONE,
                {
                    "tid": reg.tid,
                    "rid": reg.rid,
                    "prank": self.layout.tp_rank,
                    "ptp": self.layout.tp_size,
                    "t_pd": e.t_pd,
                    "bytes": merged.nbytes,
                    "atoms": plan.atoms,
                    "descs": len(merged),
                },
            )
            h, state = self._post("WRITE", merged.descs("src", self.memory.dev_id), merged.descs("dst", peer.dev_id), peer, done)
        except (UnknownPeer, LayoutMismatch) as err:
            self._fail_reg(e, key, str(err))
            return
        except Exception as err:
            self._fail_reg(e, key, f"posting the WRITE failed: {type(err).__name__}: {err}")
            return
        e.worker_s += time.perf_counter() - t0
        e.nbytes += merged.nbytes
        e.atoms += plan.atoms
        e.descs += len(merged)
        if state == "ERR":
            self._release(h)
            self._fail_reg(e, key, "NIXL WRITE failed at post")
            return
        e.inflight[key] = h
        self.stats["writes_posted"] += 1

    def _fail_reg(self, e: _Entry, key: tuple[str, int], message: str) -> None:
        reg = e.regs.get(key)
        if reg is not None:
            self._reply_failed(reg.engine, reg.rank, reg.tid, reg.rid, "failed", message)
        e.failed.append(message)
        e.served.add(key)
        self._maybe_finish(e)

    def _check_inflight(self) -> bool:
        changed = False
        for e in list(self._entries.values()):
            for key, h in list(e.inflight.items()):
                st = self._state(h)
                if st == "PROC":
                    continue
                changed = True
                del e.inflight[key]
                self._release(h)
                if st == "DONE":
                    e.served.add(key)
                    self.stats["writes_done"] += 1
                    self._maybe_finish(e)
                else:
                    self._fail_reg(e, key, "NIXL WRITE failed (transfer error)")
        return changed

    def _maybe_finish(self, e: _Entry) -> None:
        if e.expected is not None and len(e.served) >= e.expected and not e.inflight:
            if e.failed:
                self._finish(e, "failed", "; ".join(e.failed))
            else:
                self._finish(e, "ok", "")

    def _finish(self, e: _Entry, status: str, message: str) -> None:
        self._entries.pop(e.rid, None)
        self._gone[e.rid] = message or status
        while len(self._gone) > 4096:
            self._gone.popitem(last=False)
        self._outbox.put(
            XferResult(
                request_id=e.rid,
                transfer_id=",".join(r.tid for r in e.regs.values()),
                status=status,
                message=message,
                mode=e.mode,
                t_start=e.t_pd or e.t_first,
                t_prefill_done=e.t_pd,
                t_done=now(),
                nbytes=e.nbytes,
                descs_before=e.atoms,
                descs_after=e.descs,
                worker_s=e.worker_s,
            )
        )

    def _on_read_done(self, p: dict[str, Any]) -> None:
        e = self._entries.get(p["rid"])
        if e is None or e.mode != "pull":
            self.stats["stale_read_done"] += 1
            return
        try:
            e.expected = len(peer_ranks(self.layout.num_kv_heads, self.layout.tp_size, self.layout.tp_rank, int(p["tp"])))
        except LayoutMismatch:
            e.expected = 1
        e.served.add((p["eng"], int(p["rank"])))
        e.nbytes += int(p.get("bytes", 0))
        self._maybe_finish(e)

    def _expire(self, t: float) -> None:
        for e in list(self._entries.values()):
            if e.inflight:
                continue
            if e.blocks is not None and e.t_pd is not None and t - e.t_pd > self.lease_s:
                for key, reg in e.regs.items():
                    if key not in e.served:
                        self._reply_failed(reg.engine, reg.rank, reg.tid, reg.rid, "expired", "prefill lease expired")
                if e.mode == "push":
                    msg = f"lease of {self.lease_s:g} s expired: {len(e.served)} of {e.expected or '?'} decode registrations served"
                else:
                    msg = f"lease of {self.lease_s:g} s expired: {len(e.served)} of {e.expected or '?'} decode reads done"
                self._finish(e, "expired", msg)
            elif e.blocks is None and t - e.t_first > self.lease_s:
                for reg in e.regs.values():
                    self._reply_failed(
                        reg.engine,
                        reg.rank,
                        reg.tid,
                        reg.rid,
                        "expired",
                        f"prefill rank {self.layout.tp_rank} of {self.engine_id} held the registration {self.lease_s:g} s and no prefill of request {reg.rid} finished",
                    )
                self._entries.pop(e.rid, None)
                self.stats["registrations_expired"] += 1
