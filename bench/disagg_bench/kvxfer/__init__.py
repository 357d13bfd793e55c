"""KV-cache transfer between prefill and decode ranks on NIXL: the push and the pull protocol.

* :mod:`.layout` - pure: KV layout, block id -> descriptor mapping, coalescing, TP rank mapping.
* :mod:`.memory` - the KV buffer of one rank, DRAM (numpy) or GPU (torch).
* :mod:`.messages` - the notification wire format.
* :mod:`.endpoint` - a NIXL agent bound to the memory, the peer table (side-channel handshake).
* :mod:`.producer` - prefill side: push rendezvous + background writer; pull serving.
* :mod:`.consumer` - decode side: push registration + completion counting; pull READ, inline or
  on a background thread.

Push, in order (either order of 1 and 2 works)::

    D: tid = consumer.register(rid, d_blocks, ntok, prefill_engine, prefill_tp)   # during prefill
    P: producer.prefill_done(rid, p_blocks, ntok)                                 # returns at once
    P (kvxfer-producer thread): pair, plan, coalesce, WRITE + DONE notification per decode rank
    D: consumer.poll() -> [XferResult(status="ok")] once every prefill rank holding its heads wrote
    P: producer.poll() -> [XferResult(status="ok")]: free the prefill blocks

Pull::

    P: params = producer.prefill_done(rid, p_blocks, ntok, mode="pull")   # relayed by the router
    D: consumer.pull(params, d_blocks); consumer.poll() -> [...]          # READ + read-done notice
"""

from .consumer import KVConsumer
from disagg_connector.nixl_agent import BackendUnavailable, NixlUnavailable, make_agent

from .endpoint import Endpoint, KVXferError, PeerInfo, UnknownPeer, XferResult
from .layout import KVLayout, LayoutMismatch, TransferPlan, coalesce, head_overlap, peer_ranks, plan_transfer
from .memory import KVMemory, pattern
from .producer import KVProducer

__all__ = [
    "BackendUnavailable",
    "Endpoint",
    "KVConsumer",
    "KVLayout",
    "KVMemory",
    "KVProducer",
    "KVXferError",
    "LayoutMismatch",
    "NixlUnavailable",
    "PeerInfo",
    "TransferPlan",
    "UnknownPeer",
    "XferResult",
    "coalesce",
    "head_overlap",
    "make_agent",
    "pattern",
    "peer_ranks",
    "plan_transfer",
]
