"""A NIXL agent bound to one rank's KV memory, and the peer table both protocols use."""

from __future__ import annotations

import base64
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from disagg_connector.nixl_agent import BACKENDS, make_agent

from . import messages
from .layout import KVLayout
from .memory import KVMemory

class KVXferError(RuntimeError):
    """Base error of the KV transfer engine."""


class UnknownPeer(KVXferError):
    pass


@dataclass
class PeerInfo:
    """What a peer rank needs to address this rank: exchanged once over the side channel."""

    engine_id: str
    role: str  # "prefill" | "decode"
    layout: KVLayout
    agent_name: str
    agent_md: bytes
    region_bases: list[int]
    mem_type: str
    dev_id: int

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    def pack(self) -> bytes:
        return messages.pack_obj(
            {
                "engine_id": self.engine_id,
                "role": self.role,
                "layout": self.layout.to_dict(),
                "agent_name": self.agent_name,
                "agent_md": base64.b64encode(self.agent_md).decode(),
                "region_bases": [int(x) for x in self.region_bases],
                "mem_type": self.mem_type,
                "dev_id": self.dev_id,
            }
        )

    @classmethod
    def unpack(cls, blob: bytes) -> "PeerInfo":
        d = messages.unpack_obj(blob)
        return cls(
            engine_id=d["engine_id"],
            role=d["role"],
            layout=KVLayout.from_dict(d["layout"]),
            agent_name=d["agent_name"],
            agent_md=base64.b64decode(d["agent_md"]),
            region_bases=list(d["region_bases"]),
            mem_type=d["mem_type"],
            dev_id=int(d["dev_id"]),
        )


@dataclass
class XferResult:
    """Outcome of one request's transfer as one side saw it. Times are time.monotonic() seconds."""

    request_id: str
    transfer_id: str
    status: str  # ok | expired | timeout | failed | cancelled
    message: str = ""
    mode: str = "push"
    t_start: float = 0.0  # consumer: registration/pull start; producer: prefill done
    t_prefill_done: float | None = None
    t_done: float = 0.0
    nbytes: int = 0
    descs_before: int = 0
    descs_after: int = 0
    caller_s: float = 0.0  # time the owner's (engine) thread spent on this request, all told
    caller_setup_s: float = 0.0  # ... of which in register()/pull() (the rest: its share of poll())
    worker_s: float = 0.0  # time a background thread spent on it (prep + post)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Endpoint:
    """One rank: a NIXL agent, its registered KV memory and the peers it knows."""

    role = "?"

    def __init__(self, engine_id: str, memory: KVMemory, backend: str = "UCX", num_threads: int = 0, progress_thread: bool = False) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.engine_id = engine_id
        self.memory = memory
        self.layout = memory.layout
        self.backend = backend
        self.agent_name = f"{engine_id}:{self.role}:tp{self.layout.tp_rank}:{uuid.uuid4().hex[:8]}"
        self.agent = make_agent(self.agent_name, backend, num_threads, progress_thread)
        self._lock = threading.RLock()  # serialises calls into the agent across threads
        self._reg = self.agent.register_memory(memory.reg_descs(), memory.mem_type, backends=[backend])
        self.peers: dict[tuple[str, int], PeerInfo] = {}
        self._peer_bases: dict[tuple[str, int], np.ndarray] = {}
        self._closed = False

    def info(self) -> PeerInfo:
        with self._lock:
            md = self.agent.get_agent_metadata()
        return PeerInfo(
            engine_id=self.engine_id,
            role=self.role,
            layout=self.layout,
            agent_name=self.agent_name,
            agent_md=bytes(md),
            region_bases=[int(x) for x in self.memory.region_bases],
            mem_type=self.memory.mem_type,
            dev_id=self.memory.dev_id,
        )

    def info_blob(self) -> bytes:
        return self.info().pack()

    def add_peer(self, peer: PeerInfo | bytes, connect: bool = False) -> PeerInfo:
        if isinstance(peer, (bytes, bytearray)):
            peer = PeerInfo.unpack(bytes(peer))
        with self._lock:
            name = self.agent.add_remote_agent(peer.agent_md)
            name = name.decode() if isinstance(name, bytes) else name
            if name != peer.agent_name:
                raise KVXferError(f"peer metadata names agent {name!r}, expected {peer.agent_name!r}")
            if connect:
                self.agent.make_connection(peer.agent_name)
        key = (peer.engine_id, peer.tp_rank)
        self.peers[key] = peer
        self._peer_bases[key] = np.asarray(peer.region_bases, dtype=np.int64)
        return peer

    def peer(self, engine_id: str, rank: int) -> PeerInfo:
        try:
            return self.peers[(engine_id, rank)]
        except KeyError:
            raise UnknownPeer(f"no handshake with engine {engine_id!r} rank {rank}") from None

    def _send(self, agent_name: str, msg: bytes) -> None:
        with self._lock:
            self.agent.send_notif(agent_name, msg)

    def _notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            got = self.agent.get_new_notifs()
        out: list[tuple[str, bytes]] = []
        for sender, msgs in got.items():
            for m in msgs:
                out.append((sender, m))
        return out

    def _post(self, op: str, plan_local: np.ndarray, plan_remote: np.ndarray, peer: PeerInfo, notif: bytes) -> tuple[Any, str]:
        """Create and post one transfer; returns (handle, state)."""
        with self._lock:
            local = self.agent.get_xfer_descs(plan_local, self.memory.mem_type)
            remote = self.agent.get_xfer_descs(plan_remote, peer.mem_type)
            h = self.agent.initialize_xfer(op, local, remote, peer.agent_name, notif, backends=[self.backend])
            state = self.agent.transfer(h)
        return h, state

    def _state(self, handle: Any) -> str:
        with self._lock:
            return self.agent.check_xfer_state(handle)

    def _release(self, handle: Any) -> None:
        try:
            with self._lock:
                handle.release()
        except Exception:
            pass  # an in-flight transfer that cannot be aborted stays on the agent's leak list

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            try:
                self.agent.deregister_memory(self._reg, backends=[self.backend])
            except Exception:
                pass


def now() -> float:
    return time.monotonic()
