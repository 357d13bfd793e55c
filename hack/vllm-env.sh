#!/usr/bin/env bash
# Create (or reuse) a cached CPU-only Python environment in which one vLLM release's own
# argument parser and KVTransferConfig judge our rendered `vllm serve` command lines
# (tests/fixtures/vllm_cli_check.py). One per release the operator renders for and CI checks.
#
#   bash hack/vllm-env.sh [VERSION]  # VERSION 0.33.0 (default) or 0.26.0; prints the venv's python
#                                    # on its LAST line of stdout
#
# Venv:   ${DISAGG_CACHE:-$HOME/.cache/disagg-operator}/vllm-VERSION-cpu
# Pins:   hack/vllm-env-VERSION.requirements.txt (the complete frozen closure, installed --no-deps)
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
version="${1:-0.33.0}"
req="$here/vllm-env-$version.requirements.txt"
cache="${DISAGG_CACHE:-$HOME/.cache/disagg-operator}"
venv="$cache/vllm-$version-cpu"
py="$venv/bin/python"
stamp="$venv/.disagg-vllm-env.stamp"
base_python="${DISAGG_VLLM_BASE_PYTHON:-python3}"

log() { printf 'vllm-env: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ -f "$req" ]] || die "no pins for vLLM $version ($req): the releases with pins are $(cd "$here" && ls vllm-env-*.requirements.txt | sed -e 's/vllm-env-//' -e 's/.requirements.txt//' | tr '\n' ' ')"
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
exec 9>"$cache/.vllm-$version-cpu.lock"
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

# Verify: the checker itself (vLLM's own `vllm serve` parser and KVTransferConfig) works on this CPU
# machine and accepts a push producer's line.
log "verifying the parser"
sample='[{"id": "check", "argv": ["vllm", "serve", "Qwen/Qwen3-32B", "--tensor-parallel-size", "8",
  "--kv-transfer-config", "{\"kv_connector\": \"NixlPushConnector\", \"kv_role\": \"kv_producer\", \"engine_id\": \"p-0.uid\"}",
  "--block-size", "128"]}]'
printf '%s' "$sample" | VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=ERROR "$py" "$here/../tests/fixtures/vllm_cli_check.py" 2>/dev/null \
  | "$py" -c 'import json, sys; r = json.load(sys.stdin)[0]; sys.exit(0 if r["ok"] else "vLLM refused the sample line: %s" % r["error"])' \
  || die "the parser check failed in $venv"
log "parser OK"

echo "$key" > "$stamp"
log "ready in $((SECONDS - start)) s"
echo "$py"
