"""What the prefix-and-load policy costs the router per request, and what its index costs in memory.

    python -m disagg_bench.prefix_index            # ~20 s
    python -m disagg_bench.prefix_index --runs 9

Per prompt length (tokens, as text of 4 bytes a token): the time of one prefill pick with ``prefix-and-load``
(the prompt's chunk keys, the match over 8 backends, the insertion) against the baseline measured in the same
run, a ``least-outstanding`` pick (which also makes the keys and inserts: it still reports the expected hit),
and a bare ``Balancer.least`` (what the router did before policies). Medians of ``--runs`` runs of 200 picks
each, contenders interleaved. Then the index's memory: tracemalloc's growth per (backend, chunk) entry after
filling it with distinct prompts.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc

from disagg_connector.contract import EngineIdentity
from disagg_connector.router.discovery import Backend
from disagg_connector.router.load import LoadBoard
from disagg_connector.router.pairing import Balancer
from disagg_connector.router.policy import Policies
from disagg_connector.router.prefix import PrefixIndex, prompt_key

BACKENDS = 8
PICKS = 200


def _backends() -> list[Backend]:
    return [
        Backend("prefill", "r1", f"p{i}", "uid", "10.0.0.1", EngineIdentity(f"p{i}.uid", "10.0.0.1", 5600, 1, 1))
        for i in range(BACKENDS)
    ]


def _prompts(tokens: int, rng: random.Random) -> list[dict[str, str]]:
    system = "".join(rng.choice("abcdefgh ") for _ in range(tokens * 2))  # half the prompt shared
    return [{"prompt": system + "".join(rng.choice("abcdefgh ") for _ in range(tokens * 2))} for _ in range(PICKS)]


def _time_picks(policy: str | None, prompts: list[dict[str, str]], tokens: int) -> float:
    """Microseconds per pick."""
    cands = _backends()
    balancer = Balancer()
    policies = Policies(policy or "least-outstanding", "least-loaded", balancer, LoadBoard(1.0), PrefixIndex())
    start = time.perf_counter()
    for body in prompts:
        if policy is None:
            balancer.least(cands, "prefill")
        else:
            policies.prefill(cands, prompt_key("completions", body, tokens))
    return (time.perf_counter() - start) / len(prompts) * 1e6


def _bytes_per_entry(entries: int) -> float:
    index = PrefixIndex(max_chunks=entries * 2)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    n = 0
    while index.size < entries:
        index.insert(f"p{n % BACKENDS}", tuple(range(n * 1000, n * 1000 + 1000)))
        n += 1
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    return grown / index.size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--lengths", default="1024,4096,16384")
    a = p.parse_args(argv)
    rng = random.Random(0)
    print(f"one prefill pick among {BACKENDS} backends, us (median of {a.runs} runs of {PICKS} picks)")
    print(f"{'prompt tokens':>14} {'Balancer.least':>15} {'least-outstanding':>18} {'prefix-and-load':>16} {'p&l - least':>12}")
    for tokens in (int(x) for x in a.lengths.split(",")):
        prompts = _prompts(tokens, rng)
        runs: dict[str | None, list[float]] = {None: [], "least-outstanding": [], "prefix-and-load": []}
        for _ in range(a.runs):
            for policy in runs:
                runs[policy].append(_time_picks(policy, prompts, tokens))
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"{tokens:>14} {med[None]:>15.1f} {med['least-outstanding']:>18.1f} {med['prefix-and-load']:>16.1f} "
              f"{med['prefix-and-load'] - med[None]:>12.1f}")  # fmt: skip
    for entries in (100_000, 1_000_000):
        print(f"prefix index: {_bytes_per_entry(entries):.0f} bytes per (backend, chunk) entry at {entries:,} entries")


if __name__ == "__main__":
    main()
