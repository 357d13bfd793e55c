"""The router's failure contract, against simulated engines in separate processes (docs/router.md).

502 when decode fails before the first byte, 504 on a deadline, an SSE error event and the end of the
stream mid-body, 503 when no pair is ready; the prefill leg cancelled before the decode leg; engines that
answer 503, close their port or fail their probe ejected and re-admitted, and routed to anyway when ejection
left no pair; retries only before the first
byte, with fresh ids, never onto the pair that just failed. Nothing hangs.
"""

from __future__ import annotations

import asyncio
import pathlib
import signal
import sys

import aiohttp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from disagg_bench.vllm_sim import harness as h  # noqa: E402

SLOW_PREFILL = {"prefill_us_per_token": 5000.0}  # 5 ms per prompt token: 2000 words keep P busy 10 s


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("router-failures")


def _error(reply: h.Reply, status: int) -> dict:
    assert reply.status == status, reply.body
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def _failures(R: h.Router, revision: str = "r1") -> dict[str, int]:
    return R.health()["revisions"][revision]["failures"]


def _settled(R: h.Router) -> bool:
    """Every backend the router lists has no leg in flight."""
    return all(b["inflight"] == 0 for b in R.health()["backends"])


def _cancel_time(sim: h.Sim, xid: str) -> float:
    [ev] = [e for e in sim.events("cancelled") if e["xid"] == xid]
    return float(ev["t"])  # CLOCK_MONOTONIC: one clock for every process on the machine


def test_prefill_killed_before_the_first_byte_retries_on_another_pair(log_dir):
    P1 = h.launch_sim(log_dir, "prefill", "push", **SLOW_PREFILL)
    P2 = h.launch_sim(log_dir, "prefill", "push", **SLOW_PREFILL)
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "dies.json"
    h.write_static(static, [P1.static_entry(), P2.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", max_retries=1, name="router-dies")
    try:
        h.wait_ready(P1, P2, D, R)

        async def go():
            task = asyncio.create_task(h.post(R.url + "/v1/completions", h.completion(prompt_words=400, max_tokens=3, stream=True)))
            victim = await asyncio.to_thread(
                h.wait_until,
                lambda: next((p for p in (P1, P2) if p.counter("requests") == 1 and p.events("prefill_start") and p.counter("registrations_received") == 1), None),
                30,
                0.02,
                "a prefill in progress, its decode's registration answered",
            )  # fmt: skip
            # the prefill engine dies while computing; D's registration already went through (killed while D's
            # registration was in flight, D's own leg fails first: the retry is then the decode's, decode_failed)
            victim.proc.signal(signal.SIGKILL)
            return victim, await task

        victim, reply = asyncio.run(go())
        survivor = P2 if victim is P1 else P1
        assert reply.status == 200, reply.body
        assert reply.body.endswith(b"data: [DONE]\n\n") and b'"error"' not in reply.body
        # served by the other pair with fresh ids; the first ids died with their prefill
        assert [e["xid"] for e in survivor.events("leg_received")] == [reply.xid]
        decode_legs = D.events("leg_received")
        assert [e["xid"] for e in decode_legs][-1] == reply.xid and decode_legs[0]["xid"] != reply.xid
        first_tid, retry_tid = (e["kv_transfer_params"]["transfer_id"] for e in decode_legs)
        assert first_tid != retry_tid
        assert survivor.events("leg_received")[0]["kv_transfer_params"]["transfer_id"] == retry_tid
        # exactly one answer: the abandoned decode leg was cancelled by the router, one leg completed
        h.wait_until(lambda: D.counter("cancelled") == 1, 20, what="abandoned decode leg cancelled")
        assert not D.events("kv_load_failed") and D.counter("completed") == 1
        victim_key = victim.name
        assert R.backend(victim_key)["ejected"] is True  # connection refused: ejected, re-probed
        assert _failures(R) == {"prefill_connection": 1}
        assert 'disagg_router_retries_total{revision="r1"} 1.0' in R.metrics()
    finally:
        h.stop_all(R, P1, P2, D)


def test_a_retry_waits_for_the_refusing_decode_to_be_readmitted(log_dir):
    """A decode listed before its engine listens (a rollout's new pod: kwok marks pods Ready at once) or a restarting
    engine refuses the connection and is ejected. The retry waits for a probe to re-admit it, then goes there: it
    took nothing of the request. (Panic routing at once spent every retry on it within milliseconds: a 502.)"""
    P = h.launch_sim(log_dir, "prefill", "push")
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "refuses.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", max_retries=3, name="router-refused")
    try:
        h.wait_ready(P, D, R)
        D.proc.signal(signal.SIGKILL)
        D.proc.popen.wait(20)  # the decode's port is closed, its address still listed

        async def go():
            task = asyncio.create_task(h.post(R.url + "/v1/completions", h.completion(prompt_words=200, max_tokens=3, stream=True)))
            await asyncio.to_thread(h.wait_until, lambda: R.backend(D.name)["ejected"], 20, 0.02, "the refusing decode ejected")
            D.restart()  # its engine listens again
            return await task

        reply = asyncio.run(go())
        assert reply.status == 200, reply.body
        assert reply.body.endswith(b"data: [DONE]\n\n") and b'"error"' not in reply.body
        assert [e["xid"] for e in D.events("leg_received")] == [reply.xid]  # the restarted engine served the retry
        assert _failures(R) == {"decode_connection": 1}
        assert 'disagg_router_retries_total{revision="r1"} 1.0' in R.metrics()
    finally:
        h.stop_all(R, P, D)


@pytest.mark.parametrize(
    ("migrations", "why"), [("2", b"no other pair took its continuation"), ("0", b"stream migration is off")]
)
def test_decode_killed_mid_stream_with_no_other_decode_ends_with_an_error_and_no_done(log_dir, migrations, why):
    """Migration finds no other decode, or is off: the stream ends with an error event that says why and without
    ``[DONE]``, so that a client that trusts ``[DONE]`` does not take the truncated answer for a whole one."""
    P = h.launch_sim(log_dir, "prefill", "push")
    D = h.launch_sim(log_dir, "decode", "push", tpot_ms=50.0)  # 200 tokens: a 10 s stream
    static = log_dir / f"torn-{migrations}.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    R = h.launch_router(
        log_dir, static, "push", name=f"router-torn-{migrations}", extra=["--max-migrations", migrations, "--migration-wait-seconds", "1"]
    )  # the continuation waits 1 s for a pair, then ends
    try:
        h.wait_ready(P, D, R)

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                async with s.post(R.url + "/v1/completions", json=h.completion(max_tokens=200, stream=True)) as resp:
                    assert resp.status == 200
                    first = await resp.content.readany()
                    D.proc.signal(signal.SIGKILL)  # the decode engine dies mid-stream
                    return first + await resp.read()

        body = asyncio.run(go())
        events = [e for e in body.split(b"\n\n") if e]
        assert events[0].startswith(b'data: {"id"')
        assert events[-1].startswith(b'data: {"error"') and b"decode_stream_broken" in events[-1]
        assert (b": waiting for an engine to continue this stream" in events) == (migrations != "0")
        assert b"the answer is incomplete" in events[-1] and why in events[-1]
        assert b"data: [DONE]" not in events
        assert P.stats()["held"] == 0  # the prefill's blocks were pushed and released, nothing left open
        h.wait_until(lambda: _settled(R), 10, what="no leg in flight")
        assert _failures(R) == {"decode_stream_broken": 1}
    finally:
        h.stop_all(R, P, D)


