#!/usr/bin/env bash
# Issue 33, item 2: one real node, a kubelet + containerd, beside the kwok nodes of the local
# control plane. Opt-in: hack/cluster.sh runs it when DISAGG_REAL_NODE=1 (`up` after the cluster is healthy,
# `down` before it stops the control plane); it can also be run by hand with the same environment.
#
#   hack/node/node.sh pki        the API server's kubelet client certificate (cluster.sh, before the apiserver)
#   hack/node/node.sh ip         the node IP (cluster.sh: the API server advertises it for the node's pods)
#   hack/node/node.sh up         containerd, the pause image, the kubelet's identity, the kubelet; wait Ready;
#                                the device plugin of its fake GPUs (start_device_plugin); kube-proxy
#   hack/node/node.sh import TAR [NAME]   import an OCI layout tarball into the node's containerd (k8s.io
#                                namespace); NAME: --base-name (default: the image's own name annotation)
#   hack/node/node.sh down       delete the node's pods, stop the kubelet, the device plugin, kube-proxy and containerd,
#                                unmount, remove the cgroups, the bridge, kube-proxy's chains and what the kubelet
#                                wrote outside $STATE
#   hack/node/node.sh status
#
# Environment: DISAGG_STATE, DISAGG_PORT_BASE, DISAGG_CACHE as hack/cluster.sh; DISAGG_NODE_IP (default: the IPv4
# address of the default route's interface: the kubelet refuses a loopback node IP); DISAGG_NODE_NAME (default disagg-real-node).
# The node is labelled disagg.dev/real-node=true and tainted disagg.dev/real-node=true:NoSchedule: a pod for it
# needs both a nodeSelector and a toleration; kwok's pods never land there. Like a cloud node it has a region and
# a zone of its own (topology.kubernetes.io/region=local, zone=local-real-node): an engine pair's pods must share
# a zone (the operator's pod affinity), so a pair placed here needs the label.
#
# Needs root, containerd and runc (Debian's containerd 1.6: installed with apt when missing, with
# containernetworking-plugins), gcc (the pause image), umoci. Host-wide state it must not change and does not:
# the sysctls the kubelet would rewrite (vm.overcommit_memory, vm.panic_on_oom, kernel.panic,
# kernel.panic_on_oops, kernel.keys.root_max*) are bind-mounted over in the kubelet's own mount namespace.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# CACHE, BIN_ROOT, STATE, PORT_BASE, PKI and sign_cert: hack/cluster.sh's
source "$ROOT/hack/lib/common.sh"
N="$STATE/node"
NAME="${DISAGG_NODE_NAME:-disagg-real-node}"
# the kubelet's and the pause image's version: the control plane's (one source: hack/cluster.sh)
K8S_VERSION="$(sed -n 's/^K8S_VERSION=\(v[0-9.]*\)$/\1/p' "$ROOT/hack/cluster.sh")"
[ -n "$K8S_VERSION" ] || { echo "no K8S_VERSION line in hack/cluster.sh" >&2; exit 1; }
# the Services' ClusterIPs, which the pods reach through the host (kube-proxy): also hack/cluster.sh's
SERVICE_CIDR="$(sed -n 's|^SERVICE_CIDR=\([0-9./]*\) .*$|\1|p' "$ROOT/hack/cluster.sh")"
[ -n "$SERVICE_CIDR" ] || { echo "no SERVICE_CIDR line in hack/cluster.sh" >&2; exit 1; }
KUBELET_PORT=$((PORT_BASE + 9))
KUBELET_HEALTHZ_PORT=$((PORT_BASE + 10))
KUBE_PROXY_HEALTHZ_PORT=$((PORT_BASE + 11))
KUBE_PROXY_METRICS_PORT=$((PORT_BASE + 12))
# per-cluster names on the host: two clusters' nodes do not share cgroups or bridges
CGROUP_ROOT="/disagg-node-$PORT_BASE"
BRIDGE="dnode$PORT_BASE"
POD_SUBNET="10.244.$((PORT_BASE % 250)).0/24"
BRIDGE_IP="10.244.$((PORT_BASE % 250)).1"
SOCK="$N/containerd/containerd.sock"
LABEL=disagg.dev/real-node
ZONE_LABELS=topology.kubernetes.io/region=local,topology.kubernetes.io/zone=local-real-node
# the fake GPUs (start_device_plugin): DISAGG_NODE_GPUS, default 4
GPUS="${DISAGG_NODE_GPUS:-4}"
PLUGIN_DIR=/var/lib/kubelet/device-plugins
PLUGIN_SOCKET="disagg-fakegpu-$PORT_BASE.sock"
# paths the kubelet/containerd hard-code outside $STATE (removed by `down` when `up` did not find them)
HOST_PATHS=(/var/lib/kubelet /var/log/containers /run/containerd /var/lib/cni /opt/containerd)

