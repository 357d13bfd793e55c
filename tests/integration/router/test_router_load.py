"""Load that every router replica sees alike (docs/router.md, Policies): the router reads each engine's
``vllm:num_requests_running``/``waiting`` from its ``/metrics``, so an engine kept busy by traffic this router did
not send (another replica's, a client's straight to the engine) stops attracting new work; the router's own
in-flight count, least-outstanding's only data, cannot see that traffic."""

from __future__ import annotations

import asyncio
from typing import Any

from disagg_bench.vllm_sim import harness as h


def _backend(router: h.Router, pod: str) -> dict[str, Any]:
    return next(b for b in router.health()["backends"] if b["pod"] == pod)


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


# Prompt words per router (the simulator counts a word a token): how the engines' records tell the routers apart.
WORDS = {"prefix-and-load": 300, "least-outstanding": 400}
# Requests kept queued on the busy engine: 4.8 s of prefill, while eight short requests go through the routers.
BACKGROUND = 24


async def _through_router_while_busy(busy: h.Sim, routers: list[h.Router], per_router: int) -> list[h.Reply]:
    """BACKGROUND long prompts straight to ``busy`` (each prefill 200 ms, one at a time), and, once the routers
    read the queue, ``per_router`` short prompts through each router, one after the other, all sent while that
    queue lasts (asserted: on a loaded machine eight of them, 1.6 s, once drained before the last was sent)."""
    background = [
        asyncio.create_task(h.post(busy.url + "/v1/completions", {**h.completion(max_tokens=1), "prompt": _words(f"bg{i}-", 2000)}))
        for i in range(BACKGROUND)
    ]
    try:
        for router in routers:
            await asyncio.to_thread(
                h.wait_until, lambda r=router: _backend(r, busy.name)["routing"]["load"] >= 4, 10.0, what=f"{busy.name}'s queue read"
            )
        replies = []
        for i in range(per_router):
            for router in routers:
                body = {**h.completion(max_tokens=2), "prompt": _words(f"fg{i}-", WORDS[router.proc.name])}
                replies.append(await h.post(router.url + "/v1/completions", body))
        assert not all(t.done() for t in background), f"{busy.name}'s queue drained before the last request was sent"
        return replies
    finally:
        await asyncio.gather(*background)


def test_an_engine_busy_with_traffic_the_router_did_not_send_stops_attracting_new_work(tmp_path) -> None:
    p0, p1, d = h.launch_sim(tmp_path, "prefill", name="p0"), h.launch_sim(tmp_path, "prefill", name="p1"), h.launch_sim(tmp_path, "decode", name="d0")
    static = tmp_path / "endpoints.json"
    h.write_static(static, [p0.static_entry(), p1.static_entry(), d.static_entry()])
    read = ("--load-scrape-interval-seconds", "0.1")
    by_load = h.launch_router(tmp_path, static, extra=read, name="prefix-and-load")
    outstanding = h.launch_router(tmp_path, static, extra=(*read, "--prefill-policy", "least-outstanding"), name="least-outstanding")
    try:
        h.wait_ready(p0, p1, d, by_load, outstanding)
        for r in (by_load, outstanding):
            h.wait_until(lambda r=r: r.health()["revisions"]["r1"]["readyPairs"] == 1, what="a ready pair")
        before = {s.name: len(s.events("leg_received")) for s in (p0, p1)}
        replies = asyncio.run(_through_router_while_busy(p0, [by_load, outstanding], per_router=4))
        assert [r.status for r in replies] == [200] * 8
        legs = [e for s in (p0, p1) for e in s.events("leg_received")]
        assert len(legs) == sum(before.values()) + BACKGROUND + 8  # the background's, both routers' four each

        def served(router: h.Router) -> dict[str, int]:
            words = WORDS[router.proc.name]
            return {s.name: sum(words <= e["prompt_tokens"] < words + 8 for e in s.events("leg_received")) for s in (p0, p1)}

        # prefix-and-load saw p0's queue in its /metrics: all four to p1; least-outstanding alternates blind
        assert served(by_load) == {"p0": 0, "p1": 4}, served(by_load)
        assert served(outstanding) == {"p0": 2, "p1": 2}, served(outstanding)
        picks = h.http_get(by_load.url + "/metrics")[1].decode()
        assert 'disagg_router_picks_total{policy="prefix-and-load",reason="load",role="prefill"} 4.0' in picks
    finally:
        h.stop_all(by_load, outstanding, p0, p1, d)
