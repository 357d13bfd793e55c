"""Issue 18's evidence from one `disagg-localrun bench` run of engines that span pods (hack/gpu/run.sh
issue18-dp2): per pod (so per data-parallel rank range) what it served and its NIXL handshakes, from the
engines' own counters and logs, and the requests' outcome through the router.

    python hack/gpu/dp_report.py BENCH_OUT_DIR OUT.json OUT.md

BENCH_OUT_DIR holds results.json and logs/ (one log per process, named <role>-<i>[-pod<k>]-<mode>.log).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

# What shows a pod's part in its DP group and in the P/D transfers (vLLM 0.26.0's messages; the simulator's).
EVIDENCE = {
    "nixl_handshake": r"NIXL compatibility check passed|Push handshake to D|Failed handshake|handshake_failed|"
                      r"Remote NIXL agent engine ID mismatch|Initializing NIXL (worker|Scheduler)",
    "data_parallel": r"autoswitch to data_parallel_external_lb|DP Coordinator|data_parallel_rank|"
                     r"EngineCore_DP\d+ pid=\d+\).*(Initializing a V1 LLM engine|Started)|"
                     r"unexpected data parallel rank|expected it to be local|Did not receive response from front-end",
    "errors": r"\bERROR\b|Traceback|EngineCore failed|AssertionError|RuntimeError|ValueError",
    "workaround": r"vllm_dense_xlb",
}
ACCESS = re.compile(r'"POST /v1/(chat/)?completions HTTP/1\.1" (\d{3})')
SIM_SERVED = re.compile(r"vllm_sim .* listening")


def _lines(text: str, pattern: str, limit: int = 40, distinct: bool = True) -> list[str]:
    """Lines matching `pattern`, in order; `distinct`: each message once (handshakes: every one, with its time)."""
    rx, seen, out = re.compile(pattern), set(), []
    for line in text.splitlines():
        if rx.search(line):
            msg = re.sub(r"^.*?\]\s*", "", line)[:300]
            if not distinct or msg not in seen:
                seen.add(msg)
                out.append(line.strip()[:400])
        if len(out) >= limit:
            break
    return out


def _served(counters: dict[str, Any]) -> dict[str, float]:
    """vllm:request_success_total per `engine` label (the DP rank), summed over finish reasons."""
    out: dict[str, float] = {}
    for key, value in (counters.get("metrics") or {}).items():
        if key.startswith("vllm:request_success_total"):
            m = re.search(r'engine="([^"]*)"', key)
            out[m.group(1) if m else "?"] = out.get(m.group(1) if m else "?", 0.0) + value
    return out


def report(bench_dir: Path) -> dict[str, Any]:
    results = json.loads((bench_dir / "results.json").read_text())
    group = results["groups"][-1]
    counters = group.get("engine_counters") or {}
    pods = []
    for label, c in counters.items():
        logs = sorted((bench_dir / "logs").glob(f"{label}-*.log"))
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        access = [int(m.group(2)) for m in ACCESS.finditer(text)]
        sim = c.get("sim_counters") or {}
        pods.append({
            "pod": label,
            "role": c["role"],
            "dp_ranks": c["dp_ranks"],
            "served_by_engine_label": _served(c),
            "http_completions": {"200": sum(1 for s in access if s == 200), "other": sum(1 for s in access if s != 200)},
            "sim_counters": {k: sim[k] for k in ("prefills", "pushes", "kv_received", "registrations_received",
                                                  "registrations_sent", "handshake_failures") if k in sim} or None,
            **{k: _lines(text, p, distinct=k != "nixl_handshake") for k, p in EVIDENCE.items()},
            "log": [p.name for p in logs],
        })
    cells = [{k: cell[k] for k in ("mode", "prompt_tokens", "rate", "sent", "ok", "failed", "unfinished", "errors")}
             | {"ttft_p50_s": cell["ttft"]["p50"], "tpot_p50_s": cell["tpot"]["p50"]} for cell in results["cells"]]
    warm = results.get("warmup") or []
    sent = sum(c["sent"] for c in cells) + len(warm)
    ok = sum(c["ok"] for c in cells) + sum(1 for w in warm if w.get("ok", w.get("status") == 200))

    def used(p: dict[str, Any]) -> int:
        by_label = sum(p["served_by_engine_label"].values())
        sim = p["sim_counters"] or {}
        return int(by_label or p["http_completions"]["200"] or sim.get("prefills", 0) or sim.get("kv_received", 0))

    roles: dict[str, Any] = {}
    for p in pods:
        r = roles.setdefault(p["role"], {"pods": 0, "pods_used": 0, "requests_per_pod": {}, "ranks": 0,
                                         "requests_per_rank": {}})
        r["pods"] += 1
        r["requests_per_pod"][p["pod"]] = used(p)
        r["pods_used"] += used(p) > 0
        r["ranks"] += len(p["dp_ranks"])
        for rank, n in p["served_by_engine_label"].items():  # vLLM's `engine` label: the global DP rank
            r["requests_per_rank"][rank] = r["requests_per_rank"].get(rank, 0) + int(n)
    for r in roles.values():
        counted = r["requests_per_rank"]
        r["ranks_used"] = sum(1 for n in counted.values() if n > 0) if counted else None  # None: no per-rank counter
    return {
        "command": results["command"],
        "started": results["started"],
        "environment": results.get("environment"),
        "engine_version": group.get("engine_version"),
        "startup_seconds": group.get("startup_seconds"),
        "plan": group.get("plan"),
        "overrides": group.get("overrides"),
        "requests": {"sent": sent, "ok": ok, "cells": cells},
        "roles": roles,
        "all_ranks_used": bool(roles) and all(r["pods_used"] == r["pods"] and r["ranks_used"] in (None, r["ranks"])
                                              for r in roles.values()),
        "pods": pods,
    }


def markdown(rep: dict[str, Any]) -> str:
    env = rep.get("environment") or {}
    out = [f"# Engines across pods: {rep['requests']['ok']}/{rep['requests']['sent']} requests ok through the router",
           "", f"- vLLM {rep.get('engine_version') or env.get('vllm', '?')}, NIXL {env.get('nixl-cu13') or env.get('nixl', '?')}, "
           f"torch {env.get('torch', '?')}; GPUs: {', '.join(env.get('gpus') or ['none (rehearsal)'])}",
           f"- started {rep['started']}; healthy after (s): "
           + ", ".join(f"{k} {v:.0f}" for k, v in (rep.get("startup_seconds") or {}).items()),
           f"- every pod (and, where vLLM counts them, every DP rank) of every role served requests: "
           f"**{'yes' if rep['all_ranks_used'] else 'NO'}**; per rank: "
           + "; ".join(f"{role} {json.dumps(r['requests_per_rank']) if r['requests_per_rank'] else '(no per-rank counter)'}"
                       for role, r in rep["roles"].items()), "",
           "| pod | role | DP ranks | requests served | vllm:request_success_total by engine | HTTP 200 | handshake lines | errors |",
           "|---|---|---|---|---|---|---|---|"]
    for p in rep["pods"]:
        out.append(f"| {p['pod']} | {p['role']} | {','.join(map(str, p['dp_ranks']))} | "
                   f"{rep['roles'][p['role']]['requests_per_pod'][p['pod']]} | "
                   f"{json.dumps(p['served_by_engine_label']) if p['served_by_engine_label'] else '-'} | "
                   f"{p['http_completions']['200']} | {len(p['nixl_handshake'])} | {len(p['errors'])} |")
    out += ["", "| cell | sent | ok | failed | TTFT p50 ms | TPOT p50 ms |", "|---|---|---|---|---|---|"]
    for c in rep["requests"]["cells"]:
        ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"  # noqa: E731
        out.append(f"| {c['mode']} {c['prompt_tokens']} x {c['rate']:g}/s | {c['sent']} | {c['ok']} | {c['failed']} | "
                   f"{ms(c['ttft_p50_s'])} | {ms(c['tpot_p50_s'])} |")
    for p in rep["pods"]:
        out += ["", f"## {p['pod']} ({p['role']}, DP ranks {p['dp_ranks']})", "", "```"]
        out += p["workaround"][:2] + p["data_parallel"][:12] + p["nixl_handshake"][:16] + p["errors"][:8]
        out.append("```")
    out += ["", "## Command lines (as disagg-localrun ran them)", "", "```", rep.get("plan") or "", "```", ""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    bench_dir, json_out, md_out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    if not (bench_dir / "results.json").is_file():  # no engine became healthy: say why, per process
        print(f"dp_report: no {bench_dir / 'results.json'} (the bench stopped before its first cell); per log:")
        for log in sorted((bench_dir / "logs").glob("*.log")):
            text = log.read_text(errors="replace")
            why = _lines(text, r"autoswitch to data_parallel_external_lb|Value error|\) [\w.]*(Error|Exception)(:|$)", limit=4)
            print(f"  {log.name}: " + (" | ".join(re.sub(r"^\(\w+ pid=\d+\)\s*", "", w)[:160] for w in why) or "(nothing)"))
        return 1
    rep = report(bench_dir)
    json_out.write_text(json.dumps(rep, indent=1))
    md_out.write_text(markdown(rep))
    print(markdown(rep).split("\n## ")[0])
    return 0 if rep["all_ranks_used"] and rep["requests"]["ok"] == rep["requests"]["sent"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