log() { printf '[node %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
kc() { "$(bash "$ROOT/hack/cluster.sh" path kubectl)" --kubeconfig="$STATE/kubeconfig" "$@"; }
ctr_() { ctr -a "$SOCK" -n k8s.io "$@"; }

node_ip() { # DISAGG_NODE_IP, else the address of the default route's interface (the kubelet refuses loopback)
  [ -n "${DISAGG_NODE_IP:-}" ] && { echo "$DISAGG_NODE_IP"; return; }
  local dev
  dev="$(ip -4 route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')"
  ip -4 -o addr show dev "${dev:-eth0}" 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -1
}

alive() { # pidfile -> pid if alive
  local pid
  [ -f "$1" ] || return 1
  pid="$(cat "$1")"; [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

# The API server's client certificate for kubelets (logs, exec, port-forward): system:masters, like kubeadm's
# apiserver-kubelet-client. kwok's kubelet server does not check it.
cmd_pki() {
  [ -f "$PKI/ca.key" ] || die "no cluster CA in $PKI"
  [ -f "$PKI/apiserver-kubelet-client.crt" ] && return 0
  sign_cert "$PKI/apiserver-kubelet-client" "/O=system:masters/CN=kube-apiserver-kubelet-client" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
}

ensure_packages() {
  local missing=()
  command -v containerd >/dev/null || missing+=(containerd)
  command -v runc >/dev/null || missing+=(runc)
  [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
  command -v umoci >/dev/null || missing+=(umoci)
  command -v gcc >/dev/null || missing+=(gcc libc6-dev)
  command -v iptables-restore >/dev/null || missing+=(iptables)  # kube-proxy's iptables mode
  command -v curl >/dev/null || missing+=(curl)  # kube-proxy's healthz
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2 \
    || die "apt-get install ${missing[*]} failed"
}

# The sandbox ("pause") image from Kubernetes' own build/pause source at the kubelet's version, static, packed
# with umoci; cached like the binaries ($BIN_ROOT/pause-<version>/pause.tar, OCI layout, ref name = version).
pause_image() {
  local dir="$BIN_ROOT/pause-$K8S_VERSION" src tmp
  if [ ! -f "$dir/pause.tar" ]; then
    src="$(cd "$ROOT/hack/node/kubelet-tools" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')/build/pause/linux/pause.c"
    [ -f "$src" ] || die "no build/pause/linux/pause.c in k8s.io/kubernetes@$K8S_VERSION ($src)"
    tmp="$(mktemp -d "$BIN_ROOT/.build-pause.XXXXXX")"
    mkdir -p "$tmp/rootfs"
    gcc -Os -Wall -Werror -static -DVERSION="$K8S_VERSION" -o "$tmp/rootfs/pause" "$src" || die "gcc pause.c failed"
    umoci init --layout "$tmp/oci" && umoci new --image "$tmp/oci:$K8S_VERSION"
    tar --numeric-owner --owner=0 --group=0 -C "$tmp/rootfs" -cf "$tmp/layer.tar" .
    umoci raw add-layer --image "$tmp/oci:$K8S_VERSION" "$tmp/layer.tar"
    umoci config --image "$tmp/oci:$K8S_VERSION" --os linux --architecture amd64 \
      --config.entrypoint /pause --config.user 65535:65535
    (cd "$tmp/oci" && tar -cf "$tmp/pause.tar" .)
    mkdir -p "$tmp/out"; mv "$tmp/pause.tar" "$tmp/out/"; cp "$tmp/rootfs/pause" "$tmp/out/"
    rm -rf "$dir"; mv "$tmp/out" "$dir"; rm -rf "$tmp"
    log "pause image built: $dir/pause.tar"
  fi
  echo "$dir/pause.tar"
}

write_containerd_config() {
  mkdir -p "$N/containerd" "$N/cni/net.d" "$N/cni/ipam"
  cat > "$N/containerd/config.toml" <<EOF
# containerd 1.6 for the disagg-operator real node (hack/node/node.sh): all state under $N
version = 2
root = "$N/containerd/root"
state = "$N/containerd/state"
# opt: would create /opt/containerd; the others are snapshotters this machine has no use for
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:$K8S_VERSION"
  disable_apparmor = true
  # the machine's bounding set lacks CAP_SYS_RESOURCE: no negative oom_score_adj (hack/node/README.md)
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$(command -v runc)"
        Root = "$N/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$N/cni/net.d"
    max_conf_num = 1
EOF
  # containerd reports NetworkReady (the node's Ready) only with a valid CNI config; host-network pods never use
  # it. No gateway, no masquerade: nothing writes iptables rules or turns on ip_forward. The host's own address on
  # the bridge (host_bridge, .1, outside the pods' range) is what lets the kubelet's probes and the host's
  # processes (a router, the tests) reach pod IPs: delivered locally, never forwarded. The pods' one route out is
  # to the Services' range, through that address: kube-proxy's DNAT sends a ClusterIP to the host's own
  # addresses (the API server's endpoint is the node IP), so that too is delivered locally.
  cat > "$N/cni/net.d/10-disagg-real-node.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "disagg-real-node", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": false, "ipMasq": false, "hairpinMode": false,
   "ipam": {"type": "host-local", "dataDir": "$N/cni/ipam",
            "ranges": [[{"subnet": "$POD_SUBNET", "rangeStart": "${POD_SUBNET%.0/24}.2"}]],
            "routes": [{"dst": "$SERVICE_CIDR", "gw": "$BRIDGE_IP"}]}},
  {"type": "loopback"}]}
EOF
}

# The pods' bridge, made before the CNI plugin would make it, with the host's address on it (BRIDGE_IP/24): the
# kernel's route to the pod subnet comes with the address and goes with the bridge (`down` deletes it).
host_bridge() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip -4 addr show dev "$BRIDGE" | grep -q "inet $BRIDGE_IP/" || ip addr add "$BRIDGE_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
}

