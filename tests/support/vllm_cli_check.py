"""Judge rendered `vllm serve` command lines with vLLM's own parser (0.33.0 or 0.26.0).

Run this with the python of a cached vLLM environment (`hack/vllm-env.sh VERSION` prints
its path), NOT with the project's venv:

    echo '[{"id": "p", "argv": ["vllm", "serve", "Qwen/Qwen3-32B", "--port", "8000"]}]' \
        | VLLM_TARGET_DEVICE=cpu "$(bash hack/vllm-env.sh | tail -n1)" tests/support/vllm_cli_check.py

stdin:  a JSON list of {"id": str, "argv": [str, ...]} (with --serve: one such list per line, answered by one
        line each, until stdin closes); argv is the container
        command line as rendered (after `$(VAR)` expansion), starting with
        "vllm", "serve", "<model>".
stdout: a JSON list, one entry per input and in the same order:
        {"id", "ok": bool, "error": str|null, "stage": str|null,
         "warnings": [str], "parsed": {...}|null}
        `stage` names the step that failed: argv, parse, validate, engine_args,
        kv_transfer_config, field_bounds (internal: a bug in this script). `warnings` holds the WARNING records vLLM logged while
        judging that line (best effort: vLLM's `warning_once` logs only once per
        process). `parsed` is null when the arguments did not parse.

What runs, in the order `vllm serve` (vllm/entrypoints/cli/main.py) runs it:
 1. a top-level `FlexibleArgumentParser(prog="vllm")` with a `serve` subparser built by
    vLLM's own `vllm.entrypoints.cli.serve.ServeSubcommand().subparser_init`, which is
    `vllm.entrypoints.common.cli_args.make_arg_parser(...)` (positional `model_tag`,
    FrontendArgs, AsyncEngineArgs). `parse_args(argv[1:])` applies vLLM's own
    rewriting (underscores/dashes, dotted `--x.y v` JSON keys, `--model` moving).
    Unknown flags are an argparse error. Config-typed flags such as
    `--kv-transfer-config` are built by `pydantic.TypeAdapter(KVTransferConfig)`
    inside argparse, so KVTransferConfig's validators (extra="forbid", the kv_role
    Literal, `__post_init__`) already run here.
 2. `ServeSubcommand().validate(args)` == `validate_parsed_serve_args(args)`, then
    `args.model = args.model_tag` as `ServeSubcommand.cmd` does.
 3. `AsyncEngineArgs.from_cli_args(args)` (the first thing the server does with the
    namespace; its `__post_init__` turns config dicts into config objects).
 4. the parsed kv_transfer_config is checked to be vLLM's `KVTransferConfig` and is
    rebuilt through that type's constructor once more (validators run again).
 5. field bounds: for every ParallelConfig/CacheConfig field that has a flag of the same
    name, the value is validated against that field's own pydantic constraints (e.g.
    tensor_parallel_size >= 1, block_size > 0, gpu_memory_utilization <= 1). vLLM enforces
    these only in `create_engine_config()`, which we cannot run; this takes vLLM's own
    constraint objects, not ours. Cross-field checks of those configs are not run.

What does NOT run: `EngineArgs.create_engine_config()` / `VllmConfig` (it needs the
model's config from the hub and a real platform), the load-balancing checks inline
in `ServeSubcommand.cmd`, and everything the connector checks at engine start
(kv_connector_extra_config keys, the connector name itself, sleep mode with push ...).
Nothing here touches the network or a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import sys
import traceback
from typing import Any

# --- environment, before anything imports vLLM or huggingface_hub -----------------
# CPU platform: vllm.platforms.cpu_platform_plugin() selects CpuPlatform from this,
# without probing NVML/CUDA. Forced so a stray value can't change the platform.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
# EngineArgs.__post_init__ resolves the model id to a local snapshot path when
# HF_HUB_OFFLINE is true (and fails for a model that isn't in the local cache).
# With it false that branch is skipped; nothing in this script downloads anything.
os.environ["HF_HUB_OFFLINE"] = "0"
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# vLLM logs to stdout by default (VLLM_LOGGING_STREAM=ext://sys.stdout) and libraries
# may print: keep the real stdout for our JSON only and send everything else to stderr.
_RESULT_OUT = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)
sys.stdout = sys.stderr

from typing import Annotated  # noqa: E402

from pydantic import TypeAdapter  # noqa: E402

import vllm.platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

# 0.33.0 picks the CPU platform from VLLM_TARGET_DEVICE, 0.26.0 only for a CPU build of vLLM (a version
# string with "cpu"): set it before anything asks, the same way for both.
vllm.platforms._current_platform = CpuPlatform()

from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

_KV_ADAPTER = TypeAdapter(KVTransferConfig)


def _field_bounds() -> list[tuple[str, str, TypeAdapter]]:
    """(config, field, adapter) for each constrained field of the configs the sizes land in."""
    out = []
    for cls in (ParallelConfig, CacheConfig):
        for name, info in cls.__pydantic_fields__.items():
            if info.metadata:  # e.g. [Ge(ge=1)], [Gt(gt=0)], [Gt(gt=0), Le(le=1)]
                out.append((cls.__name__, name, TypeAdapter(Annotated[(info.annotation, *info.metadata)])))
    return out


_FIELD_BOUNDS = _field_bounds()


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(f"{record.name}: {record.getMessage()}")
        except Exception:  # pragma: no cover - a broken log call must not break us
            self.records.append(f"{record.name}: {record.msg!r}")


def build_parser() -> FlexibleArgumentParser:
    """The parser `vllm serve` uses (vllm/entrypoints/cli/main.py, serve subcommand only)."""
    parser = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return parser


def _argparse_message(captured: str, code: Any) -> str:
    """The `error:` part of what argparse printed before exiting (drop the usage block)."""
    lines = [ln for ln in captured.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ": error: " in ln:
            return "\n".join([ln.split(": error: ", 1)[1], *lines[i + 1 :]]).strip()
    tail = "\n".join(lines[-5:]).strip()
    return tail or f"argument parser exited with status {code}"


def _exc(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _parsed_fields(args: Any) -> dict[str, Any]:
    kv = getattr(args, "kv_transfer_config", None)
    model = args.model_tag if getattr(args, "model_tag", None) is not None else getattr(args, "model", None)
    out = {
        "model": model,
        "tensor_parallel_size": getattr(args, "tensor_parallel_size", None),
        "pipeline_parallel_size": getattr(args, "pipeline_parallel_size", None),
        "data_parallel_size": getattr(args, "data_parallel_size", None),
        "data_parallel_size_local": getattr(args, "data_parallel_size_local", None),
        "data_parallel_start_rank": getattr(args, "data_parallel_start_rank", None),
        "data_parallel_address": getattr(args, "data_parallel_address", None),
        "data_parallel_rpc_port": getattr(args, "data_parallel_rpc_port", None),
        "data_parallel_hybrid_lb": getattr(args, "data_parallel_hybrid_lb", None),
        "enable_expert_parallel": getattr(args, "enable_expert_parallel", None),
        "block_size": getattr(args, "block_size", None),
        "served_model_name": getattr(args, "served_model_name", None),
        "port": getattr(args, "port", None),
        "kv_connector": getattr(kv, "kv_connector", None),
        "kv_role": getattr(kv, "kv_role", None),
        "engine_id": getattr(kv, "engine_id", None),
        "kv_buffer_device": getattr(kv, "kv_buffer_device", None),
        "kv_connector_extra_config": getattr(kv, "kv_connector_extra_config", None),
    }
    return {k: _jsonable(v) for k, v in out.items()}


def check_one(argv: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"ok": False, "error": None, "stage": None, "warnings": [], "parsed": None}

    def fail(stage: str, message: str) -> dict[str, Any]:
        result["stage"] = stage
        result["error"] = message
        return result

    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return fail("argv", "argv must be a list of strings")
    if len(argv) < 2 or os.path.basename(argv[0]) != "vllm" or argv[1] != "serve":
        return fail("argv", f"expected a command line starting with 'vllm serve', got {argv[:2]!r}")

    # 1. parse, exactly as `vllm serve ...` does (sys.argv[1:] == argv[1:])
    parser = build_parser()
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            args = parser.parse_args(list(argv[1:]))
    except SystemExit as e:  # argparse.error() / --help / --version
        return fail("parse", _argparse_message(captured.getvalue(), e.code))
    except Exception as e:  # vLLM raises ValueError itself for some misuse
        return fail("parse", _exc(e))
    if getattr(args, "subparser", None) != "serve":
        return fail("parse", f"parsed subcommand is {getattr(args, 'subparser', None)!r}, not 'serve'")
    result["parsed"] = _parsed_fields(args)

    # 2. vLLM's post-parse checks for `serve` (main.py: cmd.validate(args))
    try:
        ServeSubcommand().validate(args)
    except Exception as e:
        return fail("validate", _exc(e))
    if getattr(args, "model_tag", None) is not None:  # ServeSubcommand.cmd does this first
        args.model = args.model_tag

    # 3. the engine-args object the server builds from the namespace
    try:
        AsyncEngineArgs.from_cli_args(args)
    except Exception as e:
        return fail("engine_args", _exc(e))

    # 4. the kv-transfer config, as vLLM's own KVTransferConfig
    kv = getattr(args, "kv_transfer_config", None)
    if kv is not None:
        if not isinstance(kv, KVTransferConfig):
            return fail("kv_transfer_config", f"parsed kv_transfer_config is {type(kv).__name__}, not KVTransferConfig")
        try:
            init = {f.name: getattr(kv, f.name) for f in dataclasses.fields(kv) if f.init}
            _KV_ADAPTER.validate_python(init)
            KVTransferConfig(**init)
        except Exception as e:
            return fail("kv_transfer_config", _exc(e))

    # 5. the per-field bounds vLLM's ParallelConfig/CacheConfig declare
    problems = []
    for cls_name, name, adapter in _FIELD_BOUNDS:
        value = getattr(args, name, None)
        if value is None:
            continue
        try:
            adapter.validate_python(value)
        except Exception as e:
            first = [ln.strip() for ln in str(e).splitlines()[1:2]]
            problems.append(f"--{name.replace('_', '-')}={value!r}: {cls_name}.{name}: {' '.join(first) or e}")
    if problems:
        return fail("field_bounds", "; ".join(problems))

    result["ok"] = True
    return result


def judge(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per item, in order."""
    collector = _Collect()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(collector)
    results = []
    try:
        for item in items:
            collector.records = []
            try:
                res = check_one(item.get("argv"))
            except BaseException as e:  # never lose the other results to one bad line
                if isinstance(e, KeyboardInterrupt):
                    raise
                res = {"ok": False, "error": _exc(e) + "\n" + traceback.format_exc(), "stage": "internal",
                       "warnings": [], "parsed": None}
            res["warnings"] = list(collector.records)
            results.append({"id": item.get("id"), **res})
    finally:
        vllm_logger.removeHandler(collector)
    return results


def _items(text: str) -> list[dict[str, Any]] | None:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        print(f"vllm_cli_check: input is not JSON: {e}", file=sys.stderr)
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        print("vllm_cli_check: input must be a JSON list of objects", file=sys.stderr)
        return None
    return items


def _answer(results: list[dict[str, Any]], indent: int | None) -> None:
    json.dump(results, _RESULT_OUT, indent=indent)
    _RESULT_OUT.write("\n")
    _RESULT_OUT.flush()


def main(argv: list[str]) -> int:
    """One batch from stdin; with --serve, one batch per line until stdin closes, one answer line each (the
    test session keeps one process per release: vLLM is imported once)."""
    if argv == ["--serve"]:
        for line in sys.stdin:
            items = _items(line)
            if items is None:
                return 2
            _answer(judge(items), None)
        return 0
    items = _items(sys.stdin.read())
    if items is None:
        return 2
    _answer(judge(items), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
