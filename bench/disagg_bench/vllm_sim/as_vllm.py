"""The simulator started from a `vllm serve` command line and env, as vLLM would read them.

    python -m disagg_bench.vllm_sim.as_vllm serve MODEL --port 8100 --kv-transfer-config '{...}' ...
    (env VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT, VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)

So anything that launches vLLM from rendered arguments (disagg-localrun's `--vllm`) can launch the
simulator instead: role, transfer mode, engine_id, lease and load-failure policy come from
`--kv-transfer-config`; sizes, ports and the served name from the flags; the side channel from the env,
with vLLM's defaults. Flags the simulator has no use for are ignored (vLLM's own parser judges the flags
in CI: tests/unit/operator/render/test_vllm_cmdlines.py). The timing model is a calibration profile
(bench/disagg_bench/vllm_sim/calibration.json) named by DISAGG_SIM_PROFILE (default "default": the simulator's own
defaults); the release it answers as, DISAGG_SIM_VLLM_VERSION (default: the simulator's, 0.33.0), as an
image would fix it (vLLM's command line does not name its release).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from disagg_connector import contract

CALIBRATION = Path(__file__).with_name("calibration.json")
CONNECTOR_MODES = {"NixlPushConnector": "push", "NixlConnector": "pull", "NixlPullConnector": "pull"}
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


def profile(name: str) -> dict[str, float]:
    """The timing flags of a calibration profile ({} for "default")."""
    if name == "default":
        return {}
    profiles = json.loads(CALIBRATION.read_text())["profiles"]
    if name not in profiles:
        raise SystemExit(f"as_vllm: no calibration profile {name!r} in {CALIBRATION} (have: {', '.join(profiles)})")
    return dict(profiles[name]["timing"])


def _vllm_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm", add_help=False)
    p.add_argument("subcommand", choices=("serve",))
    p.add_argument("model")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    # a pod of an engine that spans pods serves ranks [start, start + local) (hybrid load balancing)
    p.add_argument("--data-parallel-size-local", "-dpl", type=int)
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0)
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    p.add_argument("--prefix-caching-hash-algo")
    p.add_argument("--kv-events-config")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-transfer-config", type=json.loads, required=True)
    return p


def sim_argv(argv: Sequence[str], env: dict[str, str], timing: dict[str, float]) -> list[str]:
    """The simulator's own arguments for a `vllm serve` line (pure)."""
    a, _ignored = _vllm_flags().parse_known_args(list(argv))
    kv = contract.transfer_connector_config(a.kv_transfer_config)  # NIXL's part; a CPU tier's size below
    extra = kv.get("kv_connector_extra_config") or {}
    try:
        mode, role = CONNECTOR_MODES[kv["kv_connector"]], ROLES[kv["kv_role"]]
    except KeyError as e:
        raise SystemExit(f"as_vllm: the simulator has no {e.args[0]!r} (kv_connector {sorted(CONNECTOR_MODES)}, "
                         f"kv_role {sorted(ROLES)})") from None
    # vLLM's handshake refuses peers whose model, dtype, cache dtype, block size or connector differ.
    compat = hashlib.sha256(json.dumps([a.model, a.dtype, a.kv_cache_dtype, a.block_size, kv["kv_connector"]]).encode()).hexdigest()[:16]
    out = [
        "--role", role, "--mode", mode,
        "--host", env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        # vLLM's API server listens where --host says, on every interface without it (uvicorn's host "")
        "--http-host", a.host if a.host is not None else "",
        "--port", str(a.port),
        "--side-channel-port", env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"),
        "--engine-id", str(kv.get("engine_id") or "sim-" + compat),
        "--served-model-name", (a.served_model_name or [a.model])[0],
        "--tp-size", str(a.tensor_parallel_size), "--pp-size", str(a.pipeline_parallel_size),
        "--dp-size", str(a.data_parallel_size),
        "--lease-seconds", str(extra.get("kv_lease_duration", 30)),
        "--kv-load-failure-policy", str(kv.get("kv_load_failure_policy", "fail")),
        "--compat-hash", compat,
    ]  # fmt: skip
    if a.data_parallel_size_local is not None and a.data_parallel_size_local != a.data_parallel_size:
        out += ["--dp-start-rank", str(a.data_parallel_start_rank), "--dp-size-local", str(a.data_parallel_size_local)]
    if "push_registration_timeout" in extra:
        out += ["--push-registration-timeout", str(extra["push_registration_timeout"])]
    if a.block_size:
        out += ["--block-size", str(a.block_size)]
    if a.num_gpu_blocks_override:
        out += ["--num-gpu-blocks", str(a.num_gpu_blocks_override)]
    if cpu := contract.cpu_tier_bytes(a.kv_transfer_config):
        out += ["--cpu-offload-bytes", str(cpu)]
    if a.enable_prefix_caching is False:
        out.append("--no-enable-prefix-caching")
    if a.prefix_caching_hash_algo:
        out += ["--prefix-caching-hash-algo", a.prefix_caching_hash_algo]
    if a.kv_events_config:
        out += ["--kv-events-config", a.kv_events_config]
    if env.get("DISAGG_SIM_VLLM_VERSION"):  # the release the image would run (the sim answers as 0.33.0 by default)
        out += ["--vllm-version", env["DISAGG_SIM_VLLM_VERSION"]]
    if env.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("", "0"):
        out.append("--disable-request-id-randomization")
    for name, value in timing.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from disagg_bench.vllm_sim import sim

    env = dict(os.environ)
    args = sim_argv(sys.argv[1:] if argv is None else argv, env, profile(env.get("DISAGG_SIM_PROFILE", "default")))
    sys.argv = ["vllm_sim", *args]
    sim.main()


if __name__ == "__main__":
    main()