start_containerd() {
  local pid
  if pid="$(alive "$N/containerd/pid")"; then log "containerd already running (pid $pid)"; return 0; fi
  [ -S "$SOCK" ] && rm -f "$SOCK" "$SOCK.ttrpc"
  ( setsid containerd --config "$N/containerd/config.toml" >> "$N/containerd/log" 2>&1 < /dev/null 9>&- 8>&- &
    echo $! > "$N/containerd/pid" )
  wait_for containerd "$N/containerd/pid" "$N/containerd/log" 20 containerd_answers
  log "containerd up (pid $(cat "$N/containerd/pid"), log $N/containerd/log)"
}

containerd_answers() { ctr -a "$SOCK" version >/dev/null 2>&1; }

# wait_for WHAT PIDFILE LOG SECONDS CHECK...: run CHECK every half second until it passes; die with the log's tail
# when WHAT's process (PIDFILE) exits first, or when SECONDS pass.
wait_for() {
  local what=$1 pidfile=$2 logfile=$3 seconds=$4 i
  shift 4
  for ((i = 0; i < seconds * 2; i++)); do
    "$@" && return 0
    alive "$pidfile" >/dev/null || { tail -30 "$logfile" >&2; die "$what exited (log $logfile)"; }
    sleep 0.5
  done
  "$@" || { tail -30 "$logfile" >&2; die "$what: $* did not pass in ${seconds}s (log $logfile)"; }
}

cmd_import() { # tar [base-name]
  local tar=$1 base=${2:-}
  [ -f "$tar" ] || die "no $tar"
  if [ -n "$base" ]; then
    ctr_ images import --base-name "$base" "$tar" >&2
  else
    ctr_ images import "$tar" >&2
  fi
}

