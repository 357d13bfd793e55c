"""Two revisions running at once: a prefill and a decode are paired only within one revision.

The simulated engines of each revision carry their own NIXL compatibility hash, as real vLLM engines of
two revisions would: a cross-revision pair would fail its handshake and show up in the counters.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.vllm_sim import harness as h  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("router-revisions")
    sims = {
        ("a", "prefill"): h.launch_sim(d, "prefill", "push", revision="a"),
        ("a", "decode"): h.launch_sim(d, "decode", "push", revision="a"),
        ("b", "prefill"): h.launch_sim(d, "prefill", "push", revision="b"),
        ("b", "decode"): h.launch_sim(d, "decode", "push", revision="b"),
    }
    static = d / "newest.json"
    h.write_static(static, [sims["a", "prefill"].static_entry(), sims["a", "decode"].static_entry()])
    spread = d / "spread.json"
    h.write_static(spread, [s.static_entry() for s in sims.values()])
    R = h.launch_router(d, static, "push")
    Rs = h.launch_router(d, spread, "push", extra=["--revision-policy", "spread"], name="router-spread")
    try:
        h.wait_ready(*sims.values(), R, Rs)
        yield sims, R, Rs
    finally:
        h.stop_all(R, Rs, *sims.values())


def _burst(url: str, n: int) -> list[h.Reply]:
    async def go():
        return await asyncio.gather(*(h.post(url + "/v1/completions", h.completion(max_tokens=5, stream=i % 2 == 0)) for i in range(n)))

    return asyncio.run(go())


def _assert_isolated(sims) -> None:
    for rev in ("a", "b"):
        P, D = sims[rev, "prefill"], sims[rev, "decode"]
        for ev in D.events("leg_received"):
            assert ev["kv_transfer_params"]["remote_engine_id"] == P.engine_id
        assert P.counter("handshake_failures") == 0 and D.counter("kv_load_failures") == 0


def test_spread_policy_serves_both_revisions_without_mixing(env):
    sims, _, Rs = env
    before = {k: s.counter("requests") for k, s in sims.items()}
    replies = _burst(Rs.url, 12)
    assert [r.status for r in replies] == [200] * 12
    for k, s in sims.items():
        assert s.counter("requests") > before[k], k  # both revisions took traffic
    _assert_isolated(sims)


def test_newest_eligible_revision_takes_over_and_gives_back(env):
    sims, R, _ = env
    Pa, Da, Pb, Db = sims["a", "prefill"], sims["a", "decode"], sims["b", "prefill"], sims["b", "decode"]
    R.wait_table({"a"})

    # rev b starts with its prefill only: not eligible, a keeps serving
    h.write_static(R.static_path, [Pa.static_entry(), Da.static_entry(), Pb.static_entry()])
    h.wait_until(lambda: any(r["revision"] == "b" for r in R.health()["revisions"]), what="b discovered")
    b0 = Pb.counter("requests")
    assert [r.status for r in _burst(R.url, 4)] == [200] * 4
    assert Pb.counter("requests") == b0

    # b's decode is ready: b is the newest eligible revision and takes every new request
    h.write_static(R.static_path, [Pa.static_entry(), Da.static_entry(), Pb.static_entry(), Db.static_entry()])
    R.wait_table({"a", "b"})
    a0 = Pa.counter("requests"), Da.counter("requests")
    assert [r.status for r in _burst(R.url, 6)] == [200] * 6
    assert (Pa.counter("requests"), Da.counter("requests")) == a0

    # b's decode goes away (not ready): traffic returns to a, never to a mixed pair
    h.write_static(R.static_path, [Pa.static_entry(), Da.static_entry(), Pb.static_entry(), Db.static_entry(ready=False)])
    R.wait_table({"a"})
    b1 = Pb.counter("requests")
    assert [r.status for r in _burst(R.url, 4)] == [200] * 4
    assert Pb.counter("requests") == b1
    _assert_isolated(sims)
