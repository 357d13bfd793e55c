"""Discovery and pairing logic of the router, fed with pod objects as the API returns them (no cluster)."""

from __future__ import annotations

import copy
import json

import pytest

from disagg_connector import contract
from disagg_connector.router.discovery import EndpointTable, RevisionView, Snapshot, backends_from_pod, load_static, pods_from_static
from disagg_connector.router.pairing import Balancer, Ejections
from tests.fixtures.router import pod


def test_ready_pod_gives_contract_identity():
    ann = {
        contract.ANNOTATION_TP_SIZE: "8",
        contract.ANNOTATION_PP_SIZE: "2",
        contract.ANNOTATION_SIDE_CHANNEL_PORT: "5700",
        contract.ANNOTATION_HTTP_PORT: "9000",
    }
    [b] = backends_from_pod(pod("p0", annotations=ann))
    assert b.role == "prefill" and b.revision == "rev1"
    assert b.identity.engine_id == contract.engine_id("p0", "uid-p0")
    assert (b.identity.host, b.identity.side_channel_port, b.identity.tp_size, b.identity.pp_size) == ("10.0.0.1", 5700, 8, 2)
    assert b.base_url == "http://10.0.0.1:9000"
    params = b.identity.push_decode_params("cmpl-x-0", "xfer-x")
    assert params["remote_engine_id"] == b.identity.engine_id and params["remote_port"] == 5700


@pytest.mark.parametrize(
    "kw",
    [
        {"ready": False},
        {"terminating": True},
        {"ip": None},
        {"revision": None},
        {"role": "router"},
        {"annotations": {contract.ANNOTATION_TP_SIZE: "eight"}},
    ],
    ids=["not-ready", "terminating", "no-ip", "no-revision", "router-role", "bad-annotation"],
)
def test_ineligible_pods_give_nothing(kw):
    assert backends_from_pod(pod("p0", **kw)) == []


def test_no_conditions_is_not_ready():
    p = pod("p0")
    del p["status"]["conditions"]
    assert backends_from_pod(p) == []


def test_data_parallel_prefill_is_one_backend_per_rank_and_decode_one():
    ann = {contract.ANNOTATION_DP_SIZE: "2", contract.ANNOTATION_SIDE_CHANNEL_PORT: "5600"}
    ps = backends_from_pod(pod("p0", annotations=ann))
    assert [b.identity.engine_id for b in ps] == ["p0.uid-p0_dp0", "p0.uid-p0_dp1"]
    assert [b.identity.side_channel_port for b in ps] == [5600, 5601]
    assert len({b.key for b in ps}) == 2
    [d] = backends_from_pod(pod("d0", role="decode", annotations=ann))
    assert d.dp_size == 2


def test_a_pod_of_a_multi_pod_engine_serves_its_own_global_ranks():
    """DP 16 over two pods of 8 ranks: the second pod's ranks are 8..15 in engine_id and side-channel port
    (vLLM uses the global rank in both), and its API server is addressed by the index within its own."""
    ann = {contract.ANNOTATION_DP_SIZE: "16", contract.ANNOTATION_DP_START_RANK: "8",
           contract.ANNOTATION_DP_SIZE_LOCAL: "8", contract.ANNOTATION_SIDE_CHANNEL_PORT: "5600"}
    ps = backends_from_pod(pod("p1", annotations=ann))
    assert [b.identity.dp_rank for b in ps] == list(range(8, 16))
    assert ps[0].identity.engine_id == "p1.uid-p1_dp8" and ps[-1].identity.side_channel_port == 5615
    assert [b.identity.dp_local_index for b in ps] == list(range(8)) and {b.dp_size for b in ps} == {16}
    assert len({b.key for b in ps}) == 8
    one_pod = backends_from_pod(pod("p0", annotations={contract.ANNOTATION_DP_SIZE: "2"}))
    assert [(b.identity.dp_rank, b.identity.dp_local_index) for b in one_pod] == [(0, 0), (1, 1)]  # the special case


