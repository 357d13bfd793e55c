#!/usr/bin/env bash
# Local Kubernetes control plane for development and e2e tests.
#
#   hack/cluster.sh build    build every component from Go modules (cached by version): what
#                            `up` runs (below), and the tools of the tests: helm (chart tests),
#                            the kstatus helper, prometheus, promtool and the promql helper
#                            (alert rule and dashboard query tests, the e2e's Prometheus), GAIE's
#                            lwepp and lwepp-ask (asks it as a gateway does:
#                            tests/e2e/test_gateway.py), cyclonus (evaluates the rendered
#                            NetworkPolicies: this cluster runs no CNI that enforces them;
#                            tests/e2e/test_router_kv_events_e2e.py), BuildKit's buildkitd
#                            and buildctl (hack/images.sh: the images/ Dockerfiles built
#                            without Docker; tests/integration/containers). hack/setup.sh (and so
#                            hack/test.sh) runs it.
#   hack/cluster.sh build-cluster
#                            build only what `up` runs and installs (CLUSTER_COMPONENTS: etcd,
#                            kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
#                            kwok, lws with its CRDs, and the CRD_BUNDLES); `up` and so
#                            hack/demo.sh build no more than this
#   DISAGG_REAL_NODE=1 hack/cluster.sh build-node
#                            build only the real node's kubelet, kube-proxy and fake GPU device plugin (hack/node/README.md;
#                            hack/setup.sh runs it)
#   hack/cluster.sh up       build-cluster if needed, start etcd, kube-apiserver,
#                            kube-controller-manager, kube-scheduler (with the Workload
#                            API and gang scheduling: GenericWorkload), kwok and the
#                            LeaderWorkerSet controller (lws: its CRDs, and its admission
#                            webhooks served on 127.0.0.1) on 127.0.0.1, create the fake
#                            GPU/EFA nodes, install the CRDs of Gateway API (v1.6.3:
#                            GatewayClass, Gateway, HTTPRoute) and of the inference
#                            extension (GAIE v1.6.0: InferencePool), wait until healthy
#   hack/cluster.sh p5en N   make the pool N fake p5en nodes, N >= 4 (hack/nodes/p5en.yaml has 4; more
#                            are copies of its last, kwok-p5en-4 ..., in a zone of their own,
#                            us-west-2c; `p5en 4` removes them again):
#                            room for bigger examples (hack/demo.sh --p5en N)
#   hack/cluster.sh down     stop everything and remove the state directory
#   hack/cluster.sh env      print `export DISAGG_STATE=...` / KUBECONFIG / PATH / DISAGG_AUDIT_LOG
#   hack/cluster.sh status   show what is running (exit 0 only if all are up, /readyz is ok
#                            and LWS's webhooks answer)
#   hack/cluster.sh path NAME   print where component NAME's binary is (built or not)
#
# Everything is built from Go modules through the Go module proxy with the
# machine's Go (see hack/k8s-tools/): nothing else has to be installed by hand
# apart from Go and openssl.
#
# Environment:
#   DISAGG_CACHE   binary cache root (default ~/.cache/disagg-operator);
#                  binaries live in $DISAGG_CACHE/bin/<component>-<version>/
#   DISAGG_STATE   cluster state dir (default $DISAGG_CACHE/cluster): kubeconfig,
#                  certs, etcd data, logs/<component>.log, pids/, audit.log
#   DISAGG_BUILD_JOBS   go build -p (default 2)
#   DISAGG_PORT_BASE    first of the fixed loopback ports (default 16443):
#                  apiserver=BASE, etcd client=BASE+1, etcd peer=BASE+2,
#                  controller-manager=BASE+3, scheduler=BASE+4, kwok=BASE+5,
#                  lws webhook=BASE+6, lws metrics=BASE+7, lws health=BASE+8
#                  (DISAGG_REAL_NODE=1: kubelet=BASE+9 on the node IP, its healthz=BASE+10,
#                  kube-proxy's healthz=BASE+11 and metrics=BASE+12 on loopback)
#   DISAGG_REAL_NODE=1  opt-in (hack/node/README.md; tests/integration/containers): `build-node` builds
#                  the kubelet and kube-proxy; `up` also starts one real node (containerd + kubelet + kube-proxy, labelled and tainted
#                  disagg.dev/real-node) beside the kwok nodes; `down` removes it. Unset, nothing of it is
#                  built, started or touched.
#   DISAGG_POD_NET      second octet of the pod IPs, 127.<N>.x.y (default 0 for the default
#                  port base, else derived from it): two clusters on one machine, each
#                  with simulated engines bound to its pods' IPs, do not collide
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# CACHE, BIN_ROOT, STATE, PORT_BASE, PKI and sign_cert
source "$ROOT/hack/lib/common.sh"
TOOLS="$ROOT/hack/k8s-tools"
JOBS="${DISAGG_BUILD_JOBS:-2}"
HOST=127.0.0.1

APISERVER_PORT=$PORT_BASE
ETCD_PORT=$((PORT_BASE + 1))
ETCD_PEER_PORT=$((PORT_BASE + 2))
KCM_PORT=$((PORT_BASE + 3))
SCHED_PORT=$((PORT_BASE + 4))
KWOK_PORT=$((PORT_BASE + 5))
LWS_WEBHOOK_PORT=$((PORT_BASE + 6))
LWS_METRICS_PORT=$((PORT_BASE + 7))
LWS_HEALTH_PORT=$((PORT_BASE + 8))

if [ "$PORT_BASE" = 16443 ]; then POD_NET="${DISAGG_POD_NET:-0}"; else POD_NET="${DISAGG_POD_NET:-$((1 + PORT_BASE % 199))}"; fi  # 210+: the e2e's own node pools
SERVICE_CIDR=10.96.0.0/16   # virtual: only the real node's kube-proxy (DISAGG_REAL_NODE=1) routes to it

# Gang scheduling (docs/gang-scheduling.md): Kubernetes 1.37's Workload API. GenericWorkload (beta,
# off by default) on all three: the apiserver serves Workload/PodGroup and keeps pod.spec.schedulingGroup
# (it drops the field with the gate off), kube-controller-manager runs the PodGroup protection
# controller, kube-scheduler adds its GangScheduling plugin to the default profile. The beta group
# version scheduling.k8s.io/v1beta1 is also off by default and has to be asked for by runtime-config.
FEATURE_GATES=GenericWorkload=true
RUNTIME_CONFIG=scheduling.k8s.io/v1beta1=true