def test_decode_stream_that_goes_silent_ends_at_the_deadline(log_dir):
    P = h.launch_sim(log_dir, "prefill", "push")
    D = h.launch_sim(log_dir, "decode", "push", tpot_ms=20.0)
    static = log_dir / "stall.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    # the hung engine never goes, so it is never used again: its stream waits 1 s for another pair, then ends
    R = h.launch_router(log_dir, static, "push", leg_timeout=1.0, name="router-stall", extra=["--migration-wait-seconds", "1"])
    try:
        h.wait_ready(P, D, R)

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                async with s.post(R.url + "/v1/completions", json=h.completion(max_tokens=500, stream=True)) as resp:
                    first = await resp.content.readany()
                    await asyncio.to_thread(D.control, stall=True)  # the engine hangs mid-stream
                    return first + await resp.read()

        try:
            body = asyncio.run(go())
        finally:
            D.control(stall=False)
        events = [e for e in body.split(b"\n\n") if e]
        assert b"decode_stall" in events[-1] and b"the answer is incomplete" in events[-1] and b"data: [DONE]" not in events
        h.wait_until(lambda: D.counter("cancelled") == 1, 20, what="the stalled decode leg cancelled")
        assert _failures(R) == {"decode_stall": 1}
    finally:
        h.stop_all(R, P, D)