def test_a_rank_range_outside_the_engine_is_ignored_with_a_warning(caplog):
    ann = {contract.ANNOTATION_DP_SIZE: "8", contract.ANNOTATION_DP_START_RANK: "6", contract.ANNOTATION_DP_SIZE_LOCAL: "4"}
    assert backends_from_pod(pod("p0", annotations=ann)) == []
    assert "not within the engine's 8" in caplog.text


def test_table_events_and_revision_eligibility():
    t = EndpointTable()
    t.replace([pod("p1"), pod("d1", "decode"), pod("p2", revision="rev2", created="2026-02-01T00:00:00Z")])
    snap = t.snapshot()
    assert [r.revision for r in snap.revisions] == ["rev2", "rev1"]  # newest first
    assert snap.revision("rev1").eligible and not snap.revision("rev2").eligible

    # rev2's decode starts, not ready yet: still not eligible, but its age is known
    t.apply("ADDED", pod("d2", "decode", revision="rev2", ready=False, created="2026-02-01T00:00:01Z"))
    assert not t.snapshot().revision("rev2").eligible
    t.apply("MODIFIED", pod("d2", "decode", revision="rev2", created="2026-02-01T00:00:01Z"))
    assert t.snapshot().revision("rev2").eligible

    # terminating and deleted pods leave the table
    t.apply("MODIFIED", pod("p1", terminating=True))
    assert not t.snapshot().revision("rev1").eligible
    t.apply("DELETED", pod("p1", terminating=True))
    t.apply("DELETED", pod("d1", "decode"))
    assert t.snapshot().revision("rev1") is None

    # a relist is the new truth
    t.replace([pod("p9", revision="rev9"), pod("d9", "decode", revision="rev9")])
    assert [r.revision for r in t.snapshot().revisions] == ["rev9"]


def test_recreated_pod_with_same_name_is_a_new_engine():
    t = EndpointTable()
    t.apply("ADDED", pod("p0", uid="a"))
    t.apply("ADDED", pod("p0", uid="b"))
    t.apply("DELETED", pod("p0", uid="a"))
    [b] = t.snapshot().revisions[0].prefill
    assert b.identity.engine_id == contract.engine_id("p0", "b")


def _pairs(*revisions: tuple[str, int, int]) -> EndpointTable:
    """A table with (revision, prefills, decodes) ready pods each."""
    t = EndpointTable()
    t.replace(
        [pod(f"{rev}-p{i}", revision=rev) for rev, p, _ in revisions for i in range(p)]
        + [pod(f"{rev}-d{i}", "decode", revision=rev) for rev, _, d in revisions for i in range(d)]
    )
    return t


def test_revisions_share_traffic_in_proportion_to_ready_pairs_and_never_mix():
    t = _pairs(("old", 3, 4), ("new", 1, 1))  # 3 pairs and 1
    bal = Balancer()
    assert Balancer.weights(bal.candidates(t.snapshot())) == {"old": 0.75, "new": 0.25}
    chosen = [bal.choose_pair(t.snapshot()) for _ in range(40)]
    assert all(p.revision == d.revision for p, d in chosen)
    revs = [p.revision for p, _ in chosen]
    assert revs.count("old") == 30 and revs.count("new") == 10
    # smooth: every window of 4 consecutive requests holds exactly one of the new revision
    assert all(revs[i : i + 4].count("new") == 1 for i in range(0, 40, 4))


def test_weights_follow_the_table_and_a_revision_without_a_pair_gets_nothing():
    bal = Balancer()
    t = _pairs(("old", 2, 2), ("new", 1, 0))
    assert {p.revision for p, _ in (bal.choose_pair(t.snapshot()) for _ in range(6))} == {"old"}
    t = _pairs(("old", 1, 1), ("new", 2, 3))
    revs = [bal.choose_pair(t.snapshot())[0].revision for _ in range(30)]
    assert revs.count("new") == 20


