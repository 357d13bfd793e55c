"""Pure block-id -> descriptor mapping and coalescing, checked by executing plans on byte buffers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from disagg_bench.kvxfer import messages
from disagg_bench.kvxfer.layout import (
    KVLayout,
    LayoutMismatch,
    apply_plan,
    check_compatible,
    coalesce,
    iter_block_runs,
    peer_ranks,
    plan_transfer,
    token_offsets,
)
from disagg_bench.kvxfer.memory import pattern


def lay(block_size=16, tp=1, rank=0, order="HND", blocks=12, heads=4, layers=2):
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=4, dtype_bytes=2, block_size=block_size, num_blocks=blocks, tp_size=tp, tp_rank=rank, kv_order=order)


def scatter(layout, buf, blocks, ntok, data):
    off = token_offsets(layout, blocks, ntok)
    buf[off[..., None] + np.arange(layout.head_bytes)] = data


def gather(layout, buf, blocks, ntok):
    off = token_offsets(layout, blocks, ntok)
    return buf[off[..., None] + np.arange(layout.head_bytes)]


def run_case(src, dst, ntok, rng, do_coalesce=True, max_bytes=None):
    sb = rng.choice(src.num_blocks, size=src.blocks_for(ntok), replace=False)
    db = rng.choice(dst.num_blocks, size=dst.blocks_for(ntok), replace=False)
    sbuf = np.zeros(src.total_bytes, np.uint8)
    dbuf = np.zeros(dst.total_bytes, np.uint8)
    scatter(src, sbuf, sb, ntok, pattern(src, ntok, seed=3))
    plan = plan_transfer(src, dst, sb, db, ntok)
    if do_coalesce:
        merged = coalesce(plan, max_bytes)
        assert merged.nbytes == plan.nbytes
        assert len(merged) <= len(plan)
        plan = merged
    apply_plan(plan, sbuf, dbuf)
    got = gather(dst, dbuf, db, ntok)
    want = pattern(dst, ntok, seed=3)
    h0 = max(src.head_start, dst.head_start)
    h1 = min(src.head_start + src.heads_per_rank, dst.head_start + dst.heads_per_rank)
    for hl in range(dst.heads_per_rank):
        h = dst.head_start + hl
        if h0 <= h < h1:
            np.testing.assert_array_equal(got[:, hl], want[:, hl])
        else:
            assert not got[:, hl].any(), "a head the source does not hold was written"
    return plan


@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("bs", [(16, 16), (16, 32), (32, 16), (16, 24), (8, 12)])
def test_different_block_sizes_random_blocks(order, bs):
    rng = np.random.default_rng(sum(bs))
    for ntok in (1, 15, 16, 33, 70):
        run_case(lay(bs[0], order=order), lay(bs[1], order=order), ntok, rng)
        run_case(lay(bs[0], order=order), lay(bs[1], order=order), ntok, rng, do_coalesce=False)


@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("tps", [(2, 1), (1, 2), (4, 2), (2, 4), (2, 2)])
def test_tensor_parallel_mappings(order, tps):
    ptp, dtp = tps
    rng = np.random.default_rng(ptp * 10 + dtp)
    for pr, dr in itertools.product(range(ptp), range(dtp)):
        src, dst = lay(16, ptp, pr, order), lay(32, dtp, dr, order)
        if pr in peer_ranks(4, dtp, dr, ptp):
            run_case(src, dst, 40, rng)
        else:
            assert len(plan_transfer(src, dst, [0, 1, 2], [0, 1], 40)) == 0


def test_tp_2_to_1_both_ranks_fill_the_decode_blocks():
    rng = np.random.default_rng(0)
    dst = lay(16, 1, 0)
    p0, p1 = lay(16, 2, 0), lay(16, 2, 1)
    ntok = 37
    db = rng.choice(dst.num_blocks, size=3, replace=False)
    dbuf = np.zeros(dst.total_bytes, np.uint8)
    for src in (p0, p1):
        sb = rng.choice(src.num_blocks, size=3, replace=False)
        sbuf = np.zeros(src.total_bytes, np.uint8)
        scatter(src, sbuf, sb, ntok, pattern(src, ntok, seed=9))
        apply_plan(coalesce(plan_transfer(src, dst, sb, db, ntok)), sbuf, dbuf)
    np.testing.assert_array_equal(gather(dst, dbuf, db, ntok), pattern(dst, ntok, seed=9))


def test_per_block_count_and_coalescing_of_contiguous_blocks():
    src = dst = lay(16, blocks=64, layers=3)
    ntok = 16 * 10
    plan = plan_transfer(src, dst, range(5, 15), range(20, 30), ntok)
    assert plan.atoms == len(plan) == 6 * 10  # one per block per (layer, K|V)
    merged = coalesce(plan)
    assert len(merged) == 6  # one per region
    assert set(merged.length.tolist()) == {10 * src.block_bytes}
    # two runs on the destination side -> two descriptors per region
    db = list(range(20, 25)) + list(range(40, 45))
    assert len(coalesce(plan_transfer(src, dst, range(5, 15), db, ntok))) == 12
    # whole regions in order on both sides merge across the K/V/layer boundary too
    whole = coalesce(plan_transfer(src, dst, range(64), range(64), 16 * 64))
    assert len(whole) == 1 and whole.nbytes == src.total_bytes


def test_coalesce_cap_splits_but_keeps_bytes():
    src = dst = lay(16, blocks=32)
    plan = plan_transfer(src, dst, range(32), range(32), 16 * 32)
    capped = coalesce(plan, max_bytes=4 * src.block_bytes)
    assert capped.nbytes == plan.nbytes
    assert int(capped.length.max()) <= 4 * src.block_bytes
    assert len(capped) == plan.atoms // 4
    run_case(src, dst, 100, np.random.default_rng(1), max_bytes=3 * src.block_bytes)


def test_atom_shapes():
    # equal block size, HND: whole block (all overlapping heads) per descriptor
    p = plan_transfer(lay(16), lay(16), [0, 1], [2, 3], 32)
    assert (p.atom_tokens, p.atom_heads) == (16, 4)
    # different block sizes, HND: per (gcd chunk, head)
    p = plan_transfer(lay(16), lay(32), [0, 1], [2], 32)
    assert (p.atom_tokens, p.atom_heads) == (16, 1)
    # TP 2 -> 1, HND, equal blocks: head slice of a block is contiguous
    p = plan_transfer(lay(16, 2, 1), lay(16, 1, 0), [0], [1], 16)
    assert (p.atom_tokens, p.atom_heads) == (16, 2)
    # NHD with a head slice: per token
    p = plan_transfer(lay(16, 2, 1, "NHD"), lay(16, 1, 0, "NHD"), [0], [1], 16)
    assert (p.atom_tokens, p.atom_heads) == (1, 2)


def test_peer_ranks():
    assert peer_ranks(8, 1, 0, 2) == [0, 1]
    assert peer_ranks(8, 2, 1, 1) == [0]
    assert peer_ranks(8, 2, 1, 4) == [2, 3]
    assert peer_ranks(8, 4, 3, 2) == [1]
    with pytest.raises(LayoutMismatch):
        peer_ranks(8, 3, 0, 1)


def test_mismatches_are_explicit():
    with pytest.raises(LayoutMismatch, match="head_dim"):
        check_compatible(lay(), KVLayout(2, 4, 8, 2, 16, 12))
    with pytest.raises(LayoutMismatch, match="split evenly"):
        KVLayout(2, 4, 4, 2, 16, 12, tp_size=3)
    with pytest.raises(LayoutMismatch, match="blocks"):
        plan_transfer(lay(), lay(), [0], [0, 1], 40)
    with pytest.raises(LayoutMismatch, match="out of range"):
        plan_transfer(lay(), lay(), [0, 99], [0, 1], 20)
    assert len(plan_transfer(lay(), lay(), [], [], 0)) == 0


def test_layout_dict_round_trip_and_runs():
    a = lay(24, 2, 1, "NHD")
    assert KVLayout.from_dict(a.to_dict()) == a
    assert iter_block_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]


@pytest.mark.parametrize("codec", ["msgpack", "json"])
def test_messages_round_trip(codec):
    msg = messages.encode(messages.REGISTER, {"rid": "r1", "blocks": [1, 2, 3]}, codec=codec)
    assert messages.decode(msg) == (messages.REGISTER, {"rid": "r1", "blocks": [1, 2, 3]})
    assert messages.decode(b"something else") is None
    assert messages.decode(messages.MAGIC + b"R" + b"J" + b"{not json") is None
    assert messages.unpack_obj(messages.pack_obj({"a": 1})) == {"a": 1}
