"""Push and pull KV transfer on real NIXL (UCX, DRAM) between separate processes.

One prefill process and one decode process host several ranks each (own agent, own memory per
rank); a third process is started and killed for the dead-producer case. No timed assertions:
deadlines only bound how long a failure takes to show.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

# NIXL is a test dependency (hack/setup.sh installs it): without it these tests must fail, not vanish.
import nixl._api  # noqa: E402,F401

from disagg_bench.kvxfer.actor import spawn_actor  # noqa: E402

pytestmark = pytest.mark.timeout(120)

H = 4  # KV heads of the toy model


def layout(block_size, tp=1, rank=0, blocks=48):
    return dict(num_layers=2, num_kv_heads=H, head_dim=8, dtype_bytes=2, block_size=block_size, num_blocks=blocks, tp_size=tp, tp_rank=rank)


PREFILL = {  # name -> (engine id, layout)
    "p1": ("P1", layout(16)),
    "p2r0": ("P2", layout(16, 2, 0)),
    "p2r1": ("P2", layout(16, 2, 1)),
}
DECODE = {  # name -> (engine id, layout, pull prep); d32 also sends push registrations inline
    "d16": ("D16", layout(16), "inline"),
    "d32": ("D32", layout(32), "background"),
    "d2r0": ("D2", layout(32, 2, 0), "inline"),
    "d2r1": ("D2", layout(32, 2, 1), "inline"),
}


@pytest.fixture(scope="module")
def ranks():
    p, d = spawn_actor(), spawn_actor()
    try:
        pinfo = {n: p.create(n, role="prefill", engine_id=e, layout=l, lease_s=2.0) for n, (e, l) in PREFILL.items()}
        dinfo = {
            n: d.create(n, role="decode", engine_id=e, layout=l, prep=prep, reg_send="inline" if n == "d32" else "background")
            for n, (e, l, prep) in DECODE.items()
        }
        for (pn, pb), (dn, db) in itertools.product(pinfo.items(), dinfo.items()):
            p.ask("add_peer", pn, db)
            d.ask("add_peer", dn, pb)
        yield p, d
    finally:
        p.close()
        d.close()


rng = np.random.default_rng(1234)
_counter = itertools.count()


def rid():
    return f"req-{next(_counter)}"


def blocks_for(name, ntok, table):
    lay = table[name][1]
    n = -(-ntok // lay["block_size"])
    return [int(b) for b in rng.choice(lay["num_blocks"], size=n, replace=False)]


def push(ranks, pnames, dnames, ntok, order, seed):
    """One push request from prefill ranks ``pnames`` to decode ranks ``dnames``."""
    p, d = ranks
    r = rid()
    pblocks = blocks_for(pnames[0], ntok, PREFILL)  # all ranks of an engine use the same block ids
    dblocks = blocks_for(dnames[0], ntok, DECODE)
    peng, ptp = PREFILL[pnames[0]][0], PREFILL[pnames[0]][1]["tp_size"]
    for dn in dnames:
        d.ask("zero", dn)
    for pn in pnames:
        p.ask("fill", pn, pblocks, ntok, seed)

    def register():
        return [d.call(dn, "register", r, dblocks, ntok, peng, ptp, deadline_s=20.0) for dn in dnames]

    def done():
        for pn in pnames:
            p.call(pn, "prefill_done", r, pblocks, ntok)

    if order == "registration_first":
        tids = register()
        done()
    else:
        done()
        tids = register()
    results = [d.ask("wait", dn, 1, 30.0)[0] for dn in dnames]
    presults = [p.ask("wait", pn, 1, 30.0)[0] for pn in pnames]
    for res, tid in zip(results, tids):
        assert res["status"] == "ok", res["message"]
        assert res["transfer_id"] == tid
    assert all(pr["status"] == "ok" and pr["request_id"] == r for pr in presults), presults
    for dn in dnames:
        assert d.ask("check", dn, dblocks, ntok, seed), f"bytes differ on {dn}"
    return results


@pytest.mark.parametrize("order", ["registration_first", "prefill_first"])
def test_push_random_blocks_both_orders(ranks, order):
    for ntok in (1, 50, 16 * 5):
        res = push(ranks, ["p1"], ["d16"], ntok, order, seed=ntok)
        assert res[0]["descs_after"] <= res[0]["descs_before"]


def test_push_different_block_sizes(ranks):
    push(ranks, ["p1"], ["d32"], 77, "registration_first", seed=5)


def test_push_tp_2_to_1(ranks):
    push(ranks, ["p2r0", "p2r1"], ["d16"], 45, "prefill_first", seed=6)


def test_push_tp_1_to_2(ranks):
    push(ranks, ["p1"], ["d2r0", "d2r1"], 45, "registration_first", seed=7)


def test_registration_without_prefill_expires(ranks):
    p, d = ranks
    r = rid()
    tid = d.call("d16", "register", r, [1, 2], 20, "P1", 1, deadline_s=20.0)
    res = d.ask("wait", "d16", 1, 30.0)[0]
    assert res["transfer_id"] == tid
    assert res["status"] == "expired"
    assert "no prefill of request" in res["message"] and r in res["message"]


def test_retry_with_fresh_id_is_not_paired_with_stale_registration(ranks):
    p, d = ranks
    stale = rid()
    d.call("d16", "register", stale, [3, 4], 20, "P1", 1, deadline_s=20.0)
    d.call("d16", "cancel", stale)
    cancelled = d.ask("wait", "d16", 1, 30.0)[0]
    assert cancelled["request_id"] == stale and cancelled["status"] == "cancelled"
    # the retry (fresh id) pairs with its own prefill; the stale registration is gone
    push(ranks, ["p1"], ["d16"], 20, "prefill_first", seed=11)
    # a prefill finished under the stale id is not written anywhere: it expires on its lease
    p.call("p1", "prefill_done", stale, [5, 6], 20)
    res = p.ask("wait", "p1", 1, 30.0)[0]
    assert res["request_id"] == stale and res["status"] == "expired"


def test_dead_producer_gives_consumer_an_error(ranks):
    _, d = ranks
    victim = spawn_actor()
    try:
        info = victim.create("px", role="prefill", engine_id="PX", layout=layout(16), lease_s=30.0)
        d.ask("add_peer", "d16", info)
        victim.ask("add_peer", "px", d.call("d16", "info_blob"))
        # registered while the prefill engine was alive, then it dies: error at the deadline
        r = rid()
        d.call("d16", "register", r, [7, 8], 20, "PX", 1, deadline_s=3.0)
        victim.proc.kill()
        victim.proc.join(10)
        res = d.ask("wait", "d16", 1, 30.0)[0]
        assert res["request_id"] == r and res["status"] == "timeout", res
        assert "PX" in res["message"] and "dead or unreachable" in res["message"]
        # registering with the dead engine afterwards fails at once (UCX sees the disconnect)
        # or at the deadline: either way an error, never a hang
        r = rid()
        d.call("d16", "register", r, [7, 8], 20, "PX", 1, deadline_s=3.0)
        res = d.ask("wait", "d16", 1, 30.0)[0]
        assert res["request_id"] == r and res["status"] in ("failed", "timeout"), res
        assert "PX" in res["message"]
    finally:
        victim.close()


@pytest.mark.parametrize("dname", ["d16", "d32"])  # inline prep, background prep (+ different block size)
def test_pull_bytes_intact(ranks, dname):
    p, d = ranks
    for ntok in (33, 64):
        r = rid()
        pblocks = blocks_for("p1", ntok, PREFILL)
        dblocks = blocks_for(dname, ntok, DECODE)
        d.ask("zero", dname)
        p.ask("fill", "p1", pblocks, ntok, ntok + 1)
        params = p.call("p1", "prefill_done", r, pblocks, ntok, mode="pull")
        tid = d.call(dname, "pull", params, dblocks, deadline_s=20.0)
        res = d.ask("wait", dname, 1, 30.0)[0]
        assert res["status"] == "ok" and res["transfer_id"] == tid, res["message"]
        assert res["mode"] == ("pull-inline" if dname == "d16" else "pull-background")
        assert d.ask("check", dname, dblocks, ntok, ntok + 1)
        pres = p.ask("wait", "p1", 1, 30.0)[0]  # read-done notice frees the prefill blocks
        assert pres["status"] == "ok" and pres["request_id"] == r


def test_pull_tp_2_to_1(ranks):
    p, d = ranks
    r, ntok = rid(), 40
    pblocks, dblocks = blocks_for("p2r0", ntok, PREFILL), blocks_for("d16", ntok, DECODE)
    d.ask("zero", "d16")
    for pn in ("p2r0", "p2r1"):
        p.ask("fill", pn, pblocks, ntok, 21)
        params = p.call(pn, "prefill_done", r, pblocks, ntok, mode="pull")
    d.call("d16", "pull", params, dblocks, deadline_s=20.0)
    assert d.ask("wait", "d16", 1, 30.0)[0]["status"] == "ok"
    assert d.ask("check", "d16", dblocks, ntok, 21)
    assert [p.ask("wait", pn, 1, 30.0)[0]["status"] for pn in ("p2r0", "p2r1")] == ["ok", "ok"]
