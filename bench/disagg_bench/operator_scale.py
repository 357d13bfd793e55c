"""Operator at scale on the local control plane: N DisaggregatedModels at once, against a baseline.

    python -m disagg_bench.operator_scale [--sizes 50,200] [--runs 3]

For each N, `--runs` times each, medians printed:
- the operator (a separate process, its own ServiceAccount token bound to the ClusterRole of
  disagg_operator.rbac) reconciles N models created at once;
- the baseline, measured in the same run on the same cluster: the rendered manifests of the same N models
  applied directly with `kubectl apply --server-side` (by its own ServiceAccount).
Both are timed the same way: until every child exists and every Deployment is fully ready. For the
operator the program also prints when every model's status says Ready, the API requests per model while
creating (from the API server's audit log, reads and watches included), the requests per model during a
steady-state resync of every model (the operator runs with --resync-seconds 20 and the window holds one
resync, and the passes in it are counted from the operator's own controller_runtime_reconcile_total; the
goal: at most 2 reads and no write per model), and the operator's peak RSS.

Fake capacity is added for the run (kwok p5en and CPU nodes labelled disagg.dev/bench) and removed after.
A program, not a test: it prints figures, it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families

from disagg_connector import contract
from disagg_operator.api.validation import parse
from disagg_operator.manifests import dump_all
from disagg_operator.rbac import cluster_role
from disagg_operator.render import render
from disagg_bench.operator_process import OperatorProcess, default_command

REPO = Path(__file__).resolve().parents[2]
BENCH_NS = "disagg-bench"
BENCH_LABEL = f"{contract.API_GROUP}/bench"
PODS_PER_NODE = 4  # hugepages-2Mi: 21Gi per node, 5120Mi per EFA pod
OPERATOR_USER = f"system:serviceaccount:{BENCH_NS}:operator"
STEADY_RESYNC_SECONDS = 20


def sh(*args: str, **kw: Any) -> str:
    return subprocess.run(list(args), check=True, capture_output=True, text=True, **kw).stdout


def cluster_env() -> dict[str, str]:
    out = sh("bash", str(REPO / "hack/cluster.sh"), "env")
    return dict(line[len("export "):].split("=", 1) for line in out.splitlines() if line.startswith("export "))


class Bench:
    def __init__(self) -> None:
        sh("bash", str(REPO / "hack/cluster.sh"), "up")
        env = cluster_env()
        self.kubeconfig = env["KUBECONFIG"]
        self.audit_log = Path(env["DISAGG_AUDIT_LOG"])
        self.kubectl_bin = str(Path(env["PATH"].split(":")[0]) / "kubectl")
        config.load_kube_config(config_file=self.kubeconfig)
        self.core = client.CoreV1Api()
        self.apps = client.AppsV1Api()
        self.custom = client.CustomObjectsApi()
        self.workdir = Path(tempfile.mkdtemp(prefix="disagg-bench-"))

    def kubectl(self, *args: str, kubeconfig: str | None = None) -> str:
        return sh(self.kubectl_bin, f"--kubeconfig={kubeconfig or self.kubeconfig}", *args)

    # --- identities and capacity ---------------------------------------------------------------------
    def token_kubeconfig(self, sa: str, role: dict[str, Any]) -> str:
        """A kubeconfig with only a token of `sa` in BENCH_NS bound to `role` (the audit log's
        policy logs every request of that namespace's ServiceAccounts, reads included)."""
        role = {**role, "metadata": {**role["metadata"], "name": f"bench-{sa}"}}
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": f"bench-{sa}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"bench-{sa}"},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": BENCH_NS}],
        }  # fmt: skip
        objs = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": BENCH_NS}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": BENCH_NS}},
            role, binding,
        ]  # fmt: skip
        path = self.workdir / f"{sa}-rbac.yaml"
        path.write_text(yaml.safe_dump_all(objs))
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        token = self.kubectl("create", "token", sa, "-n", BENCH_NS, "--duration=2h").strip()
        admin = yaml.safe_load(Path(self.kubeconfig).read_text())
        out = self.workdir / f"{sa}.kubeconfig"
        out.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": admin["clusters"][0]["cluster"]}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        }))  # fmt: skip
        return str(out)

    def add_capacity(self, models: int) -> None:
        template = next(n for n in yaml.safe_load_all((REPO / "hack/nodes/p5en.yaml").read_text()) if n)
        cpu_template = next(n for n in yaml.safe_load_all((REPO / "hack/nodes/cpu.yaml").read_text()) if n)
        gpu_nodes = 2 * math.ceil(2 * models * 1.15 / PODS_PER_NODE / 2)
        nodes = []
        for i in range(gpu_nodes):
            node = copy.deepcopy(template)
            self._rename(node, f"bench-p5en-{i}", f"127.{100 + i // 250}.{i % 250}.0/24")
            node["metadata"]["labels"]["topology.kubernetes.io/zone"] = "us-west-2a" if i % 2 else "us-west-2b"
            nodes.append(node)
        for i in range(math.ceil(models / 100) + 1):
            node = copy.deepcopy(cpu_template)
            self._rename(node, f"bench-cpu-{i}", f"127.99.{i}.0/24")
            nodes.append(node)
        path = self.workdir / "nodes.yaml"
        path.write_text(yaml.safe_dump_all(nodes))
        self.kubectl("apply", "-f", str(path))

    @staticmethod
    def _rename(node: dict[str, Any], name: str, cidr: str) -> None:
        node["metadata"]["name"] = name
        node["metadata"]["labels"]["kubernetes.io/hostname"] = name
        node["metadata"]["labels"][BENCH_LABEL] = "true"
        node["spec"]["podCIDR"], node["spec"]["podCIDRs"] = cidr, [cidr]
        for address in node["status"].get("addresses", []):
            address["address"] = name if address["type"] == "Hostname" else cidr.rsplit(".", 1)[0] + ".254"

    def remove_capacity(self) -> None:
        self.kubectl("delete", "nodes", "-l", f"{BENCH_LABEL}=true", "--wait=false")

    # --- measurements --------------------------------------------------------------------------------
    def requests_by(self, username: str, since: str) -> dict[str, int]:
        counts = {"read": 0, "watch": 0, "write": 0}
        with self.audit_log.open() as f:
            for line in f:
                event = json.loads(line)
                if event.get("stage") != "ResponseComplete" or event["requestReceivedTimestamp"] < since:
                    continue
                if (event.get("user") or {}).get("username") != username:
                    continue
                verb = event["verb"]
                counts["watch" if verb == "watch" else "read" if verb in ("get", "list") else "write"] += 1
        return counts

    def fresh_namespace(self, name: str) -> None:
        self.delete_namespace(name)
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

    def delete_namespace(self, name: str) -> None:
        try:
            self.core.delete_namespace(name)
        except client.ApiException as error:
            if error.status == 404:
                return
            raise
        while True:
            try:
                self.core.read_namespace(name)
            except client.ApiException as error:
                if error.status == 404:
                    return
            time.sleep(1)

    def wait(self, what: str, done: Any, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if done():
                return time.monotonic()
            time.sleep(0.5)
        raise TimeoutError(f"{what} not reached in {timeout:.0f} s")

    def deployments_ready(self, ns: str, expected: int) -> bool:
        items = self.apps.list_namespaced_deployment(ns).items
        return len(items) == expected and all(
            (d.status.ready_replicas or 0) == (d.spec.replicas or 0) for d in items
        )

    def children_exist(self, ns: str, expected_deployments: int, expected_services: int) -> bool:
        return (
            len(self.apps.list_namespaced_deployment(ns).items) == expected_deployments
            and len(self.core.list_namespaced_service(ns).items) == expected_services
        )

    # --- runs ----------------------------------------------------------------------------------------
    def models(self, n: int) -> list[dict[str, Any]]:
        (example,) = [d for d in yaml.safe_load_all((REPO / "examples/minimal.yaml").read_text()) if d]
        return [{**copy.deepcopy(example), "metadata": {"name": f"m{i:03d}"}} for i in range(n)]

    def run_operator(self, n: int, kubeconfig: str) -> dict[str, Any]:
        ns = f"bench-op-{n}"
        self.fresh_namespace(ns)
        proc = OperatorProcess(kubeconfig, self.workdir,
                               command=functools.partial(default_command, resync_seconds=STEADY_RESYNC_SECONDS))
        proc.start()
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        t0 = time.monotonic()
        for obj in self.models(n):
            self.custom.create_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, ns, contract.PLURAL, obj)
        t_children = self.wait("children", lambda: self.children_exist(ns, 3 * n, 3 * n), 900)
        t_ready = self.wait("all Deployments ready", lambda: self.deployments_ready(ns, 3 * n), 1800)

        def all_ready() -> bool:
            items = self.custom.list_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, ns, contract.PLURAL)["items"]
            return len(items) == n and all(
                any(c["type"] == "Ready" and c["status"] == "True" for c in (i.get("status") or {}).get("conditions", []))
                for i in items
            )

        t_status = self.wait("all Ready in status", all_ready, 1800)
        time.sleep(5)
        creating = self.requests_by(OPERATOR_USER, since)
        # Steady state: nothing changes; the window holds one resync of every model.
        quiet = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        passes_before = _reconcile_passes(proc.metrics_port)
        time.sleep(STEADY_RESYNC_SECONDS + 5)
        steady = self.requests_by(OPERATOR_USER, quiet)
        # The passes the operator ran in the window (the proof that the window held a resync of every model).
        steady["passes"] = _reconcile_passes(proc.metrics_port) - passes_before
        rss = _peak_rss_kib(proc)
        proc.stop()
        self.delete_namespace(ns)
        return {"children_s": t_children - t0, "ready_s": t_ready - t0, "status_ready_s": t_status - t0,
                "requests": creating, "steady": steady, "peak_rss_mib": rss / 1024}  # fmt: skip

    def run_baseline(self, n: int, kubeconfig: str) -> dict[str, Any]:
        ns = f"bench-base-{n}"
        self.fresh_namespace(ns)
        objects = []
        for obj in self.models(n):
            obj["metadata"]["namespace"] = ns
            objects += render(parse(obj)).objects
        path = self.workdir / f"baseline-{n}.yaml"
        path.write_text(dump_all(objects))
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        t0 = time.monotonic()
        self.kubectl("apply", "--server-side", "-f", str(path), kubeconfig=kubeconfig)
        t_children = self.wait("children", lambda: self.children_exist(ns, 3 * n, 3 * n), 900)
        t_ready = self.wait("all Deployments ready", lambda: self.deployments_ready(ns, 3 * n), 1800)
        time.sleep(2)
        requests = self.requests_by(f"system:serviceaccount:{BENCH_NS}:baseline", since)
        self.delete_namespace(ns)
        return {"children_s": t_children - t0, "ready_s": t_ready - t0, "requests": requests}


