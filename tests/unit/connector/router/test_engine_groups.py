"""Engines that span pods (one LeaderWorkerSet group each): which engine a pod belongs to (contract.engine_group),
the router offering such an engine only while all its pods serve, the simulator serving one pod's share of the
ranks, and a request through the real router over simulated pods of one engine."""

from __future__ import annotations

import asyncio
import logging
import signal
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from disagg_connector import contract
from disagg_connector.contract.health import parse_health
from disagg_connector.router.discovery import EndpointTable, load_static
from disagg_connector.router.pairing import Balancer
from tests.fixtures.router import pod
from disagg_bench.vllm_sim import harness as h

LWS = "m-decode-rev1"


def member(name: str, worker: int, *, group: int = 0, lws: str = LWS, role: str = "decode", dp: int = 4, local: int = 2,
           uid: str | None = None, **kw) -> dict:  # fmt: skip
    """A pod of an engine of `dp` ranks over pods of `local` ranks, labelled as LWS labels it."""
    p = pod(name, role, uid=uid, annotations={contract.ANNOTATION_DP_SIZE: str(dp), contract.ANNOTATION_DP_SIZE_LOCAL: str(local),
                                              **kw.pop("annotations", {})}, **kw)  # fmt: skip
    p["metadata"]["labels"].update({
        contract.LWS_NAME_LABEL: lws, contract.LWS_GROUP_INDEX_LABEL: str(group), contract.LWS_WORKER_INDEX_LABEL: str(worker),
        "leaderworkerset.sigs.k8s.io/group-key": f"key-{lws}-{group}",
    })  # fmt: skip
    return p


def group_of(p: dict) -> contract.EngineGroup:
    meta = p["metadata"]
    return contract.engine_group(meta["name"], meta["labels"], meta["annotations"])


# --- contract.engine_group ------------------------------------------------------------------------------
def test_a_pod_of_a_multi_pod_engine_names_its_group_and_its_size():
    leader, worker = member("d-0", 0, group=3), member("d-0-1", 1, group=3)
    assert group_of(leader) == contract.EngineGroup(f"{LWS}/3", 2, 0)
    assert group_of(worker) == contract.EngineGroup(f"{LWS}/3", 2, 1)
    assert group_of(member("d-1", 0, group=4)).key != group_of(leader).key  # another group, another engine
    assert group_of(member("x-0", 0, lws="m-decode-rev2")).key != group_of(member("d-0", 0)).key
    assert group_of(member("w", 3, dp=16, local=4)) == contract.EngineGroup(f"{LWS}/0", 4, 3)


def test_a_one_pod_engine_is_its_own_group_with_or_without_lws_labels():
    assert group_of(pod("p0")) == contract.EngineGroup("p0", 1, 0)
    assert group_of(pod("p0", annotations={contract.ANNOTATION_DP_SIZE: "8"})) == contract.EngineGroup("p0", 1, 0)
    assert group_of(member("p0", 0, dp=4, local=4)) == contract.EngineGroup("p0", 1, 0)  # one pod serves every rank
    lws_only = member("p0", 0)
    del lws_only["metadata"]["annotations"][contract.ANNOTATION_DP_SIZE_LOCAL]
    assert group_of(lws_only) == contract.EngineGroup("p0", 1, 0)
    assert contract.engine_group("p0", None, None) == contract.EngineGroup("p0", 1, 0)


def test_engines_are_counted_by_their_groups():
    pods = [member("d-0", 0), member("d-0-1", 1), member("d-1", 0, group=1), member("d-1-1", 1, group=1), pod("p0"), pod("p1")]
    groups = {group_of(p).key: group_of(p).pods for p in pods}
    assert groups == {f"{LWS}/0": 2, f"{LWS}/1": 2, "p0": 1, "p1": 1}


