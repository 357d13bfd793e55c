"""Issue 19 at scale, on CPU: 4 prefill and 4 decode simulated engines (vLLM's prefix cache, its
`vllm:prefix_cache_{hits,queries}_total` counters and KV events), multi-turn conversations, and every router
policy run as **two router replicas** sharing the traffic (`disagg-localrun bench --router-replicas 2`).

Each replica knows only its own in-flight requests; what the replicas share is what the engines publish, their
/metrics (load) and their KV events (which blocks each engine holds). The requests are spread over the replicas
per request (`--replica-spread request`), so a conversation's turns alternate between them and a replica never
sent the turn before: it finds where that turn's prefix lives only in the engines' KV events, which is why the
prompts go as token ids (`--prompt-format token-ids`: the router matches token ids exactly against the events;
text would use each replica's own approximate index). The hit ratios are the engines' own counters; TTFT is
printed, not asserted (2 shared cores)."""

from __future__ import annotations

import json
from pathlib import Path

from disagg_bench.localrun.report import ideal_hit_ratio, router_replicas, routing
from disagg_bench.vllm_sim import harness as h

from tests.fixtures.models import dm

MODES = ("router-push:least-outstanding", "router-push:prefix-and-load")
SYSTEM_TOKENS, RATE = 512, 4.0


def test_two_router_replicas_find_each_conversation_cached_through_the_engines_kv_events(tmp_path: Path) -> None:
    model = tmp_path / "dm.yaml"
    spec = {"engine": {"enablePrefixCaching": True, "blockSize": 16}, "prefill": {"replicas": 4}, "decode": {"replicas": 4},
            "router": {"prefillPolicy": "PrefixAndLoad"}}  # fmt: skip
    model.write_text(json.dumps(dm(spec, name="scale")))
    out = tmp_path / "out"
    proc = h.localrun_bench(
        model, out, 8, "--router-replicas", "2", "--replica-spread", "request", "--prompt-format", "token-ids",
        "--workload", "multi-turn", "--modes", ",".join(MODES), "--system-tokens", str(SYSTEM_TOKENS), "--turns", "4",
        "--user-tokens", "128", "--think-time", "0.3", "--rates", str(RATE), "--cell-seconds", "5", "--min-requests", "20",
        "--max-tokens", "8", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    cells = {c["mode"]: c for c in results["cells"]}
    assert set(cells) == set(MODES)

    for m, c in cells.items():
        # no request failed, on either replica, and both replicas served (the client's record and the routers' own counts)
        assert (c["ok"], c["failed"], c["unfinished"], c["sessions"]) == (c["sent"], 0, 0, 20), (m, c["errors"])
        replicas = router_replicas(c)
        assert len(replicas) == 2, replicas  # the router mode, and `#1` for the second replica
        print(m, {label: (r.requests, r.failures) for label, r in replicas.items()})
        assert all(r.ok > 0 for r in replicas.values()), (m, replicas)
        assert sum(r.ok + r.not_ok for r in replicas.values()) == c["sent"]
        # and the routers agree: a client that hangs up once it has [DONE] is no disconnect (499)
        assert all(r.not_ok == 0 and not r.failures for r in replicas.values()), (m, replicas)
        sent_to = {r["replica"] for r in results["records"] if r["mode"] == m}
        assert sent_to == {0, 1}

    ideal = ideal_hit_ratio(results, SYSTEM_TOKENS, RATE)
    lo, pal = routing(cells[MODES[0]]), routing(cells[MODES[1]])
    assert ideal is not None and lo is not None and pal is not None
    for m in MODES:
        c, f = cells[m], routing(cells[m])
        print(f"{m}: hit ratio {f.hit_ratio:.3f} (ideal {ideal:.3f}, {f.hit_ratio / ideal:.2f} of it), shares "
              f"{ {k: round(v, 2) for k, v in f.shares.items()} }, TTFT p50 {c['ttft']['p50'] * 1e3:.1f} ms p90 "
              f"{c['ttft']['p90'] * 1e3:.1f} ms, prefill picks {[r.prefill_picks for r in router_replicas(c).values()]}")
    # a replica finds the previous turn (sent by the other replica) on its engine through the KV events
    assert pal.hit_ratio >= 0.9 * ideal, (pal, ideal)
    assert pal.hit_ratio > lo.hit_ratio, (pal, lo)
    pal_picks = [r.prefill_picks for r in router_replicas(cells[MODES[1]]).values()]
    assert all(p.get("cache_hit", 0) > 0 for p in pal_picks), pal_picks
