"""REHEARSAL only: the simulator (tests/vllm_sim/as_vllm.py) for one pod of an engine that spans pods.

vLLM's hybrid load balancing gives a pod `--data-parallel-size-local` L and `--data-parallel-start-rank` S: it
serves global ranks [S, S + L). Where as_vllm already passes them on, this wrapper changes nothing; where only the
simulator knows them (`--dp-start-rank`, `--dp-size-local`), it appends them to as_vllm's translation; with neither,
a pod of one rank (L = 1) is a simulated engine of DP 1 with that rank's identity (engine_id `<id>_dp<S>`, side
channel base + S, `X-data-parallel-rank` 0), and L > 1 is refused.

    python hack/gpu/sim_dp_pod.py serve MODEL ... --data-parallel-size 2 --data-parallel-size-local 1 \\
        --data-parallel-start-rank 1 ...
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tests.vllm_sim import as_vllm, sim  # noqa: E402


def flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def replace(argv: list[str], name: str, value: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out + [name, value]


def _knows(parser_owner: object, option: str) -> bool:
    parser = parser_owner() if callable(parser_owner) else parser_owner
    return any(option in action.option_strings for action in parser._actions)  # noqa: SLF001


def main() -> None:
    argv, env = sys.argv[1:], os.environ  # the simulator reads os.environ
    size, local = int(flag(argv, "--data-parallel-size") or 1), flag(argv, "--data-parallel-size-local")
    start = int(flag(argv, "--data-parallel-start-rank") or 0)
    if local is None or int(local) == size or _knows(as_vllm._vllm_flags, "--data-parallel-size-local"):  # noqa: SLF001
        as_vllm.main(argv)
        return
    if _knows(sim.build_parser, "--dp-start-rank"):
        args = as_vllm.sim_argv(argv, dict(env), as_vllm.profile(env.get("DISAGG_SIM_PROFILE", "default")))
        sys.argv = ["vllm_sim", *args, "--dp-start-rank", str(start), "--dp-size-local", local]
        sim.main()
        return
    if int(local) != 1:
        raise SystemExit(f"sim_dp_pod: this simulator runs one rank per pod only (--data-parallel-size-local {local})")
    kv = json.loads(flag(argv, "--kv-transfer-config") or "{}")
    kv["engine_id"] = f"{kv['engine_id']}_dp{start}"
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")) + start)
    print(f"sim_dp_pod: DP rank {start} of {size} as a DP-1 engine {kv['engine_id']}", flush=True)
    as_vllm.main(replace(replace(argv, "--kv-transfer-config", json.dumps(kv)), "--data-parallel-size", "1"))


if __name__ == "__main__":
    main()