@pytest.mark.parametrize(
    "labels,annotations,message",
    [
        ({}, {contract.ANNOTATION_DP_SIZE: "4", contract.ANNOTATION_DP_SIZE_LOCAL: "3"}, "3 data-parallel ranks per pod do not divide"),
        ({}, {contract.ANNOTATION_DP_SIZE: "4", contract.ANNOTATION_DP_SIZE_LOCAL: "2"}, "lacks the labels"),
        ({contract.LWS_NAME_LABEL: "l", contract.LWS_WORKER_INDEX_LABEL: "1"},
         {contract.ANNOTATION_DP_SIZE: "4", contract.ANNOTATION_DP_SIZE_LOCAL: "2"}, "lacks the labels"),
        ({contract.LWS_NAME_LABEL: "l", contract.LWS_GROUP_INDEX_LABEL: "0", contract.LWS_WORKER_INDEX_LABEL: "2"},
         {contract.ANNOTATION_DP_SIZE: "4", contract.ANNOTATION_DP_SIZE_LOCAL: "2"}, "worker index 2 is not within its engine's 2 pods"),
        ({}, {contract.ANNOTATION_DP_SIZE: "four"}, "invalid literal"),
    ],
    ids=["indivisible", "no-labels", "no-group-index", "index-out-of-group", "not-a-number"],
)  # fmt: skip
def test_a_pod_that_cannot_say_its_engine_is_an_error(labels, annotations, message):
    with pytest.raises(ValueError, match=message):
        contract.engine_group("p", labels, annotations)


# --- the router's table -----------------------------------------------------------------------------------
def _table(*pods: dict) -> EndpointTable:
    t = EndpointTable()
    t.replace([pod("p0"), *pods])  # a one-pod prefill engine
    return t


def _decode(t: EndpointTable) -> list[str]:
    return [b.pod for b in t.snapshot().revision("rev1").decode]


def test_a_multi_pod_decode_is_offered_only_while_its_whole_group_serves(caplog):
    caplog.set_level(logging.INFO, "disagg_router.discovery")
    t = _table(member("d-0", 0), member("d-0-1", 1, ready=False))
    rev = t.snapshot().revision("rev1")
    assert rev.decode == () and [b.pod for b in rev.held_out] == ["d-0"] and not rev.eligible
    assert [b.pod for b in rev.prefill] == ["p0"]  # the one-pod prefill is offered as always

    t.apply("MODIFIED", member("d-0-1", 1))
    rev = t.snapshot().revision("rev1")
    assert _decode(t) == ["d-0", "d-0-1"] and rev.held_out == () and rev.eligible
    assert [b.identity.dp_rank for b in rev.decode] == [0, 2]  # each pod's first global rank
    assert Balancer().choose_pair(t.snapshot()) is not None

    # one pod of the group stops serving: every backend of the group leaves at once
    t.apply("MODIFIED", member("d-0-1", 1, ready=False))
    assert _decode(t) == [] and not t.snapshot().revision("rev1").eligible
    assert Balancer().choose_pair(t.snapshot()) is None
    t.apply("MODIFIED", member("d-0-1", 1))
    assert _decode(t) == ["d-0", "d-0-1"]
    t.apply("MODIFIED", member("d-0", 0, terminating=True))
    assert _decode(t) == [] and [b.pod for b in t.snapshot().revision("rev1").held_out] == ["d-0-1"]

    # LWS recreates the group: both pods go, new incarnations (same names, new UIDs) come up one by one
    t.apply("DELETED", member("d-0", 0, terminating=True))
    t.apply("MODIFIED", member("d-0-1", 1, terminating=True))
    t.apply("DELETED", member("d-0-1", 1, terminating=True))
    assert _decode(t) == [] and t.snapshot().revision("rev1").held_out == ()
    t.apply("ADDED", member("d-0", 0, uid="new-0"))
    assert _decode(t) == []
    t.apply("ADDED", member("d-0-1", 1, uid="new-1", ready=False))
    assert _decode(t) == []
    t.apply("MODIFIED", member("d-0-1", 1, uid="new-1"))
    assert [b.identity.engine_id for b in t.snapshot().revision("rev1").decode] == ["d-0.new-0_dp0", "d-0-1.new-1_dp2"]
    assert f"engine {LWS}/0 is incomplete" in caplog.text and f"engine {LWS}/0 is whole again" in caplog.text