write_kubelet_files() { # ip
  local ip=$1 k="$N/kubelet"
  mkdir -p "$k/pki" "$k/root" "$k/pod-logs" "$k/sysctl"
  # client identity: the Node authorizer and NodeRestriction admit system:node:<name> in system:nodes
  client_kubeconfig "$k" "/O=system:nodes/CN=system:node:$NAME" kubelet
  # serving certificate for the node IP (the API server does not verify it: no --kubelet-certificate-authority,
  # which kwok's self-signed kubelet server would fail)
  [ -f "$k/pki/kubelet.crt" ] || sign_cert "$k/pki/kubelet" "/CN=$NAME" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$ip,DNS:$NAME"
  cat > "$k/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://$SOCK
imageServiceEndpoint: unix://$SOCK
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
failSwapOn: false
failCgroupV1: false
protectKernelDefaults: false
podLogsDir: $k/pod-logs
address: $ip
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
tlsCertFile: $k/pki/kubelet.crt
tlsPrivateKeyFile: $k/pki/kubelet.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization:
  mode: Webhook
registerNode: true
registerWithTaints:
- {key: $LABEL, value: "true", effect: NoSchedule}
# locally imported images cannot be pulled again: never garbage-collect them; no evictions on a shared disk
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {}
maxPods: 20
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
serializeImagePulls: false
# not its KUBE-IPTABLES-HINT/KUBE-KUBELET-CANARY chains nor KUBE-FIREWALL's "block incoming localnet connections"
# DROP in the host's INPUT/OUTPUT (this node shares the host network namespace with everything else)
makeIPTablesUtilChains: false
EOF
  # the values the kubelet insists on, for its private view of /proc/sys (the host's stay as they are)
  echo 1 > "$k/sysctl/overcommit_memory"; echo 0 > "$k/sysctl/panic_on_oom"
  echo 10 > "$k/sysctl/panic"; echo 1 > "$k/sysctl/panic_on_oops"
  echo 1000000 > "$k/sysctl/root_maxkeys"; echo 25000000 > "$k/sysctl/root_maxbytes"
}

# A client certificate and kubeconfig for the cluster's API server (as a local client: on loopback)
client_kubeconfig() { # dir subject user
  local d=$1
  mkdir -p "$d/pki"
  [ -f "$d/pki/client.crt" ] || sign_cert "$d/pki/client" "$2" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  cat > "$d/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: disagg-local
  cluster:
    server: https://127.0.0.1:$PORT_BASE
    certificate-authority: $PKI/ca.crt
users:
- name: $3
  user:
    client-certificate: $d/pki/client.crt
    client-key: $d/pki/client.key
contexts:
- name: disagg-local
  context: {cluster: disagg-local, user: $3}
current-context: disagg-local
EOF
}

# kube-proxy (iptables mode, as EKS runs it): the node's pods reach Services' ClusterIPs, the `kubernetes` one (the
# API server, which cluster.sh then advertises at the node IP) first. Its identity, system:kube-proxy, is what the
# API server's bootstrap ClusterRoleBinding system:node-proxier grants. Host-wide settings it would change are left
# as they are: conntrack's table size and timeouts (0: leave), route_localnet (localhostNodePorts off), its OOM
# score; its chains go with `down` (kube-proxy --cleanup).
start_kube_proxy() {
  local d="$N/kube-proxy" pid proxy
  if pid="$(alive "$d/pid")"; then log "kube-proxy already running (pid $pid)"; return 0; fi
  proxy="$(DISAGG_REAL_NODE=1 bash "$ROOT/hack/cluster.sh" path kube-proxy)"
  [ -x "$proxy" ] || die "no kube-proxy at $proxy: DISAGG_REAL_NODE=1 hack/cluster.sh build-node"
  client_kubeconfig "$d" "/CN=system:kube-proxy" kube-proxy
  cat > "$d/config.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $d/kubeconfig}
hostnameOverride: $NAME
mode: iptables
clusterCIDR: $POD_SUBNET
healthzBindAddress: 127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT
metricsBindAddress: 127.0.0.1:$KUBE_PROXY_METRICS_PORT
oomScoreAdj: 0
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false}
EOF
  ( setsid "$proxy" --config="$d/config.yaml" >> "$d/log" 2>&1 < /dev/null 9>&- 8>&- &
    echo $! > "$d/pid" )
  wait_for kube-proxy "$d/pid" "$d/log" 30 kube_proxy_healthy
  log "kube-proxy up (pid $(cat "$d/pid"), iptables mode, log $d/log)"
}

kube_proxy_healthy() { curl -fsS "http://127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT/healthz" >/dev/null 2>&1; }

