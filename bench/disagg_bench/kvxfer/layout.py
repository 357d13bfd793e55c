"""KV-cache layout and the pure block-id -> descriptor mapping, with coalescing.

Nothing here touches NIXL or a device: everything is numpy arithmetic over byte addresses, so the
whole mapping (different block sizes, tensor-parallel head slicing, coalescing) is unit-testable by
applying the descriptors to plain byte buffers.

Memory model of one rank (the same as vLLM's NIXL connectors for non-MLA attention):

* the KV cache is ``2 * num_layers`` *regions* (layer-major, K then V), each holding
  ``num_blocks`` blocks of ``block_bytes``; ``region_bases[r]`` is where region ``r`` starts
  (absolute address, or an offset into a test buffer);
* a block holds ``block_size`` tokens of this rank's KV heads ``[head_start, head_start +
  heads_per_rank)``, each token-head vector being ``head_dim * dtype_bytes`` bytes;
* inside a block the order is ``HND`` (head-major: a head's tokens are contiguous; vLLM forces this
  for NIXL) or ``NHD`` (token-major).

A transfer moves tokens ``[0, num_tokens)`` of one request for the KV heads that both ranks hold
(rounded up to whole ``gcd(src_block, dst_block)``-token chunks, which both sides have allocated).
Each side maps the token position to its own block ids and block size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Literal, Sequence

import numpy as np

KVOrder = Literal["HND", "NHD"]

__all__ = [
    "KVLayout",
    "LayoutMismatch",
    "TransferPlan",
    "check_compatible",
    "coalesce",
    "head_overlap",
    "peer_ranks",
    "plan_transfer",
    "token_offsets",
]


class LayoutMismatch(ValueError):
    """The two sides' KV caches cannot exchange blocks (different model shape, bad TP split...)."""