# ---------------------------------------------------------------------------
# Components: name, version, tools module dir (relative to hack/k8s-tools, or
# "-" for `go install pkg@version` of a module without replace directives),
# main package. Add a component with one line, e.g.
#   "helm v3.22.0 - helm.sh/helm/v3/cmd/helm"
# A helper whose main package lives in its tools module names a fifth field: the
# library package the version pins. Its cache directory also carries a hash of the
# module's files, so an edited helper is rebuilt (`hack/cluster.sh path NAME`).
# ---------------------------------------------------------------------------
K8S_VERSION=v1.37.2
COMPONENTS=(
  "etcd v3.6.16 etcd go.etcd.io/etcd/server/v3"
  "kwok v0.8.0 kwok sigs.k8s.io/kwok/cmd/kwok"
  "kube-apiserver $K8S_VERSION . k8s.io/kubernetes/cmd/kube-apiserver"
  "kube-controller-manager $K8S_VERSION . k8s.io/kubernetes/cmd/kube-controller-manager"
  "kube-scheduler $K8S_VERSION . k8s.io/kubernetes/cmd/kube-scheduler"
  "kubectl $K8S_VERSION . k8s.io/kubernetes/cmd/kubectl"
  "helm v3.22.0 - helm.sh/helm/v3/cmd/helm"
  "kstatus v0.37.2 kstatus github.com/disagg-operator/hack/k8s-tools/kstatus sigs.k8s.io/cli-utils/pkg/kstatus/status"
  "lws v0.9.0 lws sigs.k8s.io/lws/cmd"
  "lwepp v1.6.0 lwepp sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp"
  "lwepp-ask v1.6.0 lwepp github.com/disagg-operator/hack/k8s-tools/lwepp sigs.k8s.io/gateway-api-inference-extension/pkg/lwepp/metadata"
  "promtool v0.316.0 prometheus github.com/prometheus/prometheus/cmd/promtool"
  "prometheus v0.316.0 prometheus github.com/prometheus/prometheus/cmd/prometheus"
  "promql v0.316.0 promql github.com/disagg-operator/hack/k8s-tools/promql github.com/prometheus/prometheus/promql/parser"
  # SIG Network's policy-assistant grew out of cyclonus; its own module (cmd/policy-assistant) is not one the
  # Go module proxy can serve (its go.mod names a path its directory does not match), cyclonus's is.
  "cyclonus v0.5.6 - github.com/mattfenwick/cyclonus/cmd/cyclonus"
  # BuildKit's daemon and client: hack/images.sh builds the images/ Dockerfiles with them (tests/integration/containers).
  "buildkitd v0.34.2 buildkit github.com/moby/buildkit/cmd/buildkitd"
  "buildctl v0.34.2 buildkit github.com/moby/buildkit/cmd/buildctl"
)
# What `up` runs (RUN_ORDER) and drives (kubectl): all that `build-cluster` builds. The other components are
# the tests' tools, built by `build` only.
# helm: hack/demo.sh installs the chart's cluster-wide gang admission policy with it, as users do.
CLUSTER_COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok lws kubectl helm)
# Opt-in real node (DISAGG_REAL_NODE=1; hack/node/README.md): a kubelet and kube-proxy, from k8s.io/kubernetes at the
# API server's version, built from a tools module of its own (hack/node/kubelet-tools: the shared one pins neither).
# Off, nothing here changes: `build`, `build-cluster`, `up` and `down` neither build nor start it.
REAL_NODE="${DISAGG_REAL_NODE:-0}"
if [ "$REAL_NODE" = 1 ]; then
  COMPONENTS+=("kubelet $K8S_VERSION ../node/kubelet-tools k8s.io/kubernetes/cmd/kubelet")
  # the node's Services: a pod reaches the API server at the `kubernetes` Service's ClusterIP, as in a cluster
  COMPONENTS+=("kube-proxy $K8S_VERSION ../node/kubelet-tools k8s.io/kubernetes/cmd/kube-proxy")
  # the node's stand-in for NVIDIA's device plugin (hack/node/kubelet-tools/fakegpu: the kubelet's own
  # deviceplugin API, from the same module and go.sum)
  COMPONENTS+=("fakegpu $K8S_VERSION ../node/kubelet-tools ./fakegpu k8s.io/kubernetes/cmd/kubelet")
  CLUSTER_COMPONENTS+=(kubelet kube-proxy fakegpu)
fi

# CRDs of kinds the operator renders whose controllers are not run here (spec.gateway's InferencePool and
# HTTPRoute, and the Gateway an HTTPRoute names): name, version, Go module, files in it. Copied from the module at
# that exact version by `build` (cached by version, like LWS's), installed by `up`, so the API server judges the
# operator's objects with the upstream schemas and CEL. (The proxy serves GAIE v1.6.0 and Gateway API v1.6.3;
# Gateway API v1.7.0 needs a newer Go.)
CRD_BUNDLES=(
  "gaie v1.6.0 sigs.k8s.io/gateway-api-inference-extension config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
  "gateway-api v1.6.3 sigs.k8s.io/gateway-api config/crd/standard/gateway.networking.k8s.io_gatewayclasses.yaml config/crd/standard/gateway.networking.k8s.io_gateways.yaml config/crd/standard/gateway.networking.k8s.io_httproutes.yaml"
)
UPSTREAM_CRDS=(inferencepools.inference.networking.k8s.io gatewayclasses.gateway.networking.k8s.io
               gateways.gateway.networking.k8s.io httproutes.gateway.networking.k8s.io)

log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

component_field() { # name field-index (1=version 2=moddir 3=package 4=pinned library package)
  local want=$1 idx=$2 line
  for line in "${COMPONENTS[@]}"; do
    local -a arr
    read -r -a arr <<<"$line"
    if [ "${arr[0]}" = "$want" ]; then echo "${arr[$idx]:-}"; return 0; fi
  done
  die "unknown component $want"
}