iptables_tables() { # "<family> <table>" of each iptables table that exists
  local f
  for f in ip ip6; do
    command -v "${f}tables-save" >/dev/null 2>&1 || continue
    "${f}tables-save" 2>/dev/null | sed -n "s/^\*\(.*\)/$f \1/p"
  done
}

# A kubelet with makeIPTablesUtilChains (the default; not ours) leaves chains in the host's tables: remove them, and
# a table that only they made (nft, where installed: iptables cannot delete a table)
iptables_cleanup() {
  local f t c
  for f in ip ip6; do
    command -v "${f}tables" >/dev/null 2>&1 || continue
    while "${f}tables" -w -t filter -D INPUT -j KUBE-FIREWALL 2>/dev/null; do :; done
    while "${f}tables" -w -t filter -D OUTPUT -j KUBE-FIREWALL 2>/dev/null; do :; done
    for t in filter mangle nat; do
      for c in KUBE-FIREWALL KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT; do
        "${f}tables" -w -t "$t" -F "$c" 2>/dev/null && "${f}tables" -w -t "$t" -X "$c" 2>/dev/null && log "removed iptables $f $t $c"
      done
      grep -qx "$f $t" "$N/iptables-tables.before" 2>/dev/null && continue
      # (not `iptables-save -t T`: iptables-nft prints a table that does not exist, with its built-in chains)
      "${f}tables-save" 2>/dev/null | grep -qx "\*$t" || continue       # no such table
      if "${f}tables" -w -t "$t" -S 2>/dev/null | grep -qv '^-P [A-Z]* ACCEPT$'; then
        log "iptables $f table $t has rules that are not the kubelet's: left"
      elif command -v nft >/dev/null; then
        if nft delete table "$f" "$t"; then log "removed empty iptables table $f $t (made by the kubelet)"
        else log "could not delete the empty iptables table $f $t"; fi
      else
        log "iptables $f table $t is empty but stays (made by the kubelet; nft, to delete it, is not installed)"
      fi
    done
  done
}

