"""The real `prometheus` and `promtool` that hack/cluster.sh builds from the github.com/prometheus/prometheus Go
module, for the alert rule tests, the dashboard query checks and the e2e's Prometheus; the `promql` helper
(hack/k8s-tools/promql, Prometheus's own parser at that version) that names the metrics a query selects; and
the names the operator and the router export, from their real registries; and the scrape config
prometheus-operator generates for a PodMonitor (the chart's, for the e2e's Prometheus).

Found at $DISAGG_PROMTOOL / $DISAGG_PROMETHEUS, else $DISAGG_CACHE/bin/<name>-<version>/<name> with the version
of that name's line in hack/cluster.sh's COMPONENTS (the helper: `hack/cluster.sh path promql`). A missing
binary is a test failure that names the command that builds it, never a skip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any, Iterable

import yaml
from disagg_bench.ports import free_port

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "hack" / "cluster.sh"
SETUP = "`bash hack/cluster.sh build` (hack/setup.sh and hack/test.sh run it)"


class PrometheusMissing(RuntimeError):
    pass


def component_version(name: str) -> str:
    """The version hack/cluster.sh builds NAME at (its COMPONENTS line), e.g. v0.316.0 (Prometheus 3.16.0)."""
    match = re.search(rf'^\s*"{re.escape(name)} (v\S+) ', CLUSTER_SH.read_text(), re.MULTILINE)
    if not match:
        raise PrometheusMissing(f"no {name} line in the COMPONENTS of {CLUSTER_SH}")
    return match.group(1)


def _binary(name: str, env: str) -> Path:
    explicit = os.environ.get(env)
    cache_root = Path(os.environ.get("DISAGG_CACHE") or Path.home() / ".cache" / "disagg-operator")
    path = Path(explicit) if explicit else cache_root / "bin" / f"{name}-{component_version(name)}" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise PrometheusMissing(f"{name} not found at {path}: build it with {SETUP}, or point {env} at a {name} binary")
    return path


@cache
def promtool() -> Path:
    return _binary("promtool", "DISAGG_PROMTOOL")


@cache
def prometheus() -> Path:
    return _binary("prometheus", "DISAGG_PROMETHEUS")


def run_promtool(*args: str, cwd: Path | None = None, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """promtool ARGS (in CWD: test files name their rule files relative to it), its output captured and not
    checked: callers assert on the return code with the output."""
    return subprocess.run([str(promtool()), *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=timeout)


@cache
def promql_helper() -> Path:
    """The promql helper's binary; its cache directory carries a hash of its sources, so cluster.sh says where."""
    explicit = os.environ.get("DISAGG_PROMQL")
    path = Path(explicit or subprocess.run(["bash", str(CLUSTER_SH), "path", "promql"], check=True,
                                           capture_output=True, text=True).stdout.strip())  # fmt: skip
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise PrometheusMissing(f"the promql helper is not at {path}: build it with {SETUP}, or point DISAGG_PROMQL at it")
    return path


def selected_metrics(exprs: Iterable[str]) -> list[set[str] | str]:
    """Per expression, the metric names it selects (a set), or the parser's error (a str), by Prometheus's parser."""
    exprs = list(exprs)
    proc = subprocess.run([str(promql_helper())], input="".join(json.dumps(e) + "\n" for e in exprs),
                          capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(answers) == len(exprs), proc.stdout
    return [a["error"] if a.get("error") else set(a["metrics"]) for a in answers]


# A family's sample names in the exposition format, by its type.
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("", "_sum", "_count"), "info": ("_info",)}  # fmt: skip


def exported_metric_names() -> set[str]:
    """Every series name the operator and the router can expose, from their own registries (their scrape-time
    collectors included): a counter family `x` is exposed as `x_total`, a histogram as `x_bucket`, `_sum`, `_count`."""
    from disagg_connector.contract.health import RouterHealth
    from disagg_connector.router.metrics import RouterMetrics
    from disagg_operator.metrics import OperatorMetrics

    operator = OperatorMetrics(workers=1)
    operator.watch(lambda: (0, 0, 0), lambda: {}, lambda: ())
    router = RouterMetrics(lambda: RouterHealth("ok", True, "Push", 60.0, (), {}))
    return {family.name + suffix for registry in (operator.registry, router.registry)
            for family in registry.collect() for suffix in _SUFFIXES[family.type]}  # fmt: skip