# cache directory of a component: name-version, plus a hash of the helper's own
# sources for a helper built from this repository (fifth field)
bin_dir() {
  local name=$1 ver moddir pinned
  ver="$(component_field "$name" 1)"; moddir="$(component_field "$name" 2)"; pinned="$(component_field "$name" 4)"
  if [ -n "$pinned" ]; then
    local pkg; pkg="$(component_field "$name" 3)"
    local -a own=()  # a package of the tools module itself (./dir): its sources are part of the key
    case "$pkg" in ./*) own=("$TOOLS/$moddir/$pkg"/*.go) ;; esac
    echo "$BIN_ROOT/$name-$ver-$(cat "$TOOLS/$moddir"/go.mod "$TOOLS/$moddir"/go.sum "$TOOLS/$moddir"/*.go "${own[@]}" | sha256sum | cut -c1-12)"
  else
    echo "$BIN_ROOT/$name-$ver"
  fi
}

# path of a component's binary (may not exist yet)
bin_path() { echo "$(bin_dir "$1")/$1"; }

# ldflags: strip symbols; stamp the Kubernetes version like upstream's
# hack/lib/version.sh does (otherwise the binaries report v0.0.0-master).
ldflags_for() {
  local name=$1 ver=$2 flags="-s -w"
  case "$name" in
    kube-*|kubectl|kubelet)
      local major minor pkg
      major="${ver#v}"; major="${major%%.*}"
      minor="${ver#v*.}"; minor="${minor%%.*}"
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        flags+=" -X $pkg.gitVersion=$ver -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
      done
      ;;
    prometheus|promtool)
      # like Prometheus's .promu.yml (3.X.Y for module version v0.3XX.Y)
      local v="${ver#v0.}" pv
      pv="$(( ${v%%.*} / 100 )).$(( ${v%%.*} % 100 )).${v#*.}"
      flags+=" -X github.com/prometheus/common/version.Version=$pv -X github.com/prometheus/common/version.Revision=$ver"
      flags+=" -X github.com/prometheus/common/version.Branch=HEAD -X github.com/prometheus/common/version.BuildDate=19700101-00:00:00"
      ;;
    lws)
      # like LWS's Makefile (GitCommit stays its placeholder: a module has no git checkout)
      flags+=" -X sigs.k8s.io/lws/pkg/version.GitVersion=$ver -X sigs.k8s.io/lws/pkg/version.BuildDate=1970-01-01T00:00:00Z"
      ;;
    buildkitd|buildctl)
      flags+=" -X github.com/moby/buildkit/version.Version=$ver -X github.com/moby/buildkit/version.Revision=$ver"
      ;;
    helm)
      # Like helm's Makefile: its version, and the Kubernetes version `helm template`/`lint` assume
      # (unstamped it is v1.20, which charts with kubeVersion >=1.29 refuse).
      local kmajor kminor
      kmajor="${K8S_VERSION#v}"; kmajor="${kmajor%%.*}"
      kminor="${K8S_VERSION#v*.}"; kminor="${kminor%%.*}"
      flags+=" -X helm.sh/helm/v3/internal/version.version=$ver"
      for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
        flags+=" -X $pkg.k8sVersionMajor=$kmajor -X $pkg.k8sVersionMinor=$kminor"
      done
      ;;
  esac
  echo "$flags"
}

# files a component needs at run time besides its binary, copied from its module at
# that exact version into the same cache directory (so they are cached by version too)
postbuild() { # name version dir
  local name=$1 ver=$2 dir=$3 moddir
  case "$name" in
    lws)
      # LWS's CRDs (leaderworkersets, disaggregatedsets: its manager watches both),
      # installed by `up`: from the module the build above used (already in the module cache).
      moddir="$(cd "$dir" && go mod download -json "sigs.k8s.io/lws@$ver" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')"
      [ -d "$moddir/config/crd/bases" ] || { log "build: no config/crd/bases in sigs.k8s.io/lws@$ver ($moddir)"; return 1; }
      mkdir -p "$dir/crd"
      cp "$moddir"/config/crd/bases/*.yaml "$dir/crd/" && chmod 644 "$dir"/crd/*.yaml || return 1
      ;;
  esac
}

# go build -tags. Prometheus and promtool: only the file, http and kubernetes service discovery
# (the e2e's Prometheus finds pods through the local API server; the cloud SDKs would double the
# build), and no builtinassets: the web UI is not needed, the API and rule evaluation are.
tags_for() {
  case "$1" in
    prometheus|promtool) echo "netgo,remove_all_sd,enable_kubernetes_sd" ;;
    buildkitd) echo "netgo,osusergo" ;;  # like BuildKit's own static build
  esac
}

build_one() { # name version moddir pkg [pinned library package]
  local name=$1 ver=$2 moddir=$3 pkg=$4 pinned=${5:-$4}
  local dest; dest="$(bin_dir "$name")"
  if [ -x "$dest/$name" ]; then
    return 0
  fi
  command -v go >/dev/null || die "go is not installed (needed to build $name)"
  local tmp start ticker rc=0
  tmp="$(mktemp -d "$BIN_ROOT/.build-$name.XXXXXX")"
  start=$SECONDS
  log "build: $name $ver from $pkg (go build -p $JOBS) ..."
  ( while sleep 30 && kill -0 $$ 2>/dev/null; do
      log "build: $name still building, $((SECONDS - start))s elapsed"; done ) &
  ticker=$!
  local ldflags tags; ldflags="$(ldflags_for "$name" "$ver")"; tags="$(tags_for "$name")"
  if [ "$moddir" = "-" ]; then
    GOBIN="$tmp" CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -p=$JOBS" \
      go install -trimpath -tags="$tags" -ldflags="$ldflags" "$pkg@$ver" || rc=$?
  else
    local mdir="$TOOLS/$moddir"
    local modver
    modver="$(cd "$mdir" && go list -f '{{.Module.Version}}' "$pinned" 2>/dev/null || true)"
    if [ "$modver" != "$ver" ]; then
      kill "$ticker" 2>/dev/null || true
      die "build: $mdir/go.mod gives $pinned at '${modver}', expected $ver (regenerate the tools module)"
    fi
    (cd "$mdir" && CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -p=$JOBS" \
      go build -trimpath -tags="$tags" -ldflags="$ldflags" -o "$tmp/$name" "$pkg") || rc=$?
  fi
  kill "$ticker" 2>/dev/null || true; wait "$ticker" 2>/dev/null || true
  if [ "$rc" -eq 0 ] && [ -x "$tmp/$name" ]; then
    postbuild "$name" "$ver" "$tmp" || rc=$?
  fi
  if [ "$rc" -ne 0 ] || [ ! -x "$tmp/$name" ]; then
    rm -rf "$tmp"
    die "build: $name $ver failed (rc=$rc) after $((SECONDS - start))s"
  fi
  rm -rf "$dest"; mkdir -p "$(dirname "$dest")"
  mv "$tmp" "$dest"
  log "build: $name $ver done in $((SECONDS - start))s ($(du -h "$dest/$name" | cut -f1))"
}

crd_bundle_dir() { echo "$BIN_ROOT/crds-$1-$2"; }  # name version

fetch_crd_bundle() { # name version module files...
  local name=$1 ver=$2 module=$3; shift 3
  local dest tmp moddir f; dest="$(crd_bundle_dir "$name" "$ver")"
  [ -d "$dest" ] && return 0
  command -v go >/dev/null || die "go is not installed (needed to fetch the $name CRDs)"
  tmp="$(mktemp -d "$BIN_ROOT/.crds-$name.XXXXXX")"
  moddir="$(cd "$tmp" && go mod download -json "$module@$ver" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')"
  [ -d "$moddir" ] || { rm -rf "$tmp"; die "build: go mod download $module@$ver failed"; }
  for f in "$@"; do
    [ -f "$moddir/$f" ] || { rm -rf "$tmp"; die "build: no $f in $module@$ver ($moddir)"; }
    cp "$moddir/$f" "$tmp/" && chmod 644 "$tmp/$(basename "$f")"
  done
  mv "$tmp" "$dest"
  log "build: $name $ver CRDs copied from $module into $dest"
}

component_line() { # name -> its COMPONENTS line
  local line
  for line in "${COMPONENTS[@]}"; do
    [ "${line%% *}" = "$1" ] && { echo "$line"; return 0; }
  done
  die "unknown component $1"
}

cmd_build() { # [cluster]: only CLUSTER_COMPONENTS (what `up` runs); default every component
  mkdir -p "$BIN_ROOT"
  local line name total=$SECONDS summary=""
  local -a names=()
  if [ "${1:-all}" = cluster ]; then
    names=("${CLUSTER_COMPONENTS[@]}")
  else
    for line in "${COMPONENTS[@]}"; do names+=("${line%% *}"); done
  fi
  for name in "${names[@]}"; do
    line="$(component_line "$name")"
    # shellcheck disable=SC2086
    build_one $line
    local -a f; read -r -a f <<<"$line"
    summary+="${summary:+, }${f[0]} ${f[1]}"
  done
  for line in "${CRD_BUNDLES[@]}"; do
    # shellcheck disable=SC2086
    fetch_crd_bundle $line
    local -a c; read -r -a c <<<"$line"
    summary+="${summary:+, }${c[0]} ${c[1]} CRDs"
  done
  log "build: ready in $((SECONDS - total))s under $BIN_ROOT: $summary"
}

# ---------------------------------------------------------------------------
# up / down / env / status
# ---------------------------------------------------------------------------
LOGS="$STATE/logs"
PIDS="$STATE/pids"
KUBECONFIG_PATH="$STATE/kubeconfig"
AUDIT_LOG="$STATE/audit.log"
MARKER="$STATE/.disagg-operator-cluster"
# start order (`down` stops the clients first, then the apiserver, then etcd)
RUN_ORDER=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok lws)

kubectl_bin() { bin_path kubectl; }
kc() { "$(kubectl_bin)" --kubeconfig="$KUBECONFIG_PATH" "$@"; }

port_busy() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

pid_of() { # component -> pid if alive and really that binary
  local f="$PIDS/$1.pid" pid exe
  [ -f "$f" ] || return 1
  pid="$(cat "$f")"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
  case "$exe" in */"$1"|*/"$1"\ \(deleted\)) echo "$pid"; return 0 ;; esac
  return 1
}