cgroup_hierarchies() { awk '$3 == "cgroup" {print $2}' /proc/mounts; }           # v1: the kubelet's cgroupRoot
all_cgroup_hierarchies() { awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' /proc/mounts; }  # runc also uses v2's

start_kubelet() { # ip
  local ip=$1 k="$N/kubelet" pid kubelet h
  if pid="$(alive "$k/pid")"; then log "kubelet already running (pid $pid)"; return 0; fi
  kubelet="$(DISAGG_REAL_NODE=1 bash "$ROOT/hack/cluster.sh" path kubelet)"
  [ -x "$kubelet" ] || die "no kubelet at $kubelet: DISAGG_REAL_NODE=1 hack/cluster.sh build-node"
  for h in $(cgroup_hierarchies); do mkdir -p "$h$CGROUP_ROOT"; done
  # the root dir a shared mount: the volumes the kubelet mounts in its namespace (tmpfs tokens, ...) reach
  # containerd and runc in the host's
  if ! awk -v d="$k/root" '$2 == d {f=1} END {exit !f}' /proc/mounts; then
    mount --bind "$k/root" "$k/root"
  fi
  mount --make-shared "$k/root"
  printf '\n=== %s start kubelet %s\n' "$(date -u +%FT%TZ)" "$kubelet" >> "$k/log"
  ( setsid unshare -m --propagation unchanged sh -c '
      s=$1; shift
      mount --bind "$s/overcommit_memory" /proc/sys/vm/overcommit_memory
      mount --bind "$s/panic_on_oom" /proc/sys/vm/panic_on_oom
      mount --bind "$s/panic" /proc/sys/kernel/panic
      mount --bind "$s/panic_on_oops" /proc/sys/kernel/panic_on_oops
      mount --bind "$s/root_maxkeys" /proc/sys/kernel/keys/root_maxkeys
      mount --bind "$s/root_maxbytes" /proc/sys/kernel/keys/root_maxbytes
      exec "$@"' sh "$k/sysctl" "$kubelet" --config="$k/config.yaml" --kubeconfig="$k/kubeconfig" \
        --root-dir="$k/root" --cert-dir="$k/pki" --hostname-override="$NAME" --node-ip="$ip" \
        --node-labels="$LABEL=true,$ZONE_LABELS" >> "$k/log" 2>&1 < /dev/null 9>&- 8>&- &
    echo $! > "$k/pid" )
  log "kubelet started (pid $(cat "$k/pid"), port $ip:$KUBELET_PORT, log $k/log)"
}

# The stand-in for NVIDIA's device plugin (hack/node/kubelet-tools/fakegpu): GPUS devices of nvidia.com/gpu, each
# a bind of /dev/null as /dev/nvidia<i> in the containers it is allocated to. It registers on the kubelet's socket,
# which the kubelet hard-codes at /var/lib/kubelet/device-plugins (so two real nodes on one host would clash there).
start_device_plugin() {
  local d="$N/fakegpu" pid plugin
  if pid="$(alive "$d/pid")"; then log "device plugin already running (pid $pid)"; return 0; fi
  plugin="$(DISAGG_REAL_NODE=1 bash "$ROOT/hack/cluster.sh" path fakegpu)"
  [ -x "$plugin" ] || die "no device plugin at $plugin: DISAGG_REAL_NODE=1 hack/cluster.sh build-node"
  mkdir -p "$d"
  # the kubelet's registration socket: a plugin started before it has nowhere to register
  wait_for kubelet "$N/kubelet/pid" "$N/kubelet/log" 30 test -S "$PLUGIN_DIR/kubelet.sock"
  ( setsid "$plugin" --count "$GPUS" --dir "$PLUGIN_DIR" --endpoint "$PLUGIN_SOCKET" >> "$d/log" 2>&1 < /dev/null 9>&- 8>&- &
    echo $! > "$d/pid" )
  wait_for "the device plugin" "$d/pid" "$d/log" 30 gpus_advertised
  log "device plugin: $GPUS nvidia.com/gpu (pid $(cat "$d/pid"))"
}

node_ready() {
  [ "$(kc get node "$NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

gpus_advertised() {
  [ "$(kc get node "$NAME" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}' 2>/dev/null)" = "$GPUS" ]
}

cmd_up() {
  [ "$(id -u)" = 0 ] || die "needs root"
  [ -f "$STATE/kubeconfig" ] || die "no cluster at $STATE: hack/cluster.sh up first"
  grep -q -- '--kubelet-client-certificate' "$STATE/logs/kube-apiserver.log" 2>/dev/null \
    || die "the API server at $STATE was started without DISAGG_REAL_NODE=1 (no kubelet client certificate): down and up with it"
  local start=$SECONDS ip pause
  ip="$(node_ip)"; [ -n "$ip" ] || die "no IPv4 address on the default route's interface: set DISAGG_NODE_IP"
  ensure_packages
  mkdir -p "$N"
  if [ ! -f "$N/host-paths.before" ]; then  # what existed before the first up (down removes only the rest)
    local p; for p in "${HOST_PATHS[@]}"; do [ -e "$p" ] && echo "$p"; done > "$N/host-paths.before" || true
    iptables_tables > "$N/iptables-tables.before"
  fi
  pause="$(pause_image)"
  write_containerd_config
  host_bridge
  start_containerd
  ctr_ images ls -q | grep -qx "localhost/pause:$K8S_VERSION" || cmd_import "$pause" localhost/pause
  write_kubelet_files "$ip"
  start_kubelet "$ip"
  wait_for kubelet "$N/kubelet/pid" "$N/kubelet/log" 120 node_ready
  start_device_plugin
  start_kube_proxy
  log "node $NAME Ready in $((SECONDS - start))s (containerd $(containerd --version | awk '{print $3}'), kubelet $K8S_VERSION, $ip)"
}

stop_pid() { # name pidfile
  local pid n
  pid="$(alive "$2")" || { rm -f "$2"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for ((n = 0; n < 100; n++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then log "$1 (pid $pid) did not stop in 20s, killing"; kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$2"; log "stopped $1 (pid $pid)"
}

cmd_down() {
  [ -d "$N" ] || { log "no real node at $N"; return 0; }
  local kpid
  # 1. the node's pods, through the kubelet (it stops their containers, tears down their network)
  if kpid="$(alive "$N/kubelet/pid")" && [ -f "$STATE/kubeconfig" ] && kc get node "$NAME" >/dev/null 2>&1; then
    kc delete pods -A --field-selector "spec.nodeName=$NAME" --grace-period=5 --wait=true --timeout=60s >/dev/null 2>&1 \
      || log "deleting the node's pods did not finish in 60s; their containers are killed below"
    kc delete node "$NAME" --wait=false >/dev/null 2>&1 || true
  fi
  stop_pid kubelet "$N/kubelet/pid"
  stop_pid "device plugin" "$N/fakegpu/pid"
  stop_pid kube-proxy "$N/kube-proxy/pid"
  rm -f "$PLUGIN_DIR/$PLUGIN_SOCKET"
  # 2. whatever containers are left (a kubelet that died first), then containerd and its shims. Their ids name
  # the CNI results a sandbox torn down without CNI DEL leaves (a pod made while the kubelet stopped)
  local containers=""
  if alive "$N/containerd/pid" >/dev/null; then
    containers="$(ctr_ containers ls -q 2>/dev/null || true)"
    local t
    for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s KILL "$t" >/dev/null 2>&1 || true; done
    sleep 1
    for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$t" >/dev/null 2>&1 || true; done
    for t in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers delete "$t" >/dev/null 2>&1 || true; done
  fi
  stop_pid containerd "$N/containerd/pid"
  local pid
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $SOCK( |$)" || true); do  # this containerd's shims only
    log "killing leftover shim pid $pid"; kill -KILL "$pid" 2>/dev/null || true
  done
  # 3. mounts under $N (deepest first): the shared root-dir bind, volumes, rootfs overlays, netns files
  local m
  for m in $(awk -v n="$N" 'index($2, n"/") == 1 || $2 == n {print $2}' /proc/mounts | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" || log "could not unmount $m"
  done
  # 4. cgroups (deepest first), the CNI bridge
  local h
  for h in $(all_cgroup_hierarchies); do
    [ -d "$h$CGROUP_ROOT" ] && find "$h$CGROUP_ROOT" -depth -type d -exec rmdir {} \; 2>/dev/null
    [ -d "$h$CGROUP_ROOT" ] && log "could not remove cgroup $h$CGROUP_ROOT (busy?)"
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && { ip link delete "$BRIDGE"; log "deleted bridge $BRIDGE"; }
  if [ -d "$N/kube-proxy" ]; then  # its chains (both families), as `kube-proxy --cleanup` removes them
    "$(DISAGG_REAL_NODE=1 bash "$ROOT/hack/cluster.sh" path kube-proxy)" --cleanup >> "$N/kube-proxy/log" 2>&1 \
      || log "kube-proxy --cleanup failed (log $N/kube-proxy/log)"
  fi
  iptables_cleanup
  # 5. what the kubelet and containerd hard-code outside $STATE, where the first `up` did not find it
  local p
  for p in "${HOST_PATHS[@]}"; do
    [ -e "$p" ] || continue
    grep -qx "$p" "$N/host-paths.before" 2>/dev/null && continue
    case "$p" in
      /var/lib/kubelet) rm -f "$PLUGIN_DIR/kubelet.sock" "$PLUGIN_DIR/kubelet_internal_checkpoint" ;;
      /var/log/containers) find /var/log/containers -maxdepth 1 -type l -lname "$N/*" -delete ;;
      /var/lib/cni)
        find /var/lib/cni -type f -path '*/results/disagg-real-node-*' -delete
        local id; for id in $containers; do rm -f /var/lib/cni/results/*-"$id"-*; done ;;
    esac
    find "$p" -depth -type d -empty -delete 2>/dev/null || true
    [ -e "$p" ] && log "left $p (not empty: $(find "$p" | head -5 | tr '\n' ' '))"
  done
  log "real node removed ($N stays for hack/cluster.sh down to delete)"
}

cmd_status() {
  local pid
  for c in containerd kubelet kube-proxy; do
    if pid="$(alive "$N/$c/pid")"; then echo "$c running pid $pid"; else echo "$c stopped"; fi
  done
  kc get node "$NAME" -o wide 2>/dev/null || echo "node $NAME not registered"
}

case "${1:-}" in
  pki) cmd_pki ;;
  ip) node_ip ;;
  up) cmd_up ;;
  down) cmd_down ;;
  import) cmd_import "${2:?usage: node.sh import TAR [BASE-NAME]}" "${3:-}" ;;
  status) cmd_status ;;
  *) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