def test_groups_are_judged_one_by_one_and_single_pod_engines_as_before():
    t = _table(member("d-0", 0), member("d-0-1", 1), member("d-1", 0, group=1), pod("d9", "decode"))
    assert _decode(t) == ["d-0", "d-0-1", "d9"]  # group 1 lacks its worker; the one-pod decode d9 is untouched
    t.apply("MODIFIED", pod("d9", "decode", ready=False))
    assert _decode(t) == ["d-0", "d-0-1"]
    t.apply("ADDED", member("d-1-1", 1, group=1))
    assert _decode(t) == ["d-0", "d-0-1", "d-1", "d-1-1"]
    assert Balancer.weights(Balancer().candidates(t.snapshot())) == {"rev1": 1.0}


def test_draining_marks_a_pod_not_its_group():
    t = _table(member("d-0", 0, annotations={contract.ANNOTATION_DRAINING: "2026-01-01T00:00:00Z"}), member("d-0-1", 1))
    assert [(b.pod, b.draining) for b in t.snapshot().revision("rev1").decode] == [("d-0", True), ("d-0-1", False)]
    bal = Balancer()
    assert {bal.choose_pair(t.snapshot())[1].pod for _ in range(4)} == {"d-0-1"}


def test_a_multi_pod_prefill_offers_every_rank_of_every_pod_once_whole():
    p0 = member("p-0", 0, lws="m-prefill-rev1", role="prefill")
    p1 = member("p-0-1", 1, lws="m-prefill-rev1", role="prefill", ip="10.0.0.2")
    t = EndpointTable()
    t.replace([p0, pod("d0", "decode")])
    assert t.snapshot().revision("rev1").prefill == () and len(t.snapshot().revision("rev1").held_out) == 2
    t.apply("ADDED", p1)
    ps = t.snapshot().revision("rev1").prefill
    assert [(b.pod, b.identity.dp_rank, b.identity.dp_local_index, b.identity.side_channel_port) for b in ps] == [
        ("p-0", 0, 0, 5600), ("p-0", 1, 1, 5601), ("p-0-1", 2, 0, 5602), ("p-0-1", 3, 1, 5603)]  # fmt: skip


@pytest.mark.parametrize(
    "odd",
    [
        member("d-0-1", 1, dp=8, local=4),  # says the group has another size
        member("d-0-1", 1, revision="rev2"),  # of another revision
        member("d-0-1", 0, uid="twin"),  # a second pod claiming the leader's index (none for worker 1)
    ],
    ids=["size", "revision", "same-index"],
)
def test_a_group_whose_pods_disagree_is_incomplete(odd):
    t = _table(member("d-0", 0), odd)
    assert all(r.decode == () for r in t.snapshot().revisions)


def test_a_part_of_an_engine_without_its_group_labels_is_never_offered(caplog):
    t = _table(pod("d0", "decode", annotations={contract.ANNOTATION_DP_SIZE: "4", contract.ANNOTATION_DP_SIZE_LOCAL: "2",
                                                contract.ANNOTATION_DP_START_RANK: "2"}))  # fmt: skip
    rev = t.snapshot().revision("rev1")
    assert rev.decode == () and [b.pod for b in rev.held_out] == ["d0"]
    assert "lacks the labels" in caplog.text


def test_static_entries_name_their_group(tmp_path):
    f = tmp_path / "eps.json"
    base = {"role": "decode", "revision": "a", "dp_size": 4, "dp_size_local": 2, "lws": "m-decode-a"}
    h.write_static(f, [{"role": "prefill", "revision": "a", "name": "p"}, {**base, "name": "d-0", "worker_index": 0},
                       {**base, "name": "d-0-1", "worker_index": 1, "ready": False}])  # fmt: skip
    pods = load_static(f)
    assert pods[2]["metadata"]["labels"][contract.LWS_GROUP_INDEX_LABEL] == "0"
    t = EndpointTable()
    t.replace(pods)
    assert t.snapshot().revision("a").decode == () and len(t.snapshot().revision("a").held_out) == 1