@dataclass(frozen=True)
class KVLayout:
    """Shape of one tensor-parallel rank's paged KV cache."""

    num_layers: int
    num_kv_heads: int  # the model's KV heads, all ranks together
    head_dim: int
    dtype_bytes: int
    block_size: int  # tokens per block
    num_blocks: int  # blocks per region on this rank
    tp_size: int = 1
    tp_rank: int = 0
    kv_order: KVOrder = "HND"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "block_size", "num_blocks", "tp_size"):
            if int(getattr(self, name)) < 1:
                raise LayoutMismatch(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutMismatch(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.num_kv_heads % self.tp_size:
            raise LayoutMismatch(
                f"{self.num_kv_heads} KV heads do not split evenly over tensor-parallel size {self.tp_size}; "
                "use a TP size that divides the KV head count"
            )
        if self.kv_order not in ("HND", "NHD"):
            raise LayoutMismatch(f"kv_order must be HND or NHD, got {self.kv_order!r}")

    # --- derived sizes ------------------------------------------------------------------------
    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def head_start(self) -> int:
        return self.tp_rank * self.heads_per_rank

    @property
    def head_bytes(self) -> int:
        """Bytes of one token of one KV head (K or V)."""
        return self.head_dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token for this rank's heads, K or V, one layer."""
        return self.heads_per_rank * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def num_regions(self) -> int:
        return 2 * self.num_layers

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_regions * self.region_bytes

    def blocks_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.block_size)

    def contiguous_region_bases(self, base: int = 0) -> np.ndarray:
        """Region bases when all regions lie back to back in one buffer starting at ``base``."""
        return base + np.arange(self.num_regions, dtype=np.int64) * self.region_bytes

    def with_rank(self, tp_rank: int) -> "KVLayout":
        return KVLayout(**{**asdict(self), "tp_rank": tp_rank})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise LayoutMismatch unless blocks of ``src`` can be written into ``dst``."""
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise LayoutMismatch(f"{name} differs between the two sides ({a} vs {b}): both must serve the same model and dtype")


def head_overlap(a: KVLayout, b: KVLayout) -> tuple[int, int] | None:
    """Global KV-head range [h0, h1) held by both ranks, or None."""
    h0 = max(a.head_start, b.head_start)
    h1 = min(a.head_start + a.heads_per_rank, b.head_start + b.heads_per_rank)
    return (h0, h1) if h1 > h0 else None


def peer_ranks(num_kv_heads: int, local_tp: int, local_rank: int, remote_tp: int) -> list[int]:
    """Ranks of the other side whose KV heads overlap this rank's (TP 2->1, 1->2, ... mappings)."""
    if num_kv_heads % local_tp or num_kv_heads % remote_tp:
        raise LayoutMismatch(f"{num_kv_heads} KV heads do not split over TP {local_tp} and {remote_tp}")
    lo = local_rank * (num_kv_heads // local_tp)
    hi = lo + num_kv_heads // local_tp
    per = num_kv_heads // remote_tp
    return [r for r in range(remote_tp) if r * per < hi and (r + 1) * per > lo]


def _offset_in_block(layout: KVLayout, token: np.ndarray, head_local: np.ndarray) -> np.ndarray:
    if layout.kv_order == "HND":
        return (head_local * layout.block_size + token) * layout.head_bytes
    return (token * layout.heads_per_rank + head_local) * layout.head_bytes


def _contiguous(layout: KVLayout, tokens: int, heads: int) -> bool:
    """Is an atom of ``tokens`` consecutive tokens (inside one block) x ``heads`` consecutive heads contiguous?"""
    if layout.kv_order == "HND":
        return heads == 1 or tokens == layout.block_size
    return tokens == 1 or heads == layout.heads_per_rank


def token_offsets(layout: KVLayout, block_ids: Sequence[int], num_tokens: int, region_bases: np.ndarray | None = None) -> np.ndarray:
    """Byte address of every (region, local head, token) vector of one request: shape (R, H, T).

    The reference for what lives where; tests use it to gather and scatter whole requests.
    """
    bases = layout.contiguous_region_bases() if region_bases is None else np.asarray(region_bases, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    t = np.arange(num_tokens, dtype=np.int64)
    if blocks.size * layout.block_size < num_tokens:
        raise LayoutMismatch(f"{blocks.size} blocks of {layout.block_size} tokens cannot hold {num_tokens} tokens")
    h = np.arange(layout.heads_per_rank, dtype=np.int64)
    within = _offset_in_block(layout, (t % layout.block_size)[None, :], h[:, None])  # (H, T)
    blk = blocks[t // layout.block_size] * layout.block_bytes  # (T,)
    return bases[:, None, None] + blk[None, None, :] + within[None, :, :]


@dataclass
class TransferPlan:
    """Paired descriptors: copy ``length[i]`` bytes from ``src_addr[i]`` to ``dst_addr[i]``."""

    src_addr: np.ndarray  # uint64
    dst_addr: np.ndarray  # uint64
    length: np.ndarray  # uint64
    atoms: int = 0  # descriptors before coalescing (per block, per region: what a naive engine issues)
    atom_tokens: int = 0
    atom_heads: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum()) if self.length.size else 0

    def descs(self, side: Literal["src", "dst"], dev_id: int) -> np.ndarray:
        """Nx3 uint64 (addr, len, dev) array as nixl's get_xfer_descs takes it."""
        addr = self.src_addr if side == "src" else self.dst_addr
        out = np.empty((addr.size, 3), dtype=np.uint64)
        out[:, 0] = addr
        out[:, 1] = self.length
        out[:, 2] = dev_id
        return out


def plan_transfer(
    src: KVLayout,
    dst: KVLayout,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    num_tokens: int,
    src_bases: np.ndarray | None = None,
    dst_bases: np.ndarray | None = None,
) -> TransferPlan:
    """Per-block descriptors that move one request's KV from rank ``src`` to rank ``dst``.

    Only the heads both ranks hold are moved. Each descriptor ("atom") is a run of tokens x heads
    that is contiguous on both sides: a whole block when block sizes and head slices line up,
    smaller pieces otherwise. Call :func:`coalesce` to merge runs adjacent on both sides.
    """
    check_compatible(src, dst)
    ov = head_overlap(src, dst)
    if ov is None or num_tokens <= 0:
        e = np.zeros(0, dtype=np.uint64)
        return TransferPlan(e, e.copy(), e.copy())
    h0, h1 = ov
    nh = h1 - h0
    g = math.gcd(src.block_size, dst.block_size)
    ntok = -(-int(num_tokens) // g) * g
    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    if sb.size * src.block_size < ntok:
        raise LayoutMismatch(f"source has {sb.size} blocks of {src.block_size} tokens for {num_tokens} tokens")
    if db.size * dst.block_size < ntok:
        raise LayoutMismatch(f"destination has {db.size} blocks of {dst.block_size} tokens for {num_tokens} tokens")
    if sb.size and (sb.min() < 0 or sb.max() >= src.num_blocks):
        raise LayoutMismatch(f"source block id out of range [0, {src.num_blocks})")
    if db.size and (db.min() < 0 or db.max() >= dst.num_blocks):
        raise LayoutMismatch(f"destination block id out of range [0, {dst.num_blocks})")

    # Pick the largest atom shape (tokens x heads) that is contiguous on both sides.
    candidates = [(g, nh), (g, 1), (1, nh), (1, 1)]
    valid = [(t, h) for t, h in candidates if _contiguous(src, t, h) and _contiguous(dst, t, h)]
    T, H = min(valid, key=lambda th: (ntok // th[0]) * (nh // th[1]))

    sbase = src.contiguous_region_bases() if src_bases is None else np.asarray(src_bases, dtype=np.int64)
    dbase = dst.contiguous_region_bases() if dst_bases is None else np.asarray(dst_bases, dtype=np.int64)
    if sbase.size != src.num_regions or dbase.size != dst.num_regions:
        raise LayoutMismatch("region base list does not match 2 * num_layers")

    t = np.arange(0, ntok, T, dtype=np.int64)  # first token of each atom
    h = np.arange(h0, h1, H, dtype=np.int64)  # first global head of each atom

    def addrs(lay: KVLayout, blocks: np.ndarray, bases: np.ndarray) -> np.ndarray:
        within = _offset_in_block(lay, (t % lay.block_size)[:, None], (h - lay.head_start)[None, :])  # (nT, nH)
        blk = (blocks[t // lay.block_size] * lay.block_bytes)[:, None]
        return (bases[:, None, None] + (blk + within)[None, :, :]).reshape(-1)

    src_addr = addrs(src, sb, sbase)
    dst_addr = addrs(dst, db, dbase)
    length = np.full(src_addr.size, T * H * src.head_bytes, dtype=np.uint64)
    return TransferPlan(
        src_addr.astype(np.uint64),
        dst_addr.astype(np.uint64),
        length,
        atoms=int(src_addr.size),
        atom_tokens=T,
        atom_heads=H,
        meta={"heads": (h0, h1), "tokens": ntok},
    )


def coalesce(plan: TransferPlan, max_bytes: int | None = None) -> TransferPlan:
    """Merge descriptors that are adjacent on both sides into one (sorted by source address).

    ``max_bytes`` caps a merged descriptor (None: no cap). The result moves the same bytes.
    """
    n = len(plan)
    if n == 0:
        return TransferPlan(plan.src_addr, plan.dst_addr, plan.length, plan.atoms, plan.atom_tokens, plan.atom_heads, dict(plan.meta))
    order = np.argsort(plan.src_addr, kind="stable")
    s = plan.src_addr[order].astype(np.int64)
    d = plan.dst_addr[order].astype(np.int64)
    ln = plan.length[order].astype(np.int64)
    joins = np.zeros(n, dtype=bool)
    joins[1:] = (s[:-1] + ln[:-1] == s[1:]) & (d[:-1] + ln[:-1] == d[1:])
    if max_bytes is None:
        starts = np.flatnonzero(~joins)
        lengths = np.add.reduceat(ln, starts)
        out_s, out_d, out_l = s[starts], d[starts], lengths
    else:
        # Greedy split of each run at max_bytes (python loop over runs only).
        out_s_l: list[int] = []
        out_d_l: list[int] = []
        out_l_l: list[int] = []
        for i in range(n):
            if joins[i] and out_l_l[-1] + ln[i] <= max_bytes:
                out_l_l[-1] += int(ln[i])
            else:
                out_s_l.append(int(s[i]))
                out_d_l.append(int(d[i]))
                out_l_l.append(int(ln[i]))
        out_s, out_d, out_l = np.array(out_s_l), np.array(out_d_l), np.array(out_l_l)
    return TransferPlan(
        out_s.astype(np.uint64),
        out_d.astype(np.uint64),
        out_l.astype(np.uint64),
        atoms=plan.atoms,
        atom_tokens=plan.atom_tokens,
        atom_heads=plan.atom_heads,
        meta=dict(plan.meta),
    )


def apply_plan(plan: TransferPlan, src_buf: np.ndarray, dst_buf: np.ndarray) -> None:
    """Execute a plan whose addresses are offsets into two uint8 buffers (a reference memcpy)."""
    for s, d, n in zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.length.tolist()):
        dst_buf[d : d + n] = src_buf[s : s + n]


def iter_block_runs(block_ids: Iterable[int]) -> list[tuple[int, int]]:
    """Runs of consecutive block ids as (first, count): how fragmented an allocation is."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((int(b), 1))
    return runs