gen_pki() {
  command -v openssl >/dev/null || die "openssl is needed to generate the cluster certificates"
  [ -f "$PKI/ca.crt" ] && return 0
  log "pki: generating CA, serving, client and service-account keys in $PKI"
  local o="$PKI.tmp"   # generated aside and renamed: never half a PKI
  rm -rf "$o"; mkdir -p "$o"
  # explicit config: do not depend on the system openssl.cnf for the CA extensions
  printf '%s\n' '[req]' 'distinguished_name=dn' 'x509_extensions=v3' 'prompt=no' \
    '[dn]' 'CN=disagg-local-ca' '[v3]' 'basicConstraints=critical,CA:TRUE' \
    'keyUsage=critical,keyCertSign,cRLSign,digitalSignature' 'subjectKeyIdentifier=hash' > "$o/ca.cnf"
  openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -config "$o/ca.cnf" \
    -keyout "$o/ca.key" -out "$o/ca.crt" 2>/dev/null
  rm -f "$o/ca.cnf"
  cert() { # name subject [extfile-content]
    local name=$1 subj=$2 ext=$3
    openssl req -newkey rsa:2048 -nodes -sha256 -subj "$subj" \
      -keyout "$o/$name.key" -out "$o/$name.csr" 2>/dev/null
    printf '%s\n' "$ext" > "$o/$name.ext"
    openssl x509 -req -in "$o/$name.csr" -CA "$o/ca.crt" -CAkey "$o/ca.key" -CAcreateserial \
      -days 3650 -sha256 -extfile "$o/$name.ext" -out "$o/$name.crt" 2>/dev/null
    rm -f "$o/$name.csr" "$o/$name.ext"
  }
  local client="basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  cert apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  cert admin "/O=system:masters/CN=kubernetes-admin" "$client"
  cert controller-manager "/CN=system:kube-controller-manager" "$client"
  cert scheduler "/CN=system:kube-scheduler" "$client"
  # kwok plays every kubelet: give it full access under its own user name so
  # the audit log can tell its writes apart from everyone else's.
  cert kwok "/O=system:masters/CN=kwok-controller" "$client"
  # the apiserver's client for aggregated APIs (request-header authentication)
  cert front-proxy-client "/CN=front-proxy-client" "$client"
  openssl genrsa -out "$o/sa.key" 2048 2>/dev/null
  openssl rsa -in "$o/sa.key" -pubout -out "$o/sa.pub" 2>/dev/null
  chmod 600 "$o"/*.key
  rm -rf "$PKI"; mv "$o" "$PKI"
}

# LWS's keys, signed by the cluster CA: a client certificate for its manager, and the
# serving certificate of its webhook server (the webhook configurations carry the CA).
# Separate from gen_pki so that a cluster made before LWS was added gets them too.
gen_lws_pki() {
  [ -f "$PKI/lws-controller.crt" ] && [ -f "$PKI/lws-webhook/tls.crt" ] && return 0
  log "pki: generating the LWS manager's client key and its webhook serving key in $PKI"
  local o="$PKI/lws.tmp"
  rm -rf "$o"; mkdir -p "$o/lws-webhook"
  # full access, like kwok, under its own user name (the audit log tells its writes apart)
  sign_cert "$o/lws-controller" "/O=system:masters/CN=lws-controller" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  sign_cert "$o/lws-webhook/tls" "/CN=lws-webhook" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost"
  rm -rf "$PKI/lws-webhook"
  mv "$o/lws-webhook" "$PKI/lws-webhook"
  mv "$o/lws-controller.key" "$o/lws-controller.crt" "$PKI/"
  rm -rf "$o"
}

write_kubeconfig() { # file user
  local file=$1 user=$2
  cat > "$file" <<KCFG
apiVersion: v1
kind: Config
clusters:
- name: disagg-local
  cluster:
    server: https://$HOST:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 < "$PKI/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 < "$PKI/$user.crt")
    client-key-data: $(base64 -w0 < "$PKI/$user.key")
contexts:
- name: disagg-local
  context:
    cluster: disagg-local
    user: $user
current-context: disagg-local
KCFG
  chmod 600 "$file"
}

write_audit_policy() {
  cat > "$STATE/audit-policy.yaml" <<'POLICY'
# Metadata for every write (the body too of our status writes); nothing for reads. Tests count writes per user from
# $STATE/audit.log (one JSON event per line, stage ResponseComplete).
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
# bench/disagg_bench/operator_scale.py counts every request (reads and watches too) of its ServiceAccounts.
- level: Metadata
  userGroups: ["system:serviceaccounts:disagg-bench"]
# Status writes with their bodies: a test that finds one where none was due says what it changed.
- level: Request
  verbs: ["update", "patch"]
  resources:
  - group: disagg.dev
    resources: ["disaggregatedmodels/status", "disaggregatedroles/status"]
- level: Metadata
  verbs: ["create", "update", "patch", "delete", "deletecollection"]
- level: None
POLICY
}

# LWS's own configuration file (sigs.k8s.io/lws api/config/v1alpha1 Configuration; its
# manager has flags only for some of it). Internal cert management off: its cert
# rotator would write the serving certificate into a Secret for a webhook Service;
# here the webhook server reads the one gen_lws_pki made, and the webhook
# configurations (hack/lws/webhooks.yaml) carry the CA and a 127.0.0.1 URL.
write_lws_config() {
  cat > "$STATE/lws-config.yaml" <<LWSCFG
apiVersion: config.lws.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: $HOST
  port: $LWS_WEBHOOK_PORT
  certDir: $PKI/lws-webhook
metrics:
  bindAddress: $HOST:$LWS_METRICS_PORT
health:
  healthProbeBindAddress: $HOST:$LWS_HEALTH_PORT
LWSCFG
}

# Notes on flags:
# - kube-apiserver --endpoint-reconciler-type=none: the apiserver refuses to publish
#   a loopback advertise address in the `kubernetes` Service endpoints; nothing
#   in this cluster dials that Service (no kubelet, no kube-proxy), so it has none.
#   With the real node (DISAGG_REAL_NODE=1) it does: the apiserver listens beyond
#   loopback and advertises the node IP, which its reconciler publishes.
# - Pod IPs are loopback addresses (hack/nodes/ podCIDRs) so simulated engines can
#   bind them here. The apiserver refuses loopback addresses in Endpoints and
#   EndpointSlices, so the endpoints/endpointslice controllers could only fail (and
#   retry, and emit warning events) for every Service: they are disabled. Services
#   exist but have no endpoints: address pods by status.podIP, not through Services.
component_args() { # component -> prints args one per line
  case "$1" in
    etcd) printf '%s\n' \
      --name=disagg --data-dir="$STATE/etcd" \
      --listen-client-urls="http://$HOST:$ETCD_PORT" --advertise-client-urls="http://$HOST:$ETCD_PORT" \
      --listen-peer-urls="http://$HOST:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://$HOST:$ETCD_PEER_PORT" \
      --initial-cluster="disagg=http://$HOST:$ETCD_PEER_PORT" \
      --unsafe-no-fsync=true --quota-backend-bytes=4294967296 --log-level=warn ;;
    kube-apiserver) printf '%s\n' \
      --etcd-servers="http://$HOST:$ETCD_PORT" \
      --secure-port="$APISERVER_PORT" \
      --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
      --client-ca-file="$PKI/ca.crt" \
      --authorization-mode=Node,RBAC \
      --service-account-issuer=https://kubernetes.default.svc.cluster.local \
      --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
      --service-cluster-ip-range="$SERVICE_CIDR" \
      --allow-privileged=true \
      --requestheader-client-ca-file="$PKI/ca.crt" --requestheader-allowed-names=front-proxy-client \
      --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
      --requestheader-extra-headers-prefix=X-Remote-Extra- \
      --proxy-client-cert-file="$PKI/front-proxy-client.crt" --proxy-client-key-file="$PKI/front-proxy-client.key" \
      --audit-policy-file="$STATE/audit-policy.yaml" --audit-log-path="$AUDIT_LOG" \
      --audit-log-format=json --audit-log-maxsize=500 --audit-log-maxbackup=1 \
      --feature-gates="$FEATURE_GATES" --runtime-config="$RUNTIME_CONFIG" ;;
    kube-controller-manager) printf '%s\n' \
      --kubeconfig="$STATE/kubeconfigs/controller-manager.kubeconfig" \
      --authentication-kubeconfig="$STATE/kubeconfigs/controller-manager.kubeconfig" \
      --authorization-kubeconfig="$STATE/kubeconfigs/controller-manager.kubeconfig" \
      --bind-address=$HOST --secure-port="$KCM_PORT" --cert-dir="$PKI/controller-manager-serving" \
      --leader-elect=false --controllers='*,-endpoints-controller,-endpointslice-controller,-endpointslice-mirroring-controller' \
      --use-service-account-credentials=true \
      --root-ca-file="$PKI/ca.crt" --service-account-private-key-file="$PKI/sa.key" \
      --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
      --service-cluster-ip-range="$SERVICE_CIDR" --allocate-node-cidrs=false \
      --feature-gates="$FEATURE_GATES" ;;
    kube-scheduler) printf '%s\n' \
      --kubeconfig="$STATE/kubeconfigs/scheduler.kubeconfig" \
      --authentication-kubeconfig="$STATE/kubeconfigs/scheduler.kubeconfig" \
      --authorization-kubeconfig="$STATE/kubeconfigs/scheduler.kubeconfig" \
      --bind-address=$HOST --secure-port="$SCHED_PORT" --cert-dir="$PKI/scheduler-serving" \
      --leader-elect=false --feature-gates="$FEATURE_GATES" ;;
    kwok) printf '%s\n' \
      --kubeconfig="$STATE/kubeconfigs/kwok.kubeconfig" \
      --config="$ROOT/hack/kwok/stages.yaml" \
      --manage-nodes-with-label-selector=type=kwok \
      --node-lease-duration-seconds=40 \
      --node-ip=$HOST --cidr=127.$POD_NET.250.0/24 \
      --server-address="$HOST:$KWOK_PORT" ;;
    lws) printf '%s\n' \
      --kubeconfig="$STATE/kubeconfigs/lws-controller.kubeconfig" \
      --config="$STATE/lws-config.yaml" \
      --zap-log-level=info ;;
  esac
  # DISAGG_REAL_NODE=1 (hack/node/node.sh): logs/exec reach the real kubelet at its node IP (its Hostname address,
  # the node name, resolves nowhere) with a client certificate its x509 authentication accepts. Only then.
  # Its pods reach the API server as in a cluster: the `kubernetes` Service's ClusterIP, which the node's kube-proxy
  # sends to the address the API server advertises (the node IP: an endpoint may not be loopback), on all addresses.
  if [ "$1" = kube-apiserver ] && [ "$REAL_NODE" = 1 ]; then printf '%s\n' \
    --bind-address=0.0.0.0 --advertise-address="$(bash "$ROOT/hack/node/node.sh" ip)" --endpoint-reconciler-type=lease \
    --kubelet-preferred-address-types=InternalIP,Hostname \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" --kubelet-client-key="$PKI/apiserver-kubelet-client.key"
  elif [ "$1" = kube-apiserver ]; then printf '%s\n' \
    --bind-address=$HOST --advertise-address=$HOST --endpoint-reconciler-type=none
  fi
}

component_port() {
  case "$1" in
    etcd) echo "$ETCD_PORT" ;; kube-apiserver) echo "$APISERVER_PORT" ;;
    kube-controller-manager) echo "$KCM_PORT" ;; kube-scheduler) echo "$SCHED_PORT" ;;
    kwok) echo "$KWOK_PORT" ;;
    lws) echo "$LWS_WEBHOOK_PORT $LWS_METRICS_PORT $LWS_HEALTH_PORT" ;;  # webhook, metrics, health
  esac
}

start_component() {
  local name=$1 bin pid port
  if pid="$(pid_of "$name")"; then
    log "up: $name already running (pid $pid)"; return 0
  fi
  port="$(component_port "$name")"
  local p
  for p in $port; do
    if port_busy "$p"; then
      die "port $HOST:$p (for $name) is taken by another process; set DISAGG_PORT_BASE to move all ports"
    fi
  done
  bin="$(bin_path "$name")"
  local -a args
  mapfile -t args < <(component_args "$name")
  mkdir -p "$LOGS" "$PIDS"
  printf '\n=== %s start %s: %s %s\n' "$(date -u +%FT%TZ)" "$name" "$bin" "${args[*]}" >> "$LOGS/$name.log"
  setsid "$bin" "${args[@]}" >> "$LOGS/$name.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$PIDS/$name.pid"
  log "up: started $name (pid $!, port ${port// /,}, log $LOGS/$name.log)"
}

# wait_until <what> <timeout-s> <component-or-""> cmd... : retry cmd until it succeeds
wait_until() {
  local what=$1 timeout=$2 comp=$3; shift 3
  local start=$SECONDS
  until "$@" >/dev/null 2>&1; do
    if [ -n "$comp" ] && ! pid_of "$comp" >/dev/null; then
      tail -n 30 "$LOGS/$comp.log" >&2 || true
      die "$comp exited while waiting for $what (log: $LOGS/$comp.log)"
    fi
    if [ $((SECONDS - start)) -ge "$timeout" ]; then
      [ -n "$comp" ] && { tail -n 30 "$LOGS/$comp.log" >&2 || true; }
      die "timed out after ${timeout}s waiting for $what"
    fi
    sleep 0.5
  done
  log "up: $what ok ($((SECONDS - start))s)"
}

# http_body <url>: body of an unauthenticated GET (health endpoints are always
# allowed); curl when there is one, else openssl s_client / bash /dev/tcp.
http_body() {
  local url=$1
  if command -v curl >/dev/null; then
    curl -fsk --max-time 5 "$url"; return
  fi
  local scheme=${url%%://*} rest=${url#*://}
  local hostport=${rest%%/*} path="/${rest#*/}"
  local req
  req="$(printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$path" "$hostport")"
  if [ "$scheme" = https ]; then
    printf '%s' "$req" | timeout 5 openssl s_client -quiet -connect "$hostport" 2>/dev/null | tail -n 1
  else
    (exec 3<>"/dev/tcp/${hostport%:*}/${hostport##*:}" && printf '%s' "$req" >&3 && timeout 5 cat <&3 | tail -n 1)
  fi
}
health_ok() {
  local out
  out="$(http_body "$1" 2>/dev/null)" || return 1
  case "$out" in ok|*'"health":"true"'*) return 0 ;; *) return 1 ;; esac
}
etcd_healthy() { health_ok "http://$HOST:$ETCD_PORT/health"; }
apiserver_ready() { [ "$(kc get --raw /readyz 2>/dev/null)" = ok ]; }
kcm_healthy() { health_ok "https://$HOST:$KCM_PORT/healthz"; }
sched_healthy() { health_ok "https://$HOST:$SCHED_PORT/healthz"; }
kwok_healthy() { health_ok "http://$HOST:$KWOK_PORT/healthz"; }
lws_healthy() { health_ok "http://$HOST:$LWS_HEALTH_PORT/healthz"; }
default_sa_exists() { kc -n default get serviceaccount default; }