def _label_name(name: str) -> str:
    """A Kubernetes label key as Prometheus's service discovery spells it in its meta labels."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


# The parts of a PodMonitor that pod_monitor_scrape_config translates; anything else is refused rather than dropped.
_POD_MONITOR_SPEC = {"namespaceSelector", "selector", "podMetricsEndpoints"}
_POD_METRICS_ENDPOINT = {"port", "path", "interval"}


def pod_monitor_scrape_config(pod_monitor: dict[str, Any], kubeconfig: Path | None = None) -> list[dict[str, Any]]:
    """The scrape configs prometheus-operator generates for POD_MONITOR (one per podMetricsEndpoint, its
    pkg/prometheus/promcfg.go: generatePodMonitorConfig): pods found through the API server (KUBECONFIG's, else
    in-cluster), kept by the selector's labels and the endpoint's port name, labelled namespace, container, pod,
    job <namespace>/<name> and endpoint <port>. Only the fields the chart sets are translated (the operator's
    sharding relabels, an identity with one shard, are left out); any other is a ValueError naming it."""
    meta, spec = pod_monitor["metadata"], pod_monitor["spec"]
    if extra := set(spec) - _POD_MONITOR_SPEC:
        raise ValueError(f"PodMonitor fields not translated: {sorted(extra)}")
    selector = spec.get("selector") or {}
    if set(selector) - {"matchLabels"}:
        raise ValueError(f"PodMonitor selector fields not translated: {sorted(set(selector) - {'matchLabels'})}")
    namespaces = spec.get("namespaceSelector") or {}
    sd: dict[str, Any] = {"role": "pod"}
    if not namespaces.get("any"):
        sd["namespaces"] = {"names": namespaces.get("matchNames") or [meta["namespace"]]}
    if kubeconfig is not None:
        sd["kubeconfig_file"] = str(kubeconfig)
    configs = []
    for index, endpoint in enumerate(spec["podMetricsEndpoints"]):
        if extra := set(endpoint) - _POD_METRICS_ENDPOINT:
            raise ValueError(f"podMetricsEndpoints fields not translated: {sorted(extra)}")
        relabel: list[dict[str, Any]] = [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"},
            *({"source_labels": [f"__meta_kubernetes_pod_label_{_label_name(k)}", f"__meta_kubernetes_pod_labelpresent_{_label_name(k)}"],
               "regex": f"({v});true", "action": "keep"} for k, v in sorted((selector.get("matchLabels") or {}).items())),
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"], "action": "keep"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
            {"target_label": "endpoint", "replacement": endpoint["port"]},
        ]  # fmt: skip
        config = {"job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{index}", "honor_labels": False,
                  "kubernetes_sd_configs": [sd], "metrics_path": endpoint.get("path", "/metrics"), "relabel_configs": relabel}  # fmt: skip
        if "interval" in endpoint:
            config["scrape_interval"] = endpoint["interval"]
        configs.append(config)
    return configs


class PrometheusServer:
    """A real Prometheus (the one hack/cluster.sh builds) on a free loopback port, with CONFIG (a dict: its
    prometheus.yml) and RULES (file name -> rule file dict) written into WORKDIR, its TSDB there too. As a
    context manager: started on enter (ready), stopped on exit."""

    def __init__(self, config: dict[str, Any], workdir: Path, rules: dict[str, dict[str, Any]] | None = None):
        self.workdir, self.port = workdir, free_port()
        self.config = {**config, "rule_files": sorted(rules or {})}
        self.rules = rules or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> "PrometheusServer":
        """Ready (its /-/ready answers 200), or RuntimeError with its log; a failed start leaves no process."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name, doc in self.rules.items():
            (self.workdir / name).write_text(yaml.safe_dump(doc, sort_keys=False))
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(self.config, sort_keys=False))
        argv = [str(prometheus()), "--config.file=prometheus.yml", "--storage.tsdb.path=data",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=info"]  # fmt: skip
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                        if r.status == 200:
                            return self
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"prometheus not ready after {timeout}s:\n{self.log()}")
                time.sleep(0.2)  # polling its readiness endpoint: nothing to wait on instead
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/PATH; its `data`, or AssertionError with Prometheus's error."""
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as r:
            body = json.loads(r.read())
        assert body.get("status") == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector: [{"metric": {...}, "value": [ts, "v"]}, ...]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query's matrix: [{"metric": {...}, "values": [[ts, "v"], ...]}, ...]."""
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step}s")
        assert data["resultType"] == "matrix", data
        return list(data["result"])

    def alerts(self, name: str | None = None) -> list[dict[str, Any]]:
        """Active alerts (state pending or firing), of NAME only if given."""
        return [a for a in self.api("alerts")["alerts"] if name is None or a["labels"].get("alertname") == name]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


