"""`disagg-localrun`: a DisaggregatedModel's prefill and decode engines and its router as local processes.

    disagg-localrun plan  -f dm.yaml [options]        # what would run: command lines, env, ports, GPUs
    disagg-localrun up    -f dm.yaml [options]        # start, wait until healthy, serve until Ctrl-C
    disagg-localrun bench -f dm.yaml [options] --modes router-push,direct-push --prompts 1024,4096 --rates 1,4
    disagg-localrun bench -f dm.yaml [options] --workload multi-turn --modes router-push:least-outstanding,router-push:prefix-and-load \
        --system-tokens 2048 --rates 2,4 --turns 4 --user-tokens 256 --think-time 1   # conversations, rates in sessions/s
    disagg-localrun bench -f dm.yaml [options] --workload multi-turn --router-replicas 2 --replica-spread request \
        --prompt-format token-ids ...   # two router replicas sharing the traffic (and only the engines' state)
    disagg-localrun migrate -f dm.yaml [options] --streams 16 --chat   # a decode killed mid-stream: every stream judged
    disagg-localrun report a/results.json b/results.json --baseline router-pull   # one table of several runs
    disagg-localrun report r1/results.json r2/results.json r3/results.json --repeats   # medians of repetitions

The engines get the operator's rendered `vllm serve` arguments and env (docs/localrun.md); what a local
run changes is an explicit option and is printed with the plan and the results.
"""

from __future__ import annotations

import argparse
import lzma
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from disagg_operator.api.validation import SpecError
from disagg_operator.manifests import load_all
from ..results import load_results
from . import loadgen, report
from .bench import Sweep, mode, run_bench
from .migrate import run_migration
from .kube_env import UnresolvableEnv
from .plan import PEER_POLICIES, PEER_ROUTER_MODES, PREFILL_POLICIES, ROUTER_MODES, LocalOptions, LocalRunError, describe, local_plan
from .procs import StartupFailed, started

EXIT_INVALID = 1
EXIT_USAGE = 2


def _csv(kind: type) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None

    return parse


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--env {text!r}: write NAME=VALUE")
    return name, value


def _default_gpus() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES") or "0"


def add_local_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--filename", required=True, help="the DisaggregatedModel (YAML, one document)")
    g = p.add_argument_group("where things run")
    g.add_argument("--gpus", type=_csv(str), default=None, help="GPU ids to hand out, in order (default: $CUDA_VISIBLE_DEVICES or 0)")
    g.add_argument("--colocate", action="store_true", help="let engines share GPUs when there are too few (needs --kv-cache-memory-bytes)")
    g.add_argument("--host", default="127.0.0.1", help="address every process binds and advertises")
    g.add_argument("--port-base", type=int, default=18000, help="first port: routers, then each engine's HTTP and side-channel ports")
    g.add_argument("--workdir", default=".localrun", help="logs and the router's static endpoints file")
    g.add_argument("--vllm", default="vllm", help="command that stands for `vllm` (e.g. 'python3 -m vllm.entrypoints.cli.main')")
    g.add_argument("--router-command", default=f"{sys.executable} -m disagg_connector.router", help="the router's command")
    g.add_argument("--peer-router-command", default="vllm-router",
                   help="vllm-project/router's command, for the vllmrouter-push/-pull modes (e.g. 'python3 -m vllm_router.launch_router')")
    g.add_argument("--router-replicas", type=int, default=1,
                   help="processes per router mode (the router Deployment's replicas): each counts only its own in-flight "
                   "requests; they share the engines' /metrics and KV events")
    g.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for every /health")
    s = p.add_argument_group("local overrides (listed in the output)")
    s.add_argument("--transfer-mode", choices=("Push", "Pull"), help="spec.kvTransfer.mode for this run")
    s.add_argument("--backend", choices=("UCX", "LIBFABRIC"), help="spec.kvTransfer.backend; UCX also drops EFA (a workstation has none)")
    s.add_argument("--model-path", help="local model folder instead of the spec's model reference")
    s.add_argument("--load-format", help="e.g. dummy: random weights, from the folder's config.json")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start)")
    s.add_argument("--kv-cache-memory-bytes", type=int, help="fixed KV cache per engine (lets engines share a GPU)")
    s.add_argument("--gpu-memory-utilization", type=float, help="vLLM's --gpu-memory-utilization for every engine")
    s.add_argument("--engine-arg", action="append", default=[], help="one more vLLM argument for every engine (repeatable; split like a shell)")
    s.add_argument("--env", action="append", type=_env_pair, default=[], help="NAME=VALUE for every engine (repeatable)")