def test_engine_that_answers_503_then_closes_is_ejected_and_readmitted(log_dir):
    """A dead vLLM: /health 503, 500 on a request, then its API server exits. Two routers: one probes every
    backend (finds the death itself), one only probes after a failed request."""
    P = h.launch_sim(log_dir, "prefill", "push")
    D1 = h.launch_sim(log_dir, "decode", "push", name="d1", extra=["--watchdog-seconds", "60"])
    D2 = h.launch_sim(log_dir, "decode", "push", name="d2")
    static = log_dir / "ejects.json"
    h.write_static(static, [P.static_entry(), D1.static_entry(), D2.static_entry()])
    probing = h.launch_router(log_dir, static, "push", extra=["--probe-interval-seconds", "0.2"], name="router-probing")
    lazy = h.launch_router(log_dir, static, "push", extra=["--probe-interval-seconds", "0"], name="router-lazy")
    try:
        h.wait_ready(P, D1, D2, probing, lazy)
        # a probe that ran before the engines listened ejected them: wait for the routers to admit all three
        for R in (probing, lazy):
            h.wait_until(lambda: not any(b["ejected"] for b in R.health()["backends"]), 10, what="every backend admitted")

        def burst(R: h.Router, n: int) -> list[h.Reply]:
            async def go():
                return await asyncio.gather(*(h.post(R.url + "/v1/completions", h.completion(max_tokens=2)) for _ in range(n)))

            return asyncio.run(go())

        D1.control(die="test: engine core died")  # /health 503 now; the port closes at the first new request
        h.wait_until(lambda: probing.backend("d1")["ejected"], 10, what="the probe ejects d1")
        served = D2.counter("requests")
        assert [r.status for r in burst(probing, 6)] == [200] * 6
        assert D2.counter("requests") == served + 6  # every request went to d2

        # the lazy router learns it from a request: 500 from d1 (the port closes after it), probe, eject;
        # the request itself is retried on d2
        replies = burst(lazy, 4)
        assert [r.status for r in replies] == [200] * 4
        h.wait_until(lambda: lazy.backend("d1")["ejected"], 10, what="d1 ejected after its 500")
        assert D1.proc.popen.wait(20) == 1 and not D1.listening()
        assert sum(_failures(lazy).values()) >= 1 and set(_failures(lazy)) <= {"decode_failed", "decode_connection"}

        D1.restart()  # the container restarts: same address and identity
        h.wait_ready(D1)
        for R in (probing, lazy):
            h.wait_until(lambda: not R.backend("d1")["ejected"], 30, what="d1 re-admitted after a good probe")
            before = D1.counter("requests")
            assert [r.status for r in burst(R, 6)] == [200] * 6
            assert D1.counter("requests") > before  # traffic returns to it
    finally:
        h.stop_all(probing, lazy, P, D1, D2)


def test_engines_ejected_by_a_stall_still_serve(log_dir):
    """A machine stalls (CPU starved: two CI runs on two cores did it) and every health probe times out at once:
    the router ejects every engine, though none died. It does not answer 503 from then until a probe re-admits
    one: ejection left no pair, so the ejected engines stand in (panic routing), and the request waits for them."""
    P = h.launch_sim(log_dir, "prefill", "push", name="p-stalled")
    D = h.launch_sim(log_dir, "decode", "push", name="d-stalled")
    static = log_dir / "stalled.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", extra=["--probe-interval-seconds", "0.2"], name="router-stalled")
    try:
        h.wait_ready(P, D, R)
        h.wait_until(lambda: not any(b["ejected"] for b in R.health()["backends"]), 10, what="both engines admitted")
        for engine in (P, D):
            engine.proc.signal(signal.SIGSTOP)  # the kernel still accepts connections; nothing answers them
        h.wait_until(lambda: all(b["ejected"] for b in R.health()["backends"]), 20, what="both ejected by timed-out probes")

        async def go():
            request = asyncio.create_task(h.post(R.url + "/v1/completions", h.completion(max_tokens=2)))
            # Dispatched while both are stopped (so still ejected: no probe can pass): only panic routing sends it.
            await asyncio.to_thread(h.wait_until, lambda: R.metric("disagg_router_routed_despite_ejections_total", revision="r1"),
                                    20, 0.05, "the request routed despite the ejections")  # fmt: skip
            for engine in (P, D):
                engine.proc.signal(signal.SIGCONT)
            return await request

        reply = asyncio.run(go())
        assert reply.status == 200, reply.body
        assert reply.xid in [e["xid"] for e in D.events("leg_received")]
        h.wait_until(lambda: not any(b["ejected"] for b in R.health()["backends"]), 20, what="both re-admitted by a probe")
        assert "routing to ejected backends of revision r1" in R.proc.log_text()
    finally:
        for engine in (P, D):
            engine.proc.signal(signal.SIGCONT)
        h.stop_all(R, P, D)