node_names() { sed -n 's/^  name: \(.*\)$/\1/p' "$ROOT"/hack/nodes/*.yaml; }

nodes_ready() {
  local want got
  want="$(node_names | wc -l)"
  got="$(kc get nodes -l type=kwok -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' 2>/dev/null | grep -c '^True$' || true)"
  [ "$got" -ge "$want" ]
}

create_nodes() {
  local f out
  for f in "$ROOT"/hack/nodes/*.yaml; do
    # the nodes' loopback addresses and podCIDRs, 127.0.x.y, moved to this cluster's 127.$POD_NET.x.y
    if ! out="$(sed "s#127\.0\.#127.$POD_NET.#g" "$f" | kc create -f - 2>&1)"; then
      if printf '%s\n' "$out" | grep -v 'AlreadyExists' | grep -q .; then
        printf '%s\n' "$out" >&2; die "creating nodes from $f failed"
      fi
    fi
  done
  log "up: nodes from hack/nodes/ present ($(node_names | tr '\n' ' '))"
}

# More p5en nodes than hack/nodes/p5en.yaml's 4: copies of its last node, kwok-p5en-<i>, in a zone of their own,
# us-west-2c, under one spine (nn-c1/nn-c2/nn-c3): whichever zone the minimal example took, a model whose
# placement requires one zone finds them all free. Each has a pod CIDR of its own, 127.<POD_NET>.<100+i>.0/24
# (hack/nodes/ use 1-8, kwok's own 250, the e2e's pools 210+).
cmd_p5en() {
  local want=$1 i first
  [[ "$want" =~ ^[0-9]+$ ]] && [ "$want" -ge 4 ] && [ "$want" -le 100 ] || die "usage: hack/cluster.sh p5en N (4 to 100)"
  first="$(awk 'BEGIN{RS="\n---\n"} /name: kwok-p5en-3\n/ {print; exit}' "$ROOT/hack/nodes/p5en.yaml")"
  [ -n "$first" ] || die "no kwok-p5en-3 in hack/nodes/p5en.yaml"
  for ((i = 4; i < want; i++)); do
    kc get node "kwok-p5en-$i" >/dev/null 2>&1 && continue
    printf '%s\n' "$first" | sed "s#kwok-p5en-3#kwok-p5en-$i#g; s#127\.0\.4\.#127.$POD_NET.$((100 + i)).#g; s#us-west-2b#us-west-2c#; s#nn-b\([0-9]\)\(-[0-9]\)*\"#nn-c\1\"#" | kc create -f - >/dev/null \
      || die "creating node kwok-p5en-$i failed"
  done
  local node
  for node in $(kc get nodes -o name | sed -n 's#^node/kwok-p5en-\([0-9]*\)$#\1#p'); do
    [ "$node" -ge "$want" ] && [ "$node" -ge 4 ] && kc delete node "kwok-p5en-$node" --wait=false >/dev/null  # only copies
  done
  wait_until "$want p5en nodes Ready" 60 kwok p5en_ready "$want"
  log "p5en: $(kc get nodes -l node.kubernetes.io/instance-type=p5en.48xlarge --no-headers | wc -l) nodes"
}
p5en_ready() {
  [ "$(kc get nodes -l node.kubernetes.io/instance-type=p5en.48xlarge -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | grep -c '^True$')" -ge "$1" ]
}

# LWS's CRDs (copied from its module next to its binary by `build`) and its webhook
# configurations. Server-side apply: the CRDs are too big for the last-applied annotation.
LWS_CRDS=(leaderworkersets.leaderworkerset.x-k8s.io disaggregatedsets.disaggregatedset.x-k8s.io)
install_lws_crds() { # one kubectl per CRD, in parallel: each takes the apiserver a second or two
  local dir f rc=0; dir="$(bin_dir lws)/crd"
  local -a pids=()
  [ -d "$dir" ] || die "no LWS CRDs in $dir (remove $(bin_dir lws) and run hack/cluster.sh build)"
  for f in "$dir"/*.yaml; do
    kc apply --server-side --force-conflicts --field-manager=disagg-hack-cluster -f "$f" >/dev/null &
    pids+=($!)
  done
  for f in "${pids[@]}"; do wait "$f" || rc=1; done
  [ "$rc" -eq 0 ] || die "installing the LWS CRDs from $dir failed"
}
install_upstream_crds() { # CRD_BUNDLES, server-side (idempotent: also run on a cluster that is already up)
  local line f rc=0
  local -a pids=() c
  for line in "${CRD_BUNDLES[@]}"; do
    read -r -a c <<<"$line"
    for f in "$(crd_bundle_dir "${c[0]}" "${c[1]}")"/*.yaml; do
      kc apply --server-side --force-conflicts --field-manager=disagg-hack-cluster -f "$f" >/dev/null &
      pids+=($!)
    done
  done
  for f in "${pids[@]}"; do wait "$f" || rc=1; done
  [ "$rc" -eq 0 ] || die "installing the Gateway API and inference extension CRDs failed"
}
upstream_crds_established() {
  [ "$(kc get crd "${UPSTREAM_CRDS[@]}" -o 'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Established")].status}{end}')" = TrueTrueTrueTrue ]
}
# (the manager must not start before: it looks for a missing kind again only every 10s)
lws_crds_established() {
  [ "$(kc get crd "${LWS_CRDS[@]}" -o 'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Established")].status}{end}')" = TrueTrue ]
}
install_lws_webhooks() {
  sed -e "s#@LWS_WEBHOOK_URL@#https://$HOST:$LWS_WEBHOOK_PORT#" \
      -e "s#@LWS_CA_BUNDLE@#$(base64 -w0 < "$PKI/ca.crt")#" "$ROOT/hack/lws/webhooks.yaml" \
    | kc apply --server-side --force-conflicts --field-manager=disagg-hack-cluster -f - >/dev/null \
    || die "installing the LWS webhook configurations (hack/lws/webhooks.yaml) failed"
}
# the API server calls both LWS webhooks for a server-side dry-run create; only LWS's
# defaulting webhook sets spec.networkConfig.subdomainPolicy (the CRD has no default)
lws_webhook_ready() {
  [ "$(kc create --dry-run=server -o 'jsonpath={.spec.networkConfig.subdomainPolicy}' -f - <<'PROBE' 2>/dev/null
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: cluster-sh-webhook-probe
  namespace: default
spec:
  replicas: 1
  leaderWorkerTemplate:
    size: 1
    workerTemplate:
      spec:
        containers:
        - name: probe
          image: probe
PROBE
)" = Shared ]
}

all_healthy() {
  local c
  for c in "${RUN_ORDER[@]}"; do pid_of "$c" >/dev/null || return 1; done
  apiserver_ready && nodes_ready && lws_webhook_ready
}

cmd_up() {
  local start=$SECONDS
  cmd_build cluster
  if [ -f "$MARKER" ] && all_healthy; then
    install_upstream_crds  # a cluster made before they were added gets them too
    wait_until "Gateway API and inference extension CRDs Established" 60 kube-apiserver upstream_crds_established
    log "up: cluster already up and healthy ($STATE)"
    if [ "$REAL_NODE" = 1 ]; then bash "$ROOT/hack/node/node.sh" up 9>&-; fi
    cmd_env
    return 0
  fi
  if [ -d "$STATE" ] && [ ! -f "$MARKER" ] && [ -n "$(ls -A "$STATE")" ]; then
    die "$STATE exists, is not empty and was not made by this script; refusing to use it (DISAGG_STATE)"
  fi
  mkdir -p "$STATE" "$LOGS" "$PIDS" "$STATE/kubeconfigs"
  touch "$MARKER"
  gen_pki
  gen_lws_pki
  if [ "$REAL_NODE" = 1 ]; then bash "$ROOT/hack/node/node.sh" pki; fi
  write_audit_policy
  write_lws_config
  write_kubeconfig "$KUBECONFIG_PATH" admin
  local u
  for u in controller-manager scheduler kwok lws-controller; do
    write_kubeconfig "$STATE/kubeconfigs/$u.kubeconfig" "$u"
  done

  start_component etcd
  wait_until "etcd health" 60 etcd etcd_healthy
  start_component kube-apiserver
  wait_until "kube-apiserver /readyz" 180 kube-apiserver apiserver_ready
  # LWS's CRDs take the apiserver a few seconds (2.8 MB of schema): in the background,
  # while the other components start
  local lws_objects
  { install_lws_crds; install_lws_webhooks; install_upstream_crds; } &
  lws_objects=$!
  start_component kube-controller-manager
  start_component kube-scheduler
  start_component kwok
  wait_until "kube-controller-manager /healthz" 120 kube-controller-manager kcm_healthy
  wait_until "kube-scheduler /healthz" 120 kube-scheduler sched_healthy
  wait_until "kwok /healthz" 120 kwok kwok_healthy
  create_nodes
  wait_until "nodes Ready" 120 kwok nodes_ready
  wait "$lws_objects" || die "installing LWS's CRDs and webhook configurations failed"
  wait_until "LWS CRDs Established" 60 kube-apiserver lws_crds_established
  wait_until "Gateway API and inference extension CRDs Established" 60 kube-apiserver upstream_crds_established
  start_component lws
  wait_until "default ServiceAccount" 120 kube-controller-manager default_sa_exists
  wait_until "lws /healthz" 120 lws lws_healthy
  wait_until "lws admission webhooks (dry-run create of a LeaderWorkerSet)" 120 lws lws_webhook_ready
  log "up: cluster ready in $((SECONDS - start))s; kubeconfig $KUBECONFIG_PATH, audit log $AUDIT_LOG"
  if [ "$REAL_NODE" = 1 ]; then bash "$ROOT/hack/node/node.sh" up 9>&-; fi
  cmd_env
}

stop_components() { # names...: SIGTERM them together, wait up to 20s, then SIGKILL
  local name pid i
  local -a names=() pids=()
  for name in "$@"; do
    if pid="$(pid_of "$name")"; then
      names+=("$name"); pids+=("$pid")
      kill -TERM "$pid" 2>/dev/null || true
    fi
    rm -f "$PIDS/$name.pid"
  done
  for i in "${!pids[@]}"; do
    local n
    pid=${pids[$i]}
    for ((n = 0; n < 100; n++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
      log "down: ${names[$i]} (pid $pid) did not stop in 20s, killing"
      kill -KILL "$pid" 2>/dev/null || true
      while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    log "down: stopped ${names[$i]} (pid $pid)"
  done
}

cmd_down() {
  # a real node (hack/node/node.sh) first, while the apiserver can still delete its pods; also when
  # DISAGG_REAL_NODE is unset now but a node was started (its mounts are under $STATE)
  local node_failed=0
  if [ "$REAL_NODE" = 1 ] || [ -d "$STATE/node" ]; then bash "$ROOT/hack/node/node.sh" down 9>&- || node_failed=1; fi
  # clients first (in parallel), then the apiserver, then etcd
  stop_components kwok kube-scheduler kube-controller-manager lws
  stop_components kube-apiserver
  stop_components etcd
  if [ -d "$STATE" ]; then
    if [ "$node_failed" = 1 ]; then
      log "down: removing the real node failed (above); not removing $STATE (mounts may be under it)"
    elif [ -f "$MARKER" ]; then
      rm -rf -- "$STATE"
      log "down: removed $STATE"
    else
      log "down: $STATE has no $(basename "$MARKER") marker; not removing it"
    fi
  fi
}

cmd_env() {
  echo "export DISAGG_STATE=$STATE"
  echo "export KUBECONFIG=$KUBECONFIG_PATH"
  echo "export PATH=$(dirname "$(kubectl_bin)"):\$PATH"
  echo "export DISAGG_AUDIT_LOG=$AUDIT_LOG"
}

cmd_status() {
  local c pid ok=0
  echo "state:      $STATE"
  echo "kubeconfig: $KUBECONFIG_PATH"
  echo "audit log:  $AUDIT_LOG"
  for c in "${RUN_ORDER[@]}"; do
    if pid="$(pid_of "$c")"; then
      local ports; ports="$(component_port "$c")"
      printf '%-24s running  pid %-8s port %s\n' "$c" "$pid" "${ports// /,}"
    else
      printf '%-24s stopped\n' "$c"; ok=1
    fi
  done
  if [ -x "$(kubectl_bin)" ] && [ -f "$KUBECONFIG_PATH" ] && apiserver_ready; then
    echo "apiserver:  /readyz ok at https://$HOST:$APISERVER_PORT"
    kc get nodes -L node.kubernetes.io/instance-type,topology.kubernetes.io/zone 2>/dev/null || ok=1
    nodes_ready || ok=1
    if kc get --raw /apis/scheduling.k8s.io/v1beta1 2>/dev/null | grep -q '"podgroups"'; then
      echo "gangs:      scheduling.k8s.io/v1beta1 PodGroups served (GenericWorkload)"
    else  # a cluster started before hack/cluster.sh enabled it: down and up again
      echo "gangs:      no scheduling.k8s.io/v1beta1 PodGroups (started without GenericWorkload?)"
    fi
    if lws_webhook_ready; then
      echo "lws:        webhooks answer at https://$HOST:$LWS_WEBHOOK_PORT"
    else
      echo "lws:        webhooks do not answer at https://$HOST:$LWS_WEBHOOK_PORT"; ok=1
    fi
  else
    echo "apiserver:  not ready"; ok=1
  fi
  return $ok
}

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; }

# build/build-cluster/up/down take a lock so that concurrent callers (several test sessions)
# do not build or start things twice. Daemons are started with fd 9 closed.
take_lock() {
  mkdir -p "$CACHE"
  if command -v flock >/dev/null; then
    exec 9>"$CACHE/.cluster.lock"
    if ! flock -n 9; then
      log "waiting for another hack/cluster.sh (lock $CACHE/.cluster.lock)"
      flock 9
    fi
  fi
}

case "${1:-}" in
  build) take_lock; cmd_build ;;
  build-cluster) take_lock; cmd_build cluster ;;
  # DISAGG_REAL_NODE=1 only: the node's binaries alone (minutes of compiling), under a lock of its own so that a long
  # build does not hold up other sessions' `up` (build_one builds aside and renames: never half a binary)
  build-node)
    [ "$REAL_NODE" = 1 ] || die "build-node: set DISAGG_REAL_NODE=1"
    mkdir -p "$BIN_ROOT"
    if command -v flock >/dev/null; then exec 8>"$CACHE/.kubelet-build.lock"; flock 8; fi
    # shellcheck disable=SC2046
    build_one $(component_line kubelet)
    # shellcheck disable=SC2046
    build_one $(component_line kube-proxy)
    # shellcheck disable=SC2046
    build_one $(component_line fakegpu) ;;
  up) take_lock; cmd_up ;;
  down) take_lock; cmd_down ;;
  p5en) cmd_p5en "${2:?usage: hack/cluster.sh p5en N}" ;;
  env) cmd_env ;;
  path) component_field "${2:?usage: hack/cluster.sh path COMPONENT}" 0 >/dev/null; bin_path "$2" ;;
  status) cmd_status ;;
  -h|--help|help) usage ;;
  *) usage; exit 2 ;;
esac
