#!/usr/bin/env bash
# The main job on the embedded default: a local control plane with fake p5en/trn2 nodes, the CRD, the
# operator, and examples/minimal.yaml reconciled to Ready; then one streaming completion through the
# model's router to simulated engines on its pods' IPs, with the answer and both legs' timings.
#
#   hack/demo.sh          set up (.venv only: no vLLM parser environments), build only what the control
#                         plane runs (hack/cluster.sh up: no test tools), bring everything up, install
#                         what the chart installs once per cluster and the operator relies on (its gang
#                         admission policy), apply the example, wait for Ready, show it, stream one
#                         completion, show its status
#   hack/demo.sh --p5en N the same on a pool of N fake p5en nodes (hack/nodes/ has 4: room for the minimal
#                         example and a few more pods; those beyond 4 are a zone of their own: 9 run the
#                         minimal example and examples/deepseek-v3-p5en-wide-ep.yaml whole; 4 removes them)
#   hack/demo.sh cluster [--p5en N]
#                         only the cluster as the demo leaves it (control plane, pool, CRD, the chart's
#                         policy), no operator and no example: what the e2e checks the examples on
#   hack/demo.sh down     stop the operator and the control plane
#
# Afterwards: `eval "$(hack/cluster.sh env)"; kubectl get dm -A` talks to the same cluster.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${DISAGG_CACHE:-$HOME/.cache/disagg-operator}"
STATE="${DISAGG_STATE:-$CACHE/cluster}"
OPERATOR_PID="$STATE/pids/operator.pid"
OPERATOR_LOG="$STATE/logs/operator.log"
EXAMPLE="${DISAGG_DEMO_EXAMPLE:-examples/minimal.yaml}"
log() { printf '[demo %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

stop_operator() {
  if [ -f "$OPERATOR_PID" ] && kill -0 "$(cat "$OPERATOR_PID")" 2>/dev/null; then
    kill "$(cat "$OPERATOR_PID")"; sleep 1
  fi
  rm -f "$OPERATOR_PID"
}

if [ "${1:-}" = down ]; then
  stop_operator
  exec bash hack/cluster.sh down
fi
ONLY_CLUSTER=0
if [ "${1:-}" = cluster ]; then ONLY_CLUSTER=1; shift; fi
P5EN=""  # the pool as it is (4 p5en nodes from hack/nodes/, or what an earlier --p5en made)
if [ "${1:-}" = --p5en ]; then P5EN="${2:?usage: hack/demo.sh [cluster] --p5en N}"; fi

if [ "$ONLY_CLUSTER" = 0 ]; then
  # .venv only: `up` builds what it runs (hack/cluster.sh build-cluster), not the test tools `hack/setup.sh` builds
  DISAGG_SKIP_VLLM=1 DISAGG_SKIP_CLUSTER=1 bash hack/setup.sh
fi
bash hack/cluster.sh up
eval "$(bash hack/cluster.sh env)"

[ -z "$P5EN" ] || bash hack/cluster.sh p5en "$P5EN"

log "installing the CRD"
kubectl apply --server-side --force-conflicts -f crds/ >/dev/null
kubectl wait --for=condition=Established --timeout=60s crd/disaggregatedmodels.disagg.dev >/dev/null
# The chart's cluster-wide objects the operator relies on (its Deployment and RBAC stay out: the operator runs
# here as a local process): the gang admission policy, where this cluster serves PodGroups and the policies
# (it does: GenericWorkload), rendered by the chart as `helm install` would (docs/gang-scheduling.md).
log "installing the chart's gang admission policy"
"$(bash hack/cluster.sh path helm)" template disagg-operator charts/disagg-operator --show-only templates/gang-policy.yaml \
  --api-versions scheduling.k8s.io/v1beta1/PodGroup --api-versions admissionregistration.k8s.io/v1/MutatingAdmissionPolicy \
  | kubectl apply --server-side --force-conflicts -f - >/dev/null
# The API server takes a new policy up a moment later: wait until a server-side dry run of a pod of a pair is
# put in its group, so that the example's first pods are.
policy_in_effect() {
  printf '%s\n' 'apiVersion: v1' 'kind: Pod' \
    'metadata: {name: gang-policy-probe, namespace: default, labels: {disagg.dev/gang: pair, disagg.dev/pod-group: probe}}' \
    'spec: {containers: [{name: probe, image: probe}]}' \
    | kubectl create --dry-run=server -o 'jsonpath={.spec.schedulingGroup.podGroupName}' -f - 2>/dev/null | grep -qx probe
}
for _ in $(seq 60); do policy_in_effect && break; sleep 0.5; done
policy_in_effect || { log "the gang admission policy is not in effect after 30 s"; exit 1; }
[ "$ONLY_CLUSTER" = 1 ] && exit 0

stop_operator
mkdir -p "$(dirname "$OPERATOR_PID")" "$(dirname "$OPERATOR_LOG")"
log "starting the operator (log: $OPERATOR_LOG)"
nohup .venv/bin/disagg-operator run --standalone --liveness http://127.0.0.1:18080/healthz >"$OPERATOR_LOG" 2>&1 &
echo $! >"$OPERATOR_PID"

log "applying $EXAMPLE"
.venv/bin/disagg-operator validate --cluster -f "$EXAMPLE"
kubectl apply --server-side -f "$EXAMPLE"
name="$(.venv/bin/python -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["metadata"]["name"])' "$EXAMPLE")"
log "waiting for $name to be Ready"
if ! kubectl wait --for=condition=Ready --timeout=180s "dm/$name"; then
  kubectl get dm "$name" -o yaml; tail -n 50 "$OPERATOR_LOG"; exit 1
fi
echo
kubectl get dm -o wide
echo
kubectl get deployments,services,pods,poddisruptionbudgets,networkpolicies,serviceaccounts,roles,rolebindings \
  -l "disagg.dev/model=$name" -o wide
echo
# The pods are kwok's (no containers), on loopback IPs: simulated vLLM engines listen on them with the
# identity each pod announces, and the router runs with its rendered arguments and its own ServiceAccount.
log "a streaming completion through the router to simulated engines on the pods' IPs"
router_sa="$(.venv/bin/python -c 'import sys; from disagg_connector import contract; print(contract.router_name(sys.argv[1]))' "$name")"
.venv/bin/python -m disagg_bench.vllm_sim.pods --kubeconfig "$KUBECONFIG" --namespace default --model "$name" \
  --token "$(kubectl create token "$router_sa" --duration=10m)"
echo
# Once it has served. KVTransferHealthy is the operator's last read of the router pods' /health (when they became
# ready, then every 5 minutes): here the router is a local process that ran for the completion above only.
log "the status of $name"
kubectl get dm "$name" -o jsonpath='{range .status.conditions[*]}{.type}={.status} ({.reason}): {.message}{"\n"}{end}'
echo
log "running. Stop with: hack/demo.sh down"