def options_from(a: argparse.Namespace, workdir: str | None = None) -> LocalOptions:
    return LocalOptions(
        host=a.host,
        port_base=a.port_base,
        gpus=a.gpus if a.gpus is not None else _csv(str)(_default_gpus()),
        colocate=a.colocate,
        workdir=workdir or a.workdir,
        transfer_mode=getattr(a, "transfer_mode", None),
        backend=a.backend,
        model_path=a.model_path,
        load_format=a.load_format,
        enforce_eager=a.enforce_eager,
        kv_cache_memory_bytes=a.kv_cache_memory_bytes,
        gpu_memory_utilization=a.gpu_memory_utilization,
        extra_args=tuple(x for arg in a.engine_arg for x in shlex.split(arg)),
        env=tuple(a.env),
        launcher=tuple(shlex.split(a.vllm)),
        router_command=tuple(shlex.split(a.router_command)),
        router_modes=tuple(getattr(a, "router_mode", None) or ()),
        peer_router_command=tuple(shlex.split(a.peer_router_command)),
        router_replicas=a.router_replicas,
    )


def read_model(path: str) -> dict[str, Any]:
    try:
        docs = load_all(Path(path).read_text())
    except OSError as e:
        raise LocalRunError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise LocalRunError(f"{path} is not valid YAML: {e}") from None
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise LocalRunError(f"{path} must hold exactly one DisaggregatedModel document")
    return docs[0]


