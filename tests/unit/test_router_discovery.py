"""Discovery and pairing logic of the router, fed with pod objects as the API returns them (no cluster)."""

from __future__ import annotations

import copy
import json

import pytest

from disagg_connector import contract
from disagg_connector.router.config import parse_args
from disagg_connector.router.discovery import EndpointTable, backends_from_pod, load_static, pods_from_static
from disagg_connector.router.pairing import Balancer


def pod(
    name: str,
    role: str = "prefill",
    revision: str | None = "rev1",
    *,
    uid: str | None = None,
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    terminating: bool = False,
    created: str = "2026-01-01T00:00:00Z",
    annotations: dict[str, str] | None = None,
) -> dict:
    labels = {contract.LABEL_MODEL: "m", contract.LABEL_ROLE: role}
    if revision is not None:
        labels[contract.LABEL_REVISION] = revision
    meta = {
        "name": name,
        "namespace": "ns",
        "uid": uid or f"uid-{name}",
        "labels": labels,
        "annotations": annotations or {},
        "creationTimestamp": created,
        "resourceVersion": "1",
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:10:00Z"
    status = {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


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


def test_newest_policy_pairs_within_the_newest_eligible_revision():
    t = EndpointTable()
    old = [pod("p1"), pod("d1", "decode")]
    new = [pod(n, r, revision="rev2", created="2026-03-01T00:00:00Z") for n, r in (("p2", "prefill"), ("d2", "decode"))]
    t.replace(old + new[:1])
    bal = Balancer("newest")
    p, d = bal.choose_pair(t.snapshot())
    assert (p.revision, d.revision) == ("rev1", "rev1")  # rev2 has no decode yet
    t.replace(old + new)
    for _ in range(5):
        p, d = bal.choose_pair(t.snapshot())
        assert (p.revision, d.revision) == ("rev2", "rev2")


def test_spread_policy_never_mixes_revisions_and_balances_load():
    t = EndpointTable()
    t.replace(
        [pod("p1"), pod("d1", "decode"), pod("p2", revision="rev2"), pod("d2", "decode", revision="rev2")]
    )
    bal = Balancer("spread")
    seen = set()
    for _ in range(8):
        p, d = bal.choose_pair(t.snapshot())
        assert p.revision == d.revision
        bal.acquire(p)
        bal.acquire(d)
        seen.add(p.revision)
    assert seen == {"rev1", "rev2"}
    assert bal.inflight["p1"] == bal.inflight["p2"] == 4


def test_least_outstanding_exclusion_and_ejection():
    now = [0.0]
    t = EndpointTable()
    t.replace([pod("p1"), pod("p2"), pod("d1", "decode")])
    bal = Balancer("newest", eject_seconds=5, clock=lambda: now[0])
    p1 = next(b for b in t.snapshot().revisions[0].prefill if b.pod == "p1")
    bal.acquire(p1)
    assert bal.choose_prefill(t.snapshot()).pod == "p2"
    bal.release(p1)
    assert bal.choose_prefill(t.snapshot(), {"p2"}).pod == "p1"
    bal.eject(p1)
    assert bal.choose_prefill(t.snapshot()).pod == "p2"
    assert bal.choose_prefill(t.snapshot(), {"p2"}).pod in {"p1", "p2"}  # nothing usable: fall back
    now[0] = 6.0
    assert {bal.choose_prefill(t.snapshot()).pod for _ in range(4)} == {"p1", "p2"}


def test_idle_pairs_rotate_over_every_prefill_and_decode():
    """Sequential requests (nothing in flight) spread over all engines of both roles."""
    t = EndpointTable()
    t.replace([pod("p1"), pod("p2"), pod("d1", "decode"), pod("d2", "decode")])
    bal = Balancer("newest")
    chosen = [bal.choose_pair(t.snapshot()) for _ in range(100)]
    assert {p.pod for p, _ in chosen} == {"p1", "p2"} and {d.pod for _, d in chosen} == {"d1", "d2"}
    prefills = [bal.choose_prefill(t.snapshot()).pod for _ in range(10)]
    decodes = [bal.choose_decode(t.snapshot(), "rev1").pod for _ in range(10)]
    assert set(prefills) == {"p1", "p2"} and set(decodes) == {"d1", "d2"}


def test_no_pair_without_both_roles():
    t = EndpointTable()
    t.replace([pod("p1"), pod("d2", "decode", revision="rev2")])
    assert Balancer().choose_pair(t.snapshot()) is None


def test_static_file_goes_through_the_same_code(tmp_path):
    doc = {
        "endpoints": [
            {"role": "prefill", "revision": "a", "name": "p", "uid": "u", "host": "127.0.0.1", "http_port": 8100, "side_channel_port": 5610, "tp_size": 2},
            {"role": "decode", "revision": "a", "name": "d", "host": "127.0.0.1", "http_port": 8200},
            {"role": "prefill", "revision": "b", "name": "q", "engine_id": "explicit", "dp_size": 2},
            {"role": "decode", "revision": "b", "name": "e", "ready": False},
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
    assert [b.identity.engine_id for b in snap.revision("b").prefill] == ["explicit_dp0", "explicit_dp1"]
    assert not snap.revision("b").eligible
    yaml_file = tmp_path / "eps.yaml"
    yaml_file.write_text("endpoints:\n- {role: decode, name: d, revision: a}\n")
    assert pods_from_static({"endpoints": [{"role": "decode", "name": "d", "revision": "a"}]}) == load_static(yaml_file)


def test_table_input_is_not_mutated():
    p = pod("p1")
    before = copy.deepcopy(p)
    EndpointTable().replace([p])
    assert p == before


def test_cli_contract_flags():
    cfg = parse_args(
        [
            "--served-model-name", "qwen", "--mode", "pull", "--namespace", "ns", "--selector", "disagg.dev/model=qwen",
            "--port", "8000", "--leg-timeout-seconds", "20", "--max-retries", "2", "--shutdown-grace-seconds", "15",
        ]
    )
    assert (cfg.served_model_name, cfg.mode, cfg.namespace, cfg.selector) == ("qwen", "pull", "ns", "disagg.dev/model=qwen")
    assert (cfg.port, cfg.leg_timeout, cfg.max_retries, cfg.shutdown_grace) == (8000, 20.0, 2, 15.0)
    assert parse_args(["--served-model-name", "q", "--static-endpoints", "f.json"]).static_endpoints == "f.json"
    with pytest.raises(SystemExit):
        parse_args(["--served-model-name", "q", "--namespace", "ns"])  # no selector, no static file