def test_least_outstanding_within_a_revision_and_round_robin_ties():
    t = _pairs(("r", 2, 2))
    bal = Balancer()
    snap = t.snapshot()
    p1 = next(b for b in snap.revisions[0].prefill if b.pod == "r-p0")
    bal.acquire(p1)
    assert bal.choose_pair(snap)[0].pod == "r-p1"
    bal.release(p1)
    chosen = [bal.choose_pair(snap) for _ in range(100)]  # idle: rotate over every engine of both roles
    assert {p.pod for p, _ in chosen} == {"r-p0", "r-p1"} and {d.pod for _, d in chosen} == {"r-d0", "r-d1"}


def test_exclusions_ejections_and_draining_are_never_ignored():
    now = [0.0]
    ejections = Ejections(first=1.0, longest=4.0, clock=lambda: now[0])
    bal = Balancer(ejections)
    t = _pairs(("r", 2, 1))
    snap = t.snapshot()
    assert bal.choose_pair(snap, {"r-p0"})[0].pod == "r-p1"
    assert bal.choose_pair(snap, {"r-p0", "r-p1"}) is None  # a retry never goes back to a failed backend
    assert bal.choose_pair(snap, {"r-d0"}) is None
    ejections.eject("r-p1")
    assert {bal.choose_pair(snap)[0].pod for _ in range(4)} == {"r-p0"}
    ejections.eject("r-p0")
    assert bal.choose_pair(snap) is None  # everything ejected: no usable pair (the last resort is the caller's)
    t.replace([pod("r-p0", revision="r"), pod("r-d0", "decode", revision="r", annotations={contract.ANNOTATION_DRAINING: "now"})])
    ejections.probed("r-p0", True)
    assert bal.choose_pair(t.snapshot()) is None and not t.snapshot().revision("r").eligible


def test_the_last_resort_routes_despite_ejections_but_never_to_drained_or_excluded_backends():
    ejections = Ejections()
    bal = Balancer(ejections)
    t = _pairs(("r", 2, 2))
    snap = t.snapshot()
    for key in ("r-p0", "r-p1", "r-d0"):
        ejections.eject(key)
    assert bal.pick(snap) is None
    last = bal.pick(snap, despite_ejections=True)
    assert last is not None and last.despite_ejections
    # only the role with nothing left stands in with its ejected backends; the other keeps its usable one
    assert {b.pod for b in last.prefill} == {"r-p0", "r-p1"} and [b.pod for b in last.decode] == ["r-d1"]
    assert [b.pod for b in bal.pick(snap, {"r-p0"}, despite_ejections=True).prefill] == ["r-p1"]  # a retry's exclusions hold
    assert bal.usable_decodes(snap, "r") == ((next(b for b in snap.revisions[0].decode if b.pod == "r-d1"),), False)
    ejections.eject("r-d1")
    assert bal.usable_decodes(snap, "r") == (snap.revisions[0].decode, True)  # pull's decode, the same way
    t.replace([pod("r-p0", revision="r"), pod("r-d0", "decode", revision="r", annotations={contract.ANNOTATION_DRAINING: "now"})])
    assert bal.pick(t.snapshot(), despite_ejections=True) is None  # a draining pod is never a stand-in
    healthy = _pairs(("r", 1, 1), ("next", 1, 1))
    assert not Balancer().pick(healthy.snapshot(), despite_ejections=True).despite_ejections  # nothing ejected: no panic


