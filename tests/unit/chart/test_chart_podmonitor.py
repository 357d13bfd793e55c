"""The chart's PodMonitor for the routers (templates/podmonitor-routers.yaml), rendered by the real helm: it selects
exactly the router pods the operator renders (every example's children, through the operator's own render()), on
the port their /metrics is served on, in every namespace models may live in; its selector comes from contract.py
through files/routers.yaml (hack/gen/chart_sync.py). tests/e2e/test_alerts_e2e.py scrapes the routers of a
real model with the scrape config prometheus-operator generates from this same rendering."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_connector import contract
from disagg_operator.api.validation import parse
from disagg_operator.render import render
from hack.gen import chart_sync
from tests.fixtures.helm import CHART, helm, values_args
from hack.gen.prometheus import pod_monitor_scrape_config, run_promtool

from tests.fixtures.models import EXAMPLES, load_example

RELEASE, NAMESPACE = "dop", "disagg-system"


def pod_monitors(tmp_path: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    docs = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args(values, tmp_path)).docs()
    return [d for d in docs if d["kind"] == "PodMonitor"]


def enabled(**monitor: Any) -> dict[str, Any]:
    return {"metrics": {"routerPodMonitor": {"enabled": True, **monitor}}}


def pod_templates(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every pod template a model's children carry: (workload name, template)."""
    out = []
    for obj in objects:
        if obj["kind"] == "Deployment":
            out.append((obj["metadata"]["name"], obj["spec"]["template"]))
        elif obj["kind"] == "LeaderWorkerSet":
            lws = obj["spec"]["leaderWorkerTemplate"]
            out += [(obj["metadata"]["name"], lws[t]) for t in ("leaderTemplate", "workerTemplate") if t in lws]
    return out