def test_health_reports_held_out_backends_and_reads_documents_without_them():
    from tests.fixtures.router import DOC

    doc = DOC.to_json()
    assert doc["revisions"]["abc"]["heldOut"] == {"prefill": 0, "decode": 0}
    doc["revisions"]["abc"]["heldOut"] = {"prefill": 0, "decode": 3}
    assert parse_health(doc).revisions["abc"].held_out_decode == 3
    del doc["revisions"]["abc"]["heldOut"]  # a router from before
    assert parse_health(doc) == DOC


# --- the simulator: one pod's ranks -------------------------------------------------------------------------
def _post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict]:
    return asyncio.run(_apost(url, body, headers))


async def _apost(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)


def test_the_simulator_serves_its_pods_ranks_as_hybrid_load_balancing_does(tmp_path):
    side = h.free_port_block(4)
    sim = h.launch_sim(tmp_path, "prefill", "push", dp=4, group=("m-prefill-r1", 0, 1), dp_local=2, side_port=side)
    try:
        h.wait_ready(sim)
        stats = sim.stats()
        assert stats["ranks"] == [2, 3] and stats["engine_ids"] == [f"{sim.engine_id}_dp2", f"{sim.engine_id}_dp3"]
        url = sim.url + "/v1/completions"
        body = h.completion()
        status, answer = _post(url, body, {"X-data-parallel-rank": "2"})
        assert status == 400 and answer["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)"
        status, answer = _post(url, {**body, "kv_transfer_params": {"do_remote_decode": True}}, {"X-data-parallel-rank": "1"})
        assert status == 200
        assert (answer["kv_transfer_params"]["remote_engine_id"], answer["kv_transfer_params"]["remote_port"]) == (f"{sim.engine_id}_dp3", side + 3)
        for _ in range(4):  # no header, or one that is no integer (ignored): the pod balances over its own ranks
            assert _post(url, body, {"X-data-parallel-rank": "one"})[0] == 200
        ranks = Counter(e["rank"] for e in sim.events("leg_received"))
        assert ranks == {3: 3, 2: 2}  # the pinned one, then in turn; the refused request never reached a rank
        metrics = urllib.request.urlopen(sim.url + "/metrics").read().decode()
        assert 'vllm:num_requests_running{engine="2"' in metrics and 'engine="0"' not in metrics
        assert _listening(side + 2) and _listening(side + 3) and not _listening(side)
    finally:
        h.stop_all(sim)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex((h.HOST, port)) == 0


# --- through the router -------------------------------------------------------------------------------------
def _engine(d: Path, role: str, mode: str, lws: str) -> list[h.Sim]:
    """Two simulated pods of one engine of 4 ranks (2 each), sharing the engine's side-channel base."""
    side = h.free_port_block(4)
    return [h.launch_sim(d, role, mode, name=f"{lws}-{w}", dp=4, group=(lws, 0, w), dp_local=2, side_port=side) for w in (0, 1)]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_requests_through_the_router_use_the_ranks_of_every_pod_of_an_engine(tmp_path, mode):
    ps, ds = _engine(tmp_path, "prefill", mode, "m-prefill-r1"), _engine(tmp_path, "decode", mode, "m-decode-r1")
    static = tmp_path / "endpoints.json"
    entries = [s.static_entry() for s in (*ps, *ds)]
    h.write_static(static, entries)
    # Least outstanding: the same prompt eight times would stay on one rank under prefix-and-load (its cache).
    router = h.launch_router(tmp_path, static, mode, extra=("--prefill-policy", "least-outstanding"))
    try:
        h.wait_ready(*ps, *ds, router)
        h.wait_until(lambda: router.health()["revisions"]["r1"]["readyPairs"], what="a ready pair")
        rev = router.health()["revisions"]["r1"]
        assert (rev["prefill"], rev["decode"], rev["heldOut"]) == (4, 2, {"prefill": 0, "decode": 0})

        async def requests() -> list[h.Reply]:
            return [await h.post(router.url + "/v1/completions", h.completion(prompt_words=300, max_tokens=2)) for _ in range(8)]

        replies = asyncio.run(requests())
        assert [(r.status, r.json()["choices"][0]["text"]) for r in replies] == [(200, " tok0 tok1")] * 8
        prefill_ranks = {e["rank"] for s in ps for e in s.events("leg_received")}
        assert prefill_ranks == {0, 1, 2, 3}  # every rank of both prefill pods, each pinned by its index in its pod
        assert {e["rank_header"] for s in ps for e in s.events("leg_received")} == {"0", "1"}
        assert {s.name: {e["rank"] for e in s.events("leg_received")} for s in ds} == {ds[0].name: {0, 1}, ds[1].name: {2, 3}}
        assert sum(s.counter("kv_received") for s in ds) == 8 and not any(s.counter("kv_wrong") for s in ds)

        # one decode pod stops serving: the whole decode engine leaves the router, so no pair; back when whole
        h.write_static(static, [*entries[:3], {**entries[3], "ready": False}])
        h.wait_until(lambda: router.health()["revisions"]["r1"]["heldOut"] == {"prefill": 0, "decode": 1}, what="decode held out")
        assert router.health()["revisions"]["r1"]["decode"] == 0
        assert asyncio.run(h.post(router.url + "/v1/completions", h.completion(prompt_words=300))).status == 503
        h.write_static(static, entries)
        h.wait_until(lambda: router.health()["revisions"]["r1"]["decode"] == 2, what="decode engine back")
        assert asyncio.run(h.post(router.url + "/v1/completions", h.completion(prompt_words=300))).status == 200
    finally:
        h.stop_all(router, *ps, *ds)


def test_pod_engines_launch_a_pods_own_ranks(tmp_path):
    """bench/disagg_bench/vllm_sim/pods.py starts a pod's simulator with the ranks its labels and annotations give it, and a
    one-pod engine's as before (every rank)."""
    from disagg_bench.vllm_sim.pods import PodEngines

    engines = PodEngines(None, "ns", "m", h.MODEL, tmp_path)  # no API call: only its launcher is used
    side = h.free_port_block(4)
    ports = h.free_ports(2)
    ann = {contract.ANNOTATION_TRANSFER_MODE: "Push", contract.ANNOTATION_SIDE_CHANNEL_PORT: str(side)}
    worker = member("d-0-1", 1, annotations={**ann, contract.ANNOTATION_HTTP_PORT: str(ports[0])})
    whole = pod("d9", "decode", annotations={**ann, contract.ANNOTATION_HTTP_PORT: str(ports[1]), contract.ANNOTATION_DP_SIZE: "2"})
    launched = [engines._launch(p, h.HOST) for p in (worker, whole)]
    try:
        h.wait_until(lambda: all(e.ready() for e in launched), 60, what="simulators on the pods")
        assert [(e.stats()["ranks"], e.stats()["engine_ids"]) for e in launched] == [
            ([2, 3], ["d-0-1.uid-d-0-1_dp2", "d-0-1.uid-d-0-1_dp3"]), ([0, 1], ["d9.uid-d9_dp0", "d9.uid-d9_dp1"])]  # fmt: skip
    finally:
        for e in launched:
            e.proc.stop()


def test_pod_engines_of_one_group_fail_together(tmp_path):
    """pods.py points a worker pod's simulator at its leader's (waiting for the leader's engine first), so the pods of
    one engine fail as one: the worker's engine dies, and the leader's with it."""
    from disagg_bench.vllm_sim.pods import PodEngines

    engines = PodEngines(None, "ns", "m", h.MODEL, tmp_path)  # no API call: only its launcher is used
    side, ports = h.free_port_block(4), h.free_ports(2)
    ann = {contract.ANNOTATION_TRANSFER_MODE: "Push", contract.ANNOTATION_SIDE_CHANNEL_PORT: str(side)}
    leader = member("d-0", 0, annotations={**ann, contract.ANNOTATION_HTTP_PORT: str(ports[0])})
    worker = member("d-0-1", 1, annotations={**ann, contract.ANNOTATION_HTTP_PORT: str(ports[1]), contract.LWS_LEADER_NAME_ANNOTATION: "d-0"})
    assert not engines._is_worker(leader) and engines._is_worker(worker)
    assert engines._leader(worker) is None  # the worker waits for its leader's engine
    engines.engines["uid-d-0"] = first = engines._launch(leader, h.HOST)
    assert engines._leader(worker) is first and first.url == f"http://{h.HOST}:{ports[0]}"
    second = engines._launch(worker, h.HOST, first)
    try:
        h.wait_until(lambda: first.ready() and second.ready(), 60, what="simulators on the pods")
        h.wait_until(lambda: any(e["kind"] == "group_joined" for e in first.events()), 30, what="the worker joined its leader")
        second.proc.signal(signal.SIGKILL)
        assert first.proc.popen.wait(30) == 1 and "a collective of the engine's group failed" in first.proc.log_text()
    finally:
        for e in (first, second):
            e.proc.stop()


def test_a_worker_of_the_groups_earlier_incarnation_does_not_join_its_new_leader(tmp_path):
    """LWS recreates a group; the new leader pod takes the old leader's IP while an old worker's engine still tries
    to join it there. The new leader refuses that worker (it names the old leader's engine id), which dies (its
    rendezvous failed) without taking the new group down; its own worker joins. pods.py never points a worker at a
    deleted leader."""
    from types import SimpleNamespace

    from disagg_bench.vllm_sim.pods import PodEngines

    engines = PodEngines(None, "ns", "m", h.MODEL, tmp_path)  # no API call: only its launcher is used
    side, ports = h.free_port_block(4), h.free_ports(3)
    ann = {contract.ANNOTATION_TRANSFER_MODE: "Push", contract.ANNOTATION_SIDE_CHANNEL_PORT: str(side)}
    leader = member("d-0", 0, uid="uid-d-0-b", annotations={**ann, contract.ANNOTATION_HTTP_PORT: str(ports[0])})
    def worker(uid: str, port: int, side: int = side) -> dict:
        return member("d-0-1", 1, uid=uid, annotations={**ann, contract.ANNOTATION_HTTP_PORT: str(port), contract.ANNOTATION_SIDE_CHANNEL_PORT: str(side),
                                                       contract.LWS_LEADER_NAME_ANNOTATION: "d-0"})  # fmt: skip
    engines.engines["uid-d-0-b"] = new_leader = engines._launch(leader, h.HOST)
    earlier = SimpleNamespace(url=new_leader.url, engine_id=contract.engine_id("d-0", "uid-d-0-a"))  # the old leader, at its IP
    old_worker = engines._launch(worker("uid-d-0-1-a", ports[1], h.free_port_block(4)), h.HOST, earlier)  # type: ignore[arg-type]
    new_worker = engines._launch(worker("uid-d-0-1-b", ports[2]), h.HOST, new_leader)
    try:
        h.wait_until(lambda: new_leader.ready() and new_worker.ready(), 60, what="simulators on the pods")
        assert old_worker.proc.popen.wait(30) == 1 and "the engine's group cannot form" in old_worker.proc.log_text()
        assert "refused rank d-0-1.uid-d-0-1-a" in new_leader.proc.log_text()
        h.wait_until(lambda: any(e["kind"] == "group_joined" for e in new_leader.events()), 30, what="the new worker joined")
        assert [e["engine_id"] for e in new_leader.events() if e["kind"] == "group_joined"] == [new_worker.engine_id]
        assert engines._leader(worker("uid-d-0-1-c", ports[1])) is new_leader
        engines.gone.add("uid-d-0-b")  # its pod deleted (draining): a deleted leader's engine is no one's leader
        assert engines._leader(worker("uid-d-0-1-c", ports[1])) is None
        new_worker.proc.signal(signal.SIGKILL)
        assert new_leader.proc.popen.wait(30) == 1
        assert f"({new_worker.engine_id}) is gone" in new_leader.proc.log_text()
    finally:
        for e in (new_leader, old_worker, new_worker):
            e.proc.stop()