def test_ejection_backoff_suspects_and_readmission():
    now = [0.0]
    e = Ejections(first=0.5, longest=2.0, clock=lambda: now[0])
    e.eject("a")
    assert "a" in e and e.due() == [] and e.next_due() == 0.5
    now[0] = 0.5
    assert e.due() == ["a"]
    for expected_delay in (1.0, 2.0, 2.0):  # doubling, capped
        e.probed("a", False)
        assert e.next_due() == now[0] + expected_delay
        now[0] = e.next_due()
    e.probed("a", True)
    assert "a" not in e and e.due() == []
    e.suspect("b")  # a 500: probe at once, eject only if the probe fails
    assert "b" not in e and e.due() == ["b"] and e.next_due() == now[0]
    e.probed("b", True)
    assert e.due() == [] and "b" not in e
    e.suspect("b")
    e.probed("b", False)
    assert "b" in e
    e.forget({"x"})
    assert "b" not in e and len(e) == 0


def test_revision_mode_from_the_pods_annotation():
    def table(*modes: str | None, default: str = "Push") -> RevisionView:
        t = EndpointTable(default)  # type: ignore[arg-type]
        t.replace(
            [pod(f"p{i}" if i == 0 else f"d{i}", "prefill" if i == 0 else "decode", annotations={contract.ANNOTATION_TRANSFER_MODE: m} if m else {})
             for i, m in enumerate(modes)]
        )  # fmt: skip
        return t.snapshot().revision("rev1")

    assert (table("Pull", "Pull").mode, table(None, None).mode, table(None, None, default="Pull").mode) == ("Pull", "Push", "Pull")
    assert table("Pull", None).mode == "Pull"  # pods without it follow those that announce it
    conflict = table("Push", "Pull")
    assert conflict.mode is None and "p0=Push" in conflict.mode_conflict and "d1=Pull" in conflict.mode_conflict
    unknown = table("push", "Push")
    assert unknown.mode is None and "p0='push'" in unknown.mode_conflict
    assert not conflict.eligible and Balancer().choose_pair(Snapshot(1, (conflict,))) is None


def test_static_file_goes_through_the_same_code(tmp_path):
    doc = {
        "endpoints": [
            {"role": "prefill", "revision": "a", "name": "p", "uid": "u", "host": "127.0.0.1", "http_port": 8100, "side_channel_port": 5610, "tp_size": 2},
            {"role": "decode", "revision": "a", "name": "d", "host": "127.0.0.1", "http_port": 8200},
            {"role": "prefill", "revision": "b", "name": "q", "uid": "v", "dp_size": 2, "mode": "Pull"},
            {"role": "decode", "revision": "b", "name": "e", "ready": False, "draining": True},
        ]
    }
    f = tmp_path / "eps.json"
    f.write_text(json.dumps(doc))
    t = EndpointTable()
    t.replace(load_static(f))
    snap = t.snapshot()
    assert [r.revision for r in snap.revisions] == ["b", "a"]  # later in the file = newer
    [p] = snap.revision("a").prefill
    assert p.identity.engine_id == contract.engine_id("p", "u") and p.identity.tp_size == 2 and p.base_url == "http://127.0.0.1:8100"
    assert [b.identity.engine_id for b in snap.revision("b").prefill] == [contract.engine_id("q", "v") + f"_dp{r}" for r in (0, 1)]
    assert not snap.revision("b").eligible and snap.revision("b").mode == "Pull"
    [e] = [pod for pod in load_static(f) if pod["metadata"]["name"] == "e"]
    assert contract.ANNOTATION_DRAINING in e["metadata"]["annotations"]
    yaml_file = tmp_path / "eps.yaml"
    yaml_file.write_text("endpoints:\n- {role: decode, name: d, revision: a}\n")
    assert pods_from_static({"endpoints": [{"role": "decode", "name": "d", "revision": "a"}]}) == load_static(yaml_file)
    with pytest.raises(ValueError, match="engine_id"):  # an engine is named as a pod is: by name and UID
        pods_from_static({"endpoints": [{"role": "prefill", "name": "q", "engine_id": "explicit"}]})


def test_table_input_is_not_mutated():
    p = pod("p1")
    before = copy.deepcopy(p)
    EndpointTable().replace([p])
    assert p == before