def test_off_by_default(tmp_path: Path) -> None:
    assert pod_monitors(tmp_path) == []


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_selects_exactly_the_router_pods_on_their_metrics_port(example: Path, tmp_path: Path) -> None:
    """Of all the pods a model's children make (engines, LeaderWorkerSet groups, GAIE's picker, the router), the
    selector matches the router's alone, and the endpoint's port is the router container's port."""
    (monitor,) = pod_monitors(tmp_path, enabled())
    selector = monitor["spec"]["selector"]
    assert set(selector) == {"matchLabels"} and selector["matchLabels"], selector
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    model = parse(load_example(example))
    templates = pod_templates(render(model).objects)
    assert len(templates) >= 3, "prefill, decode and router at least"

    selected = [name for name, t in templates if selector["matchLabels"].items() <= t["metadata"]["labels"].items()]
    assert selected == [contract.router_name(model.metadata.name)], (selected, [n for n, _ in templates])
    ((_, router),) = [(n, t) for n, t in templates if n == selected[0]]
    (container,) = router["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[endpoint["port"]] == contract.ROUTER_PORT
    assert endpoint["path"] == "/metrics"


def test_one_source_for_the_selector(tmp_path: Path) -> None:
    """The chart reads the generated files/routers.yaml, which is contract.py's labels and port name."""
    (monitor,) = pod_monitors(tmp_path, enabled())
    generated = yaml.safe_load(chart_sync.ROUTERS_FILE.read_text())
    assert generated == chart_sync.router_pods()
    assert monitor["spec"]["selector"]["matchLabels"] == generated["matchLabels"] == {
        contract.LABEL_COMPONENT: "router", contract.LABEL_MANAGED_BY: contract.OPERATOR_NAME}  # fmt: skip
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == generated["port"] == contract.HTTP_PORT_NAME


@pytest.mark.parametrize(("values", "want"), [
    ({}, {"any": True}),  # models live in any namespace
    ({"watchNamespaces": ["team-a", "team-b"]}, {"matchNames": ["team-a", "team-b"]}),  # only where the operator works
    ({"metrics": {"routerPodMonitor": {"namespaceSelector": {"matchNames": ["llm"]}}}}, {"matchNames": ["llm"]}),
    ({"watchNamespaces": ["team-a"], "metrics": {"routerPodMonitor": {"namespaceSelector": {"any": True}}}}, {"any": True}),
], ids=["all", "watched", "explicit", "explicit-over-watched"])  # fmt: skip
def test_namespaces(values: dict[str, Any], want: dict[str, Any], tmp_path: Path) -> None:
    merged = {**values, "metrics": {"routerPodMonitor": {"enabled": True, **values.get("metrics", {}).get("routerPodMonitor", {})}}}
    (monitor,) = pod_monitors(tmp_path, merged)
    assert monitor["spec"]["namespaceSelector"] == want


def test_values_reach_the_object(tmp_path: Path) -> None:
    (monitor,) = pod_monitors(tmp_path, enabled(interval="15s", labels={"release": "kube-prometheus-stack"}))
    assert monitor["metadata"]["name"] == f"{RELEASE}-disagg-operator-routers"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": contract.HTTP_PORT_NAME, "path": "/metrics", "interval": "15s"}]


BAD_VALUES = [
    ("both-any-and-names", {"namespaceSelector": {"any": True, "matchNames": ["a"]}}, "/metrics/routerPodMonitor/namespaceSelector"),
    ("unknown-selector-key", {"namespaceSelector": {"names": ["a"]}}, "/metrics/routerPodMonitor/namespaceSelector"),
    ("bad-namespace", {"namespaceSelector": {"matchNames": ["Team_A"]}}, "/metrics/routerPodMonitor/namespaceSelector/matchNames/0"),
    ("interval-in-words", {"interval": "often"}, "/metrics/routerPodMonitor/interval"),
    ("typo", {"enable": True}, "/metrics/routerPodMonitor"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "monitor", "fragment"), BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_schema_refuses_bad_values(case: str, monitor: dict[str, Any], fragment: str, tmp_path: Path) -> None:
    result = helm("template", RELEASE, str(CHART), *values_args({"metrics": {"routerPodMonitor": monitor}}, tmp_path), check=False)
    message = result.stderr + result.stdout
    assert result.returncode != 0 and "values don't meet the specifications of the schema" in message, (case, message)
    assert fragment in message, (case, message)


def test_the_generated_scrape_config_is_valid_prometheus(tmp_path: Path) -> None:
    """What prometheus-operator makes of the rendered PodMonitor (the e2e's scrape config), judged by promtool."""
    (monitor,) = pod_monitors(tmp_path, enabled())
    (config,) = pod_monitor_scrape_config(monitor)
    keeps = {tuple(r["source_labels"]): r["regex"] for r in config["relabel_configs"] if r.get("action") == "keep"}
    assert keeps == {
        ("__meta_kubernetes_pod_label_app_kubernetes_io_component", "__meta_kubernetes_pod_labelpresent_app_kubernetes_io_component"):
            "(router);true",
        ("__meta_kubernetes_pod_label_app_kubernetes_io_managed_by", "__meta_kubernetes_pod_labelpresent_app_kubernetes_io_managed_by"):
            f"({contract.OPERATOR_NAME});true",
        ("__meta_kubernetes_pod_container_port_name",): contract.HTTP_PORT_NAME,
    }  # fmt: skip
    assert "namespaces" not in config["kubernetes_sd_configs"][0], "any: true is every namespace"
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump({"scrape_configs": [config]}))
    result = run_promtool("check", "config", "--syntax-only", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_fields_it_cannot_translate_are_refused(tmp_path: Path) -> None:
    (monitor,) = pod_monitors(tmp_path, enabled())
    monitor["spec"]["podMetricsEndpoints"][0]["relabelings"] = [{"action": "drop"}]
    with pytest.raises(ValueError, match="relabelings"):
        pod_monitor_scrape_config(monitor)