def _reconcile_passes(metrics_port: int) -> int:
    """controller_runtime_reconcile_total over every result, from the operator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == "controller_runtime_reconcile" for sample in family.samples
                   if sample.name == "controller_runtime_reconcile_total"))  # fmt: skip


def _peak_rss_kib(proc: OperatorProcess) -> int:
    assert proc.proc is not None
    for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _per_model(runs: list[dict[str, Any]], key: str, n: int, keys: tuple[str, ...] = ("read", "watch", "write")) -> str:
    return "/".join(f"{statistics.median(r[key][k] for r in runs) / n:.1f}" for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,200")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    bench = Bench()
    bench.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    operator_kc = bench.token_kubeconfig("operator", cluster_role())
    baseline_kc = bench.token_kubeconfig("baseline", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "x"},
        "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}],
    })  # fmt: skip
    bench.add_capacity(max(sizes))
    rows = []
    try:
        for n in sizes:
            ops, bases = [], []
            for run in range(args.runs):  # interleaved, so drift of the machine hits both alike
                bases.append(bench.run_baseline(n, baseline_kc))
                ops.append(bench.run_operator(n, operator_kc))
                print(f"N={n} run {run + 1}: operator {json.dumps(ops[-1])}; baseline {json.dumps(bases[-1])}", flush=True)
            rows.append((n, ops, bases))
    finally:
        bench.remove_capacity()
        sh("bash", str(REPO / "hack/cluster.sh"), "down")  # the program brought it up
    print()
    print(f"Medians of {args.runs} runs per cell.")
    print()
    print("| N | path | all children exist (s) | all children exist and Ready (s) | status Ready (s) | "
          "requests per model while creating (read/watch/write) | per model in a steady resync window "
          "(passes; read/watch/write) | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, ops, bases in rows:
        print(f"| {n} | operator | {_median(ops, 'children_s'):.1f} | {_median(ops, 'ready_s'):.1f} | "
              f"{_median(ops, 'status_ready_s'):.1f} | {_per_model(ops, 'requests', n)} | {_per_model(ops, 'steady', n, ('passes',))}; {_per_model(ops, 'steady', n)} | "
              f"{_median(ops, 'peak_rss_mib'):.0f} |")
        print(f"| {n} | kubectl apply (baseline) | {_median(bases, 'children_s'):.1f} | {_median(bases, 'ready_s'):.1f} | - | "
              f"{_per_model(bases, 'requests', n)} | - | - |")
        print(f"| {n} | operator / baseline | {_median(ops, 'children_s') / max(_median(bases, 'children_s'), 1e-9):.2f}x | "
              f"{_median(ops, 'ready_s') / max(_median(bases, 'ready_s'), 1e-9):.2f}x | | | | |")


if __name__ == "__main__":
    main()