def test_unavailable_prefill_is_ejected_and_the_request_moves(log_dir):
    P1 = h.launch_sim(log_dir, "prefill", "push", name="p1")
    P2 = h.launch_sim(log_dir, "prefill", "push", name="p2")
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "paused.json"
    h.write_static(static, [P1.static_entry(), P2.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", extra=["--probe-interval-seconds", "0"], name="router-paused")
    try:
        h.wait_ready(P1, P2, D, R)
        P1.control(unavailable=True)  # vLLM answers 503 while paused (RetryableRequestError)

        async def go():
            return [await h.post(R.url + "/v1/completions", h.completion(max_tokens=2)) for _ in range(4)]

        assert [r.status for r in asyncio.run(go())] == [200] * 4  # each 503 was retried on p2
        # p1 is ejected at its 503, re-admitted by its next good probe (a paused engine is alive), and
        # ejected again by its next 503
        failed = _failures(R)
        assert set(failed) == {"prefill_unavailable"} and failed["prefill_unavailable"] == P1.counter("answered_503") >= 1
        assert P2.counter("requests") == 4
    finally:
        h.stop_all(R, P1, P2, D)


def test_prefill_deadline_is_504_and_cancels_prefill_before_decode(log_dir):
    P = h.launch_sim(log_dir, "prefill", "push", **SLOW_PREFILL)
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "deadline.json"
    h.write_static(static, [P.static_entry(), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", max_retries=1, leg_timeout=1.5, name="router-deadline")
    try:
        h.wait_ready(P, D, R)
        reply = asyncio.run(h.post(R.url + "/v1/completions", h.completion(prompt_words=2000, stream=True)))
        err = _error(reply, 504)
        assert "deadline" in err["message"]
        # one pair only: no retry onto the pair that just timed out
        [p_leg] = P.events("leg_received")
        assert len(D.events("leg_received")) == 1
        xid = p_leg["xid"]
        h.wait_until(lambda: P.counter("cancelled") == 1 and D.counter("cancelled") == 1, 20, what="both legs cancelled")
        assert _cancel_time(P, xid) < _cancel_time(D, xid)  # prefill first (vLLM #48633 C1)
        assert P.counter("pushes") == 0  # the aborted prefill never wrote into the aborted decode's blocks
        assert _failures(R) == {"prefill_timeout": 1}
    finally:
        h.stop_all(R, P, D)


def test_kv_wait_deadline_is_504(log_dir):
    """tp_size too large: D waits for notices P never sends. The KV-wait deadline ends it."""
    P = h.launch_sim(log_dir, "prefill", "push")
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "tp.json"
    h.write_static(static, [P.static_entry(tp_size=2), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", max_retries=1, leg_timeout=1.5, name="router-tp")
    try:
        h.wait_ready(P, D, R)
        reply = asyncio.run(h.post(R.url + "/v1/completions", h.completion(stream=True)))
        _error(reply, 504)
        assert P.counter("pushes") == 1 and D.counter("kv_received") == 0
        h.wait_until(lambda: D.counter("cancelled") == 1, 20, what="the decode leg cancelled")
        assert _failures(R) == {"kv_wait_timeout": 1}
        assert 'cause="kv_wait_timeout"' in R.metrics()
    finally:
        h.stop_all(R, P, D)


def test_one_pair_fails_fast_with_the_failure_it_has(log_dir):
    """The router's table has a stale engine id for P (P restarted): D's handshake is refused, D answers
    500 before its first token. With one pair, the retry has nowhere to go: 502 at once."""
    P = h.launch_sim(log_dir, "prefill", "push")
    D = h.launch_sim(log_dir, "decode", "push")
    static = log_dir / "stale.json"
    h.write_static(static, [P.static_entry(uid="stale-incarnation"), D.static_entry()])
    R = h.launch_router(log_dir, static, "push", max_retries=1, name="router-stale")
    try:
        h.wait_ready(P, D, R)
        for stream in (False, True):
            err = _error(asyncio.run(h.post(R.url + "/v1/completions", h.completion(stream=stream))), 502)
            assert "decode" in err["message"]
        assert P.counter("handshake_failures") == 2 and D.counter("kv_load_failures") == 2  # one attempt each
        assert D.stats()["waiting_for_kv"] == 0
        assert _failures(R) == {"decode_failed": 2}
        assert 'disagg_router_retries_total{revision="r1"} 0.0' in R.metrics()  # counted from 0, none made
    finally:
        h.stop_all(R, P, D)


def test_a_push_decode_failing_before_its_first_token_moves_the_retry_off_its_prefill_too(log_dir):
    """D's registration with P is refused (a stale engine id for P: P restarted), so D answers 500 while P's
    own leg is fine: either may be at fault. The retry takes another decode *and* another prefill, though this
    prefill is the least loaded one (the other is busy with traffic the router did not send): a new engine with
    an empty queue draws every load-aware pick, so going back to it burned both attempts (CI, a prefill pod
    listed before its engine listened). With one decode engine, the retry takes the other prefill with that
    decode (blaming the decode alone failed the request: CI, the autoscaler's burst e2e). With no other
    prefill, the retry uses the same one with the other decode."""
    stale = h.launch_sim(log_dir, "prefill", "push", name="p-stale")
    busy = h.launch_sim(log_dir, "prefill", "push", name="p-busy")
    D1, D2 = (h.launch_sim(log_dir, "decode", "push", name=f"d-{i}") for i in (1, 2))
    scrape = ("--load-scrape-interval-seconds", "0.1")
    both, one_decode, alone = (log_dir / f"implicated{s}.json" for s in ("", "-one-decode", "-alone"))
    h.write_static(both, [stale.static_entry(uid="stale-incarnation"), busy.static_entry(), D1.static_entry(), D2.static_entry()])
    h.write_static(one_decode, [stale.static_entry(uid="stale-incarnation"), busy.static_entry(), D1.static_entry()])
    h.write_static(alone, [stale.static_entry(uid="stale-incarnation"), D1.static_entry(), D2.static_entry()])
    R = h.launch_router(log_dir, both, "push", max_retries=1, extra=scrape, name="router-implicated")
    R_one = h.launch_router(log_dir, one_decode, "push", max_retries=1, extra=scrape, name="router-implicated-one-decode")
    R_alone = h.launch_router(log_dir, alone, "push", max_retries=1, extra=scrape, name="router-implicated-alone")

    def load(router: h.Router, name: str) -> float:
        return next(b for b in router.health()["backends"] if b["pod"] == name)["routing"]["load"] or 0.0

    async def while_busy() -> tuple[h.Reply, h.Reply]:
        prompt = lambda i: " ".join(f"bg{i}-{j}" for j in range(2000))  # noqa: E731
        background = [asyncio.create_task(h.post(busy.url + "/v1/completions", {**h.completion(max_tokens=1), "prompt": prompt(i)})) for i in range(8)]
        try:
            for router in (R, R_one):
                await asyncio.to_thread(h.wait_until, lambda: load(router, busy.name) >= 4, 10.0, 0.05, "the busy prefill's queue read")
            first = await h.post(R.url + "/v1/completions", h.completion(max_tokens=2))
            return first, await h.post(R_one.url + "/v1/completions", h.completion(max_tokens=2))
        finally:
            await asyncio.gather(*background)

    try:
        h.wait_ready(stale, busy, D1, D2, R, R_one, R_alone)
        reply, reply_one = asyncio.run(while_busy())
        assert reply.status == 200, reply.body
        assert reply_one.status == 200, reply_one.body
        assert stale.counter("handshake_failures") == 2  # each router's first attempt, and only that one
        assert {reply.xid, reply_one.xid} <= {e["xid"] for e in busy.events("leg_received")}
        assert reply_one.xid in [e["xid"] for e in D1.events("leg_received")]
        # R_one's two attempts both on D1, R's on one decode each: R's retry took the other decode
        assert [len(d.events("leg_received")) for d in (D1, D2)] == [3, 1]
        assert _failures(R) == {"decode_failed": 1}
        assert _failures(R_one) == {"decode_failed": 1}

        before = [len(d.events("leg_received")) for d in (D1, D2)]
        err = _error(asyncio.run(h.post(R_alone.url + "/v1/completions", h.completion())), 502)
        assert "decode" in err["message"]
        assert stale.counter("handshake_failures") == 4  # both attempts went to the only prefill
        assert [len(d.events("leg_received")) - b for d, b in zip((D1, D2), before)] == [1, 1]  # on both decodes
        assert _failures(R_alone) == {"decode_failed": 2}
    finally:
        h.stop_all(R, R_one, R_alone, stale, busy, D1, D2)


def test_no_pair_is_503(log_dir):
    P = h.launch_sim(log_dir, "prefill", "push")
    static = log_dir / "half.json"
    h.write_static(static, [P.static_entry()])
    R = h.launch_router(log_dir, static, "push", name="router-half")
    try:
        h.wait_ready(P, R)
        err = _error(asyncio.run(h.post(R.url + "/v1/completions", h.completion())), 503)
        assert "no revision has a ready prefill and decode engine pair" in err["message"]
        assert P.counter("requests") == 0
    finally:
        h.stop_all(R, P)
