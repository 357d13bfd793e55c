"""kvbench: what push buys over pull on this fabric, for a KV cache shaped like a real model.

A producer process (prefill ranks) and a consumer process (decode ranks) move requests' KV with
the :mod:`disagg_bench.kvxfer` engine on NIXL, at a request rate, for each prompt length and
mode (``push``, ``pull-inline``, ``pull-background``). Per (length, mode) it prints:

* prefill done -> KV received (ms): from the producer's ``prefill_done`` call to the consumer's
  ``poll()`` reporting the request (both processes read the same monotonic clock);
* bandwidth = request bytes / that time, and its fraction of the raw copy ceiling measured in the
  same run (device-to-device ``copy_`` of the same number of bytes between the same two devices,
  or ``memcpy`` in DRAM);
* descriptors per request before and after coalescing;
* consumer-thread time per request: what the decode engine's own thread spent in transfer calls
  (register/pull and its share of poll), the stall pull puts on the decode loop.

Prefill compute is simulated by a timer (``--prefill-ms``); in push the consumer registers when a
request arrives (concurrent dispatch), in pull the producer relays its parameters to the consumer
over a pipe (the router hop, ``--relay-ms`` extra) when prefill is done.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

PRESETS: dict[str, dict[str, int]] = {
    "qwen3-32b": dict(num_layers=64, num_kv_heads=8, head_dim=128, dtype_bytes=2),
    "llama-3.1-70b": dict(num_layers=80, num_kv_heads=8, head_dim=128, dtype_bytes=2),
    "tiny": dict(num_layers=4, num_kv_heads=8, head_dim=64, dtype_bytes=2),
}
MODES = ("push", "pull-inline", "pull-background")


def _layout_dict(args: argparse.Namespace, num_blocks: int) -> dict[str, Any]:
    d = dict(PRESETS[args.model])
    for k in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
        v = getattr(args, k)
        if v:
            d[k] = v
    d.update(block_size=args.block_size, num_blocks=num_blocks, tp_size=1, tp_rank=0)
    return d


class BlockPool:
    def __init__(self, n: int, order: str, seed: int) -> None:
        import random

        self.free = list(range(n))
        self.order = order
        self.rng = random.Random(seed)

    def alloc(self, k: int) -> list[int] | None:
        if len(self.free) < k:
            return None
        if self.order == "random":
            picked = self.rng.sample(self.free, k)
            chosen = set(picked)
            self.free = [b for b in self.free if b not in chosen]
            return picked
        self.free.sort()
        picked, self.free = self.free[:k], self.free[k:]
        return picked

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


def _setup_cuda(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


# --- child processes ---------------------------------------------------------------------------
def _producer_main(conn: Any, side: Any, cfg: dict[str, Any]) -> None:
    try:
        _setup_cuda(cfg["p_device"])
        from disagg_bench.kvxfer import KVLayout, KVMemory, KVProducer

        layout = KVLayout.from_dict(cfg["layout"])
        mem = KVMemory(layout, cfg["p_device"])
        mem.fill_random_blocks(range(layout.num_blocks), seed=7)
        if cfg["p_device"].startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        prod = KVProducer("P", mem, cfg["backend"], lease_s=cfg["lease_s"], coalesce_descs=not cfg["no_coalesce"], max_desc_bytes=cfg["max_desc_bytes"])
        side.send(prod.info_blob())
        prod.add_peer(side.recv())
        conn.send(("ready", None))
        while True:
            msg, phase = conn.recv()
            if msg == "exit":
                break
            conn.send(("phase", _producer_phase(prod, side, phase, layout)))
        prod.close()
    except BaseException as e:  # report instead of hanging the parent
        import traceback

        conn.send(("error", f"producer: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _producer_phase(prod: Any, side: Any, ph: dict[str, Any], layout: Any) -> dict[str, Any]:
    pool = BlockPool(layout.num_blocks, ph["block_order"], seed=1)
    todo = sorted((ph["t0"] + a + ph["prefill_s"], rid) for rid, a in ph["schedule"])
    mode = "push" if ph["mode"] == "push" else "pull"
    nblk = layout.blocks_for(ph["tokens"])
    held: dict[str, list[int]] = {}
    results: dict[str, Any] = {}
    waiting: list[tuple[float, str]] = []
    checks: dict[str, int] = {}
    relays: list[tuple[float, dict[str, Any]]] = []
    n = len(todo)
    while len(results) < n:
        t = time.monotonic()
        while todo and todo[0][0] <= t:
            waiting.append(todo.pop(0))
        while waiting:
            blocks = pool.alloc(nblk)
            if blocks is None:
                break
            _, rid = waiting.pop(0)
            held[rid] = blocks
            params = prod.prefill_done(rid, blocks, ph["tokens"], mode=mode)
            if params is not None:
                relays.append((time.monotonic() + ph["relay_s"], params))
        while relays and relays[0][0] <= time.monotonic():
            side.send(relays.pop(0)[1])
        for r in prod.poll():
            results[r.request_id] = {"status": r.status, "message": r.message, "worker_s": r.worker_s, "t_pd": r.t_prefill_done, "t_done": r.t_done}
            if r.request_id == ph["verify_rid"]:
                checks[r.request_id] = prod.memory.checksum_blocks(held[r.request_id])
            pool.release(held.pop(r.request_id))
        if prod.error is not None:
            raise RuntimeError(f"producer thread failed: {prod.error}")
        time.sleep(0.0002)
    return {"results": results, "checksums": checks, "stats": dict(prod.stats)}


def _consumer_main(conn: Any, side: Any, cfg: dict[str, Any]) -> None:
    try:
        _setup_cuda(cfg["c_device"])
        from disagg_bench.kvxfer import KVConsumer, KVLayout, KVMemory

        layout = KVLayout.from_dict(cfg["layout"])
        mem = KVMemory(layout, cfg["c_device"])
        cons = {
            prep: KVConsumer(f"D-{prep}", mem, cfg["backend"], prep=prep, coalesce_descs=not cfg["no_coalesce"], max_desc_bytes=cfg["max_desc_bytes"])
            for prep in ("inline", "background")
        }
        pinfo = side.recv()
        side.send(cons["inline"].info_blob())
        for c in cons.values():
            c.add_peer(pinfo)
        conn.send(("ready", cons["background"].info_blob()))
        while True:
            msg, phase = conn.recv()
            if msg == "exit":
                break
            if msg == "peer":  # the producer learns the second decode agent through the parent
                continue
            conn.send(("phase", _consumer_phase(cons, side, phase, layout)))
        for c in cons.values():
            c.close()
    except BaseException as e:
        import traceback

        conn.send(("error", f"consumer: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _consumer_phase(cons: dict[str, Any], side: Any, ph: dict[str, Any], layout: Any) -> dict[str, Any]:
    mode = ph["mode"]
    c = cons["background" if mode == "pull-background" else "inline"]
    pool = BlockPool(layout.num_blocks, ph["block_order"], seed=2)
    nblk = layout.blocks_for(ph["tokens"])
    arrivals = sorted((ph["t0"] + a, rid) for rid, a in ph["schedule"])
    held: dict[str, list[int]] = {}
    pending_pull: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    checks: dict[str, int] = {}
    n = len(arrivals)
    step = ph["step_s"]
    calls0, base0 = c.poll_calls, c.poll_base_s
    while len(out) < n:
        t = time.monotonic()
        if mode == "push":
            while arrivals and arrivals[0][0] <= t:
                blocks = pool.alloc(nblk)
                if blocks is None:
                    break
                _, rid = arrivals.pop(0)
                held[rid] = blocks
                c.register(rid, blocks, ph["tokens"], "P", 1, deadline_s=ph["deadline_s"])
        else:
            while side.poll(0):
                pending_pull.append(side.recv())
            while pending_pull:
                blocks = pool.alloc(nblk)
                if blocks is None:
                    break
                params = pending_pull.pop(0)
                held[params["request_id"]] = blocks
                c.pull(params, blocks, deadline_s=ph["deadline_s"])
        for r in c.poll():
            out[r.request_id] = {
                "status": r.status,
                "message": r.message,
                "t_pd": r.t_prefill_done,
                "t_done": r.t_done,
                "t_start": r.t_start,
                "nbytes": r.nbytes,
                "descs_before": r.descs_before,
                "descs_after": r.descs_after,
                "caller_s": r.caller_s,
                "caller_setup_s": r.caller_setup_s,
                "worker_s": r.worker_s,
            }
            if r.request_id == ph["verify_rid"] and r.ok:
                checks[r.request_id] = c.memory.checksum_blocks(held[r.request_id])
            pool.release(held.pop(r.request_id))
        time.sleep(step)
    return {"results": out, "checksums": checks, "stale_notifs": c.stale_notifs, "poll_calls": c.poll_calls - calls0, "poll_base_s": c.poll_base_s - base0}


# --- ceiling -------------------------------------------------------------------------------------
def copy_ceiling(nbytes: int, p_device: str, c_device: str, reps: int = 7) -> float:
    """Median bytes/s of one plain copy of ``nbytes`` from the producer's to the consumer's memory kind."""
    if p_device == "cpu":
        import numpy as np

        a = np.ones(nbytes, dtype=np.uint8)
        b = np.zeros(nbytes, dtype=np.uint8)
        np.copyto(b, a)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            np.copyto(b, a)
            ts.append(time.perf_counter() - t)
        return nbytes / statistics.median(ts)
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device=p_device)
    b = torch.zeros(nbytes, dtype=torch.uint8, device=c_device)
    b.copy_(a)
    torch.cuda.synchronize(a.device)
    torch.cuda.synchronize(b.device)
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize(a.device)
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(a.device)
        torch.cuda.synchronize(b.device)
        ts.append(time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / statistics.median(ts)


# --- driver --------------------------------------------------------------------------------------
def _versions(p_dev: str, c_dev: str) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {"python": platform.python_version()}
    for pkg in ("nixl", "nixl-cu13", "nixl-cu12", "numpy", "torch", "msgpack"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    if p_dev.startswith("cuda"):
        import torch

        out["gpus"] = {d: torch.cuda.get_device_name(torch.device(d)) for d in sorted({p_dev, c_dev})}
    return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))
    return xs[i]


def _recv(conn: Any, what: str, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"{what}: no answer within {timeout_s:.0f} s")
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(payload)
    return payload


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokens = [int(t) for t in str(args.tokens).split(",")]
    modes = [m for m in args.modes.split(",")]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m}; choose from {', '.join(MODES)}")
    if args.device == "cuda":
        import torch

        ngpu = torch.cuda.device_count()
        if ngpu == 0:
            raise SystemExit("--device cuda but no GPU is visible")
        p_dev = f"cuda:{args.producer_gpu}"
        c_dev = f"cuda:{args.consumer_gpu if args.consumer_gpu is not None else (1 if ngpu > 1 else 0)}"
    else:
        p_dev = c_dev = "cpu"
    probe = _layout_dict(args, 1)
    from disagg_bench.kvxfer import KVLayout

    lay1 = KVLayout.from_dict(probe)
    max_blocks = lay1.blocks_for(max(tokens))
    num_blocks = max_blocks * args.slots
    cfg = {
        "layout": _layout_dict(args, num_blocks),
        "backend": args.backend,
        "p_device": p_dev,
        "c_device": c_dev,
        "lease_s": args.lease_s,
        "no_coalesce": args.no_coalesce,
        "max_desc_bytes": args.max_desc_bytes,
    }
    layout = KVLayout.from_dict(cfg["layout"])
    ctx = mp.get_context("spawn")
    p_parent, p_child = ctx.Pipe()
    c_parent, c_child = ctx.Pipe()
    side_p, side_c = ctx.Pipe()
    env_note = _versions(p_dev, c_dev)
    procs = [
        ctx.Process(target=_producer_main, args=(p_child, side_p, cfg), name="kvbench-producer", daemon=True),
        ctx.Process(target=_consumer_main, args=(c_child, side_c, cfg), name="kvbench-consumer", daemon=True),
    ]
    for p in procs:
        p.start()
    report: dict[str, Any] = {
        "command": "kvbench " + " ".join(sys.argv[1:]) if args._argv is None else "kvbench " + " ".join(args._argv),
        "model": args.model,
        "layout": cfg["layout"],
        "device": {"producer": p_dev, "consumer": c_dev},
        "backend": args.backend,
        "rate_rps": args.rate,
        "requests": args.requests,
        "warmup": args.warmup,
        "prefill_ms": args.prefill_ms,
        "step_ms": args.step_ms,
        "block_order": args.block_order,
        "host": platform.node(),
        "versions": env_note,
        "runs": [],
    }
    try:
        _recv(p_parent, "producer start", 600)
        _recv(c_parent, "consumer start", 600)
        import random

        rng = random.Random(args.seed)
        for ntok in tokens:
            nbytes = layout.blocks_for(ntok) * layout.block_bytes * layout.num_regions
            ceiling = copy_ceiling(nbytes, p_dev, c_dev)
            for mode in modes:
                n = args.warmup + args.requests
                sched, t = [], 0.0
                for i in range(n):
                    sched.append((f"{mode}-{ntok}-{i}", t))
                    t += rng.expovariate(args.rate) if args.poisson else 1.0 / args.rate
                prefill_s = (args.prefill_ms if args.prefill_ms >= 0 else 20 + ntok * 0.05) / 1000.0
                ph = {
                    "mode": mode,
                    "tokens": ntok,
                    "schedule": sched,
                    "t0": time.monotonic() + 0.3,
                    "prefill_s": prefill_s,
                    "relay_s": args.relay_ms / 1000.0,
                    "step_s": args.step_ms / 1000.0,
                    "deadline_s": args.deadline_s,
                    "block_order": args.block_order,
                    "verify_rid": sched[-1][0],
                }
                p_parent.send(("phase", ph))
                c_parent.send(("phase", ph))
                budget = t + prefill_s + args.deadline_s + 60
                pres = _recv(p_parent, f"producer {mode} {ntok}", budget)
                cres = _recv(c_parent, f"consumer {mode} {ntok}", budget)
                report["runs"].append(_summarise(mode, ntok, nbytes, ceiling, sched, args.warmup, pres, cres))
                if not args.json_only:
                    _print_run(report["runs"][-1], header=len(report["runs"]) == 1)
        for conn in (p_parent, c_parent):
            conn.send(("exit", None))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return report


def _summarise(mode, ntok, nbytes, ceiling, sched, warmup, pres, cres) -> dict[str, Any]:
    rids = [rid for rid, _ in sched][warmup:]
    c, p = cres["results"], pres["results"]
    ok = [r for r in rids if c.get(r, {}).get("status") == "ok"]
    lat = [c[r]["t_done"] - c[r]["t_pd"] for r in ok if c[r]["t_pd"] is not None]
    bw = [c[r]["nbytes"] / x for r, x in zip(ok, lat) if x > 0]
    caller = [c[r]["caller_s"] for r in ok]
    setup = [c[r]["caller_setup_s"] for r in ok]
    if mode == "pull-background":
        worker = [c[r]["worker_s"] for r in ok]  # the consumer's pull thread
    elif mode == "push":
        worker = [p[r]["worker_s"] for r in ok if r in p]  # the producer's writer thread
    else:
        worker = []
    verify = sched[-1][0]
    verified = cres["checksums"].get(verify)
    failures = {r: (c.get(r) or {}).get("status", "missing") + ": " + (c.get(r) or {}).get("message", "") for r in rids if r not in ok}
    med_lat = statistics.median(lat) if lat else float("nan")
    med_bw = statistics.median(bw) if bw else float("nan")
    return {
        "mode": mode,
        "tokens": ntok,
        "bytes_per_request": nbytes,
        "requests_ok": len(ok),
        "requests": len(rids),
        "failures": failures,
        "latency_ms_p50": med_lat * 1e3,
        "latency_ms_p90": _pct(lat, 0.9) * 1e3,
        "bandwidth_GBps_p50": med_bw / 1e9,
        "ceiling_GBps": ceiling / 1e9,
        "fraction_of_ceiling": med_bw / ceiling,
        "descs_before": c[ok[0]]["descs_before"] if ok else None,
        "descs_after": c[ok[0]]["descs_after"] if ok else None,
        "consumer_thread_ms_p50": statistics.median(caller) * 1e3 if caller else None,
        "consumer_setup_ms_p50": statistics.median(setup) * 1e3 if setup else None,
        "background_thread_ms_p50": statistics.median(worker) * 1e3 if worker else None,
        "verified": None if verified is None else verified == pres["checksums"].get(verify),
        "stale_notifs": cres.get("stale_notifs", 0),
        "poll_base_us_per_call": 1e6 * cres["poll_base_s"] / max(1, cres["poll_calls"]),
    }


def _print_run(r: dict[str, Any], header: bool) -> None:
    if header:
        print(
            f"{'mode':<16}{'tokens':>7}{'MiB/req':>9}{'ok':>6}{'p50 ms':>9}{'p90 ms':>9}{'GB/s':>8}{'ceil GB/s':>10}{'frac':>6}"
            f"{'descs':>14}{'cons-thr ms':>12}{'bg-thr ms':>10}{'bytes ok':>9}",
            flush=True,
        )
    v = {True: "yes", False: "NO", None: "-"}[r["verified"]]
    descs = f"{r['descs_before']}->{r['descs_after']}" if r["descs_before"] is not None else "-"
    ct = f"{r['consumer_thread_ms_p50']:.3f}" if r["consumer_thread_ms_p50"] is not None else "-"
    bt = f"{r['background_thread_ms_p50']:.3f}" if r["background_thread_ms_p50"] is not None else "-"
    print(
        f"{r['mode']:<16}{r['tokens']:>7}{r['bytes_per_request'] / 2**20:>9.0f}{r['requests_ok']:>3}/{r['requests']:<2}"
        f"{r['latency_ms_p50']:>9.2f}{r['latency_ms_p90']:>9.2f}{r['bandwidth_GBps_p50']:>8.1f}{r['ceiling_GBps']:>10.1f}"
        f"{r['fraction_of_ceiling']:>6.2f}{descs:>14}{ct:>12}{bt:>10}{v:>9}",
        flush=True,
    )
    for rid, why in list(r["failures"].items())[:3]:
        print(f"  failed {rid}: {why}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvbench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESETS), default="qwen3-32b", help="KV shape preset")
    ap.add_argument("--num-layers", type=int, default=0, help="override the preset")
    ap.add_argument("--num-kv-heads", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=0)
    ap.add_argument("--dtype-bytes", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=128, help="tokens per KV block")
    ap.add_argument("--tokens", default="1024,4096,16384", help="prompt lengths, comma separated")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second")
    ap.add_argument("--poisson", action="store_true", help="Poisson arrivals (default: evenly spaced)")
    ap.add_argument("--requests", type=int, default=8, help="measured requests per (length, mode)")
    ap.add_argument("--warmup", type=int, default=2, help="requests before those, not counted")
    ap.add_argument("--prefill-ms", type=float, default=-1, help="simulated prefill time (default 20 ms + 0.05 ms/token)")
    ap.add_argument("--relay-ms", type=float, default=0.0, help="extra router hop in pull mode")
    ap.add_argument("--step-ms", type=float, default=0.2, help="consumer loop period (how often it polls)")
    ap.add_argument("--slots", type=int, default=4, help="KV pool size in requests of the longest length")
    ap.add_argument("--block-order", choices=("contiguous", "random"), default="contiguous", help="block allocation (random defeats coalescing)")
    ap.add_argument("--no-coalesce", action="store_true", help="one descriptor per block (naive)")
    ap.add_argument("--max-desc-bytes", type=int, default=None, help="cap on a coalesced descriptor")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--producer-gpu", type=int, default=0)
    ap.add_argument("--consumer-gpu", type=int, default=None, help="default: 1 when two GPUs are visible, else 0")
    ap.add_argument("--backend", choices=("UCX", "LIBFABRIC"), default="UCX")
    ap.add_argument("--lease-s", type=float, default=30.0)
    ap.add_argument("--deadline-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", help="write the report as JSON (to PATH, or stdout)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args._argv = argv
    args.json_only = args.json == "-"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    report = run(args)
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    bad = [r for r in report["runs"] if r["requests_ok"] < r["requests"] or r["verified"] is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