def cmd_plan(a: argparse.Namespace) -> int:
    plan = local_plan(read_model(a.filename), options_from(a), secrets=os.environ)
    print(describe(plan))
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    plan = local_plan(read_model(a.filename), options_from(a), secrets=os.environ)
    print(describe(plan), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with started(plan, Path(a.workdir) / "logs", a.startup_timeout) as running:
        print("healthy: " + ", ".join(f"{k} after {v:.0f} s" for k, v in running.startup_seconds.items()), flush=True)
        for r in plan.routers:
            print(f"router ({r.label}): {r.url}/v1/completions  (model {plan.served_model_name!r})", flush=True)
        stop.wait()
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    multi_turn = a.workload == "multi-turn"
    sweep = Sweep(
        prompts=a.system_tokens if multi_turn else a.prompts, rates=a.rates, modes=tuple(a.modes), max_tokens=a.max_tokens,
        cell_seconds=a.cell_seconds, min_requests=a.min_requests, drain_timeout=a.drain_timeout, seed=a.seed,
        workload=a.workload, turns=a.turns, user_tokens=a.user_tokens, think_time=a.think_time,
        prompt_format=a.prompt_format, replica_spread=a.replica_spread,
    )  # fmt: skip
    if multi_turn:  # a shape that cannot run is refused before any engine starts
        try:
            for rate in sweep.rates:
                if rate <= 0:
                    raise ValueError("--rates (sessions per second) must be positive")
                sweep.multi_turn(sweep.prompts[0], rate)
        except ValueError as e:
            raise LocalRunError(f"--workload multi-turn: {e}") from None
    out = Path(a.out)
    run_bench(read_model(a.filename), options_from(a, str(out)), sweep, out, a.startup_timeout, ["disagg-localrun", *sys.argv[1:]],
              secrets=os.environ)
    print(f"results: {out / 'results.md'} and {out / 'results.json'}")
    return 0


def cmd_migrate(a: argparse.Namespace) -> int:
    out = Path(a.out)
    result = run_migration(read_model(a.filename), options_from(a, str(out)), out, a.startup_timeout, streams=a.streams,
                           prompt_tokens=a.prompt_tokens, output_tokens=a.output_tokens, kill_after=a.kill_after, chat=a.chat)  # fmt: skip
    print((out / "migration.md").read_text())
    moved = result["summary"]["migrated"]
    return 0 if moved["streams"] and moved["whole"] == moved["streams"] else 1


def cmd_report(a: argparse.Namespace) -> int:
    runs = []
    for path in a.results:
        try:
            runs.append(load_results(path))
        except (OSError, ValueError, EOFError, lzma.LZMAError) as e:
            raise LocalRunError(f"cannot read results {path}: {e}") from None
    modes = report.merge(runs)["sweep"]["modes"]
    if a.baseline and a.baseline not in modes:
        raise LocalRunError(f"--baseline {a.baseline}: the results hold {', '.join(modes)}")
    sys.stdout.write(report.render(runs, a.baseline, a.repeats))
    return 0


def _modes(text: str) -> list[Any]:
    try:
        return [mode(m) for m in text.split(",") if m]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_ROUTER_MODES_HELP = (", ".join(ROUTER_MODES + PEER_ROUTER_MODES) + f", each optionally :POLICY (ours: {', '.join(PREFILL_POLICIES)}; "
                      f"vllm-router's: {', '.join(PEER_POLICIES)})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg-localrun", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the processes a local run would start")
    add_local_options(plan)
    plan.add_argument("--router-mode", action="append", help=f"routers to plan (repeatable): {_ROUTER_MODES_HELP}")
    plan.set_defaults(func=cmd_plan)
    up = sub.add_parser("up", help="start the engines and the router, serve until Ctrl-C")
    add_local_options(up)
    up.add_argument("--router-mode", action="append", help=f"routers to start (repeatable): {_ROUTER_MODES_HELP}")
    up.set_defaults(func=cmd_up)
    bench = sub.add_parser("bench", help="start, sweep prompt lengths x rates x modes, write results.json and results.md")
    add_local_options(bench)
    bench.add_argument("--modes", type=_modes, default=_modes("router-push,direct-push"),
                       help="comma-separated: router-push, router-push-sequential, router-pull, direct-push, "
                       "direct-push-sequential, direct-pull, vllmrouter-push, vllmrouter-pull (vllm-router, "
                       "--peer-router-command, on the same engines; the first is the ratios' baseline); a router mode "
                       f"may name its prefill policy: router-push:POLICY ({', '.join(PREFILL_POLICIES)}), "
                       "vllmrouter-push:cache_aware")
    bench.add_argument("--prompts", type=_csv(int), default=(1024, 4096, 16384), help="prompt lengths in tokens")
    bench.add_argument("--rates", type=_csv(float), default=(1.0, 4.0, 8.0), help="request rates per second")
    bench.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    bench.add_argument("--cell-seconds", type=float, default=12.0, help="seconds of arrivals per cell")
    bench.add_argument("--min-requests", type=int, default=16, help="at least this many requests per cell")
    bench.add_argument("--drain-timeout", type=float, default=60.0, help="after a cell's last arrival, cancel what is still running after this")
    bench.add_argument("--seed", type=int, default=0)
    w = bench.add_argument_group("workload")
    w.add_argument("--workload", choices=("no-reuse", "multi-turn"), default="no-reuse",
                   help="no-reuse: independent random prompts (--prompts); multi-turn: conversations sharing a system "
                   "prompt, each turn resending the history (--rates are then sessions per second, --min-requests sessions)")
    w.add_argument("--system-tokens", type=_csv(int), default=(2048,), help="multi-turn: the shared system prompt's tokens (one cell each)")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    w.add_argument("--user-tokens", type=int, default=256, help="multi-turn: tokens of each user message")
    w.add_argument("--think-time", type=float, default=1.0, help="multi-turn: mean seconds between an answer and the next turn (exponential)")
    w.add_argument("--prompt-format", choices=loadgen.PROMPT_FORMATS, default="text",
                   help="text (w<id> words) or token-ids (the same tokens as ids: the router matches them exactly against "
                   "the engines' KV events)")
    bench.add_argument("--replica-spread", choices=loadgen.SPREADS, default="session",
                       help="with --router-replicas: round robin over sessions (a Service balances connections: a client "
                       "keeping one per conversation) or over requests (a client pooling connections)")
    bench.add_argument("--out", default=".localrun/bench", help="results and logs folder")
    bench.set_defaults(func=cmd_bench)
    mig = sub.add_parser("migrate", help="stream migration on these engines: one of two decodes killed mid-stream, every "
                         "stream judged against an uninterrupted pass (migration.json, migration.md)")  # fmt: skip
    add_local_options(mig)
    mig.add_argument("--streams", type=int, default=16, help="streams of each pass")
    mig.add_argument("--prompt-tokens", type=int, default=1024)
    mig.add_argument("--output-tokens", type=int, default=160)
    mig.add_argument("--kill-after", type=int, default=40, help="tokens every stream has when a decode engine is killed")
    mig.add_argument("--chat", action="store_true", help="every other stream a chat (the model's tokenizer needs a chat template)")
    mig.add_argument("--out", default=".localrun/migrate", help="results and logs folder")
    mig.set_defaults(func=cmd_migrate)
    rep = sub.add_parser("report", help="one markdown report of several results.json (e.g. push and pull runs)")
    rep.add_argument("results", nargs="+", help="results.json files (or .json.xz, .json.gz: bench/results stores them so)")
    rep.add_argument("--baseline", help="the mode the ratios are to (default: the first)")
    rep.add_argument("--repeats", action="store_true",
                     help="the files are repetitions of one sweep: print one table of per-cell medians over them")
    rep.set_defaults(func=cmd_report, filename="-")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SpecError as error:
        print(f"{args.filename}: invalid", file=sys.stderr)
        for problem in error.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_INVALID
    except (LocalRunError, UnresolvableEnv, StartupFailed) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
