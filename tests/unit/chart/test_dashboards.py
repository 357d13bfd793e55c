"""The Grafana dashboards: generated (never edited), shipped by the chart for Grafana's sidecar, and every
query parsed by the real promtool and naming only metrics the operator and the router export.

The exported names come from the real registries of `OperatorMetrics` and `RouterMetrics`, not a list kept
here: a metric renamed in the code fails this test until the dashboards follow.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_connector.contract.health import RouterHealth
from disagg_connector.router.metrics import RouterMetrics
from disagg_operator.metrics import OperatorMetrics
from hack.gen import dashboards
from tests.fixtures.helm import CHART, helm, values_args

RELEASE, NAMESPACE, KUBE_VERSION = "dop", "disagg-system", "1.34.0"
# Concrete values for the template variables, so that a query is PromQL promtool can parse.
VARIABLES = {
    "${datasource}": "prometheus",
    "$__rate_interval": "5m",
    "$namespace": "inference",
    "$model": "qwen3-32b",
    "$revision": "7f9c2ba4e8",
}


# --- what the components export ------------------------------------------------------------------------
def exported_metric_names() -> set[str]:
    """Every series name the two components can expose, from their own registries: a counter family
    `x` is exposed as `x_total`, a histogram as `x_bucket`, `x_sum` and `x_count`."""
    operator = OperatorMetrics(workers=4)
    operator.watch(lambda: (0, 0, 0), lambda: {"Ready": 1})
    router = RouterMetrics(lambda: RouterHealth("ok", True, "push", 60.0, (), {}))
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count")}  # fmt: skip
    names = set()
    for registry in (operator.registry, router.registry):
        for family in registry.collect():
            names.update(family.name + s for s in suffixes[family.type])
    return names


EXPORTED = exported_metric_names()


# --- what the dashboards query --------------------------------------------------------------------------
load, panels, queries = dashboards.load, dashboards.panels, dashboards.queries


def concrete(expr: str) -> str:
    return dashboards.concrete(expr, VARIABLES)


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS_AND_RANGES = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_NUMBERS = re.compile(r"(?<![A-Za-z0-9_:])[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# A whole word not followed by "(" (no function, no aggregation).
_NAMES = re.compile(r"(?<![A-Za-z0-9_:])[A-Za-z_:][A-Za-z0-9_:]*(?![A-Za-z0-9_:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
             "inf", "nan", "Inf", "NaN"}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label lists, matchers,
    ranges, numbers, functions and keywords are taken out."""
    text = _NUMBERS.sub(" ", _MATCHERS_AND_RANGES.sub(" ", _GROUPING.sub(" ", _STRINGS.sub('""', expr))))
    return {m.group() for m in _NAMES.finditer(text)} - _KEYWORDS


ALL_QUERIES = [q for name in dashboards.DASHBOARDS for q in queries(load(name))]


# --- the files are generated ----------------------------------------------------------------------------
def test_committed_dashboards_are_what_the_generator_makes() -> None:
    assert dashboards.stale() == [], "charts/disagg-operator/dashboards/ is stale: run `python -m hack.gen.dashboards`"
    assert sorted(p.name for p in dashboards.OUT_DIR.glob("*.json")) == sorted(dashboards.DASHBOARDS)


def test_stale_files_are_noticed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dashboards, "OUT_DIR", tmp_path)
    assert dashboards.main([]) == 0
    assert dashboards.stale() == []
    (tmp_path / "disagg-model.json").write_text("{}\n")
    (tmp_path / "hand-made.json").write_text("{}\n")
    assert sorted(p.name for p in dashboards.stale()) == ["disagg-model.json", "hand-made.json"]
    assert dashboards.main(["--check"]) == 1


def test_dashboards_are_what_grafana_loads() -> None:
    uids = set()
    for name in dashboards.DASHBOARDS:
        board = load(name)
        uids.add(board["uid"])
        assert board["schemaVersion"] >= 39 and board["title"].startswith("disagg-operator / ")
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in panels(board)]
        assert len(ids) == len(set(ids)), f"{name}: panel ids repeat"
        for panel in panels(board):
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)) and all(refs), f"{name}: {panel['title']}: refIds {refs}"
    assert uids == {"disagg-model", "disagg-operator"}


def test_model_dashboard_selects_one_model_and_its_revisions() -> None:
    board = load("disagg-model.json")
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "namespace", "model", "revision"]
    revision = board["templating"]["list"][3]
    assert revision["multi"] and revision["includeAll"] and revision["allValue"] == ".*"
    for where, expr in queries(board):
        if where.endswith("variable namespace"):
            continue
        if "disagg_operator_" in expr:  # the operator's own series of the model, from the operator's scrape
            assert dashboards.MODEL in expr, where
            continue
        assert 'namespace="$namespace"' in expr, where
        if "variable" not in where:
            assert f'pod=~"{dashboards.ROUTER_PODS}"' in expr, where
    # The model variable extracts the model from its router pods' names, the filter matches exactly those.
    model_regex = re.compile(board["templating"]["list"][2]["regex"].strip("/"))
    pods = re.compile(dashboards.ROUTER_PODS.replace("$model", "qwen3-32b"))
    for pod, model in [("qwen3-32b-router-7d9f8c6b5-x2x4q", "qwen3-32b"), ("a-router-router-5f4-abcde", "a-router")]:
        assert model_regex.match(pod)[1] == model
    assert pods.fullmatch("qwen3-32b-router-7d9f8c6b5-x2x4q")
    assert not pods.fullmatch("qwen3-32b-router-router-7d9f8c6b5-x2x4q")  # the routers of model "qwen3-32b-router"


def test_model_dashboard_covers_the_router() -> None:
    """The TTFT split, TPOT, E2E, traffic, failures, retries, pairs, weights, in-flight and draining:
    every series the router exports is on the dashboard."""
    used = set().union(*(metric_names(e) for _, e in queries(load("disagg-model.json"))))
    router = {n for n in EXPORTED if n.startswith("disagg_router_")}
    histograms_as_buckets = {n for n in router if not n.endswith(("_sum", "_count"))}
    assert histograms_as_buckets - used == set()


def test_operator_dashboard_covers_the_reconcile_loop() -> None:
    """Reconciles by result, errors, errors by reason, latency, workers, the queue, children applied and
    deleted, models by phase; the model's conditions are on the model's dashboard."""
    used = set().union(*(metric_names(e) for _, e in queries(load("disagg-operator.json"))))
    operator = {n for n in EXPORTED if not n.startswith("disagg_router_") and not n.endswith(("_sum", "_count"))}
    # per model, not for the operator's dashboard: the conditions and the SLO autoscaler's gauges (on the model's
    # dashboard) and the passes (what the e2e counts to know a model was reconciled N times after a restart)
    per_model = {n for n in operator if n.startswith("disagg_operator_autoscaler_")} | {"disagg_operator_model_condition"}
    assert len(per_model) == 6 and operator - used == per_model | {"disagg_operator_model_passes_total"}
    assert per_model <= set().union(*(metric_names(e) for _, e in queries(load("disagg-model.json"))))


# --- every query names only exported metrics, and parses ------------------------------------------------
def test_every_query_names_only_exported_metrics() -> None:
    assert len(ALL_QUERIES) > 30
    for where, expr in ALL_QUERIES:
        names = metric_names(expr)
        assert names, f"{where}: names no metric: {expr}"
        assert names <= EXPORTED, f"{where}: {sorted(names - EXPORTED)} are exported by neither the operator nor the router"


def test_the_name_check_can_fail() -> None:
    assert metric_names('sum by (le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="m"}[5m]))') == {
        "vllm:e2e_request_latency_seconds_bucket"
    }
    expr = 'histogram_quantile(0.95, sum by (le) (rate(disagg_router_ttft_seconds_bucket{pod=~"a-.+"}[5m]))) > bool 1e3'
    assert metric_names(expr) == {"disagg_router_ttft_seconds_bucket"} and not metric_names(expr) <= EXPORTED
    assert {"disagg_router_ready_pairs", "workqueue_adds_total", "controller_runtime_reconcile_time_seconds_bucket"} <= EXPORTED


def promtool_check(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`promtool check rules` on a rules file with each expression as a recording rule's expr."""
    from hack.gen.prometheus import promtool

    rules = [{"record": f"dashboard_query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboards.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}, sort_keys=False))
    return subprocess.run([str(promtool()), "check", "rules", str(path)], capture_output=True, text=True, timeout=120)


def test_every_query_parses_with_promtool(tmp_path: Path) -> None:
    exprs = [concrete(e) for _, e in ALL_QUERIES]
    for (where, _), expr in zip(ALL_QUERIES, exprs, strict=True):
        assert "$" not in expr, f"{where}: a template variable without a test value: {expr}"
    result = promtool_check(exprs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout + result.stderr


def test_promtool_refuses_a_query_that_does_not_parse(tmp_path: Path) -> None:
    result = promtool_check(["sum(rate(disagg_router_requests_total[5m])"], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "SUCCESS" not in output, output
    assert '"dashboard_query_0": could not parse expression' in output and "unclosed left parenthesis" in output, output


# --- the chart ships them ---------------------------------------------------------------------------------
def render(values: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                *values_args(values, tmp_path)).docs()  # fmt: skip


def config_maps(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "ConfigMap"]


def test_chart_ships_no_dashboards_by_default(tmp_path: Path) -> None:
    assert config_maps(render({}, tmp_path)) == []
    assert config_maps(render({"dashboards": {"enabled": False, "folder": "x"}}, tmp_path)) == []


def test_chart_ships_each_dashboard_for_the_grafana_sidecar(tmp_path: Path) -> None:
    maps = config_maps(render({"dashboards": {"enabled": True}}, tmp_path))
    assert sorted(m["metadata"]["name"] for m in maps) == [
        f"{RELEASE}-disagg-operator-dashboard-model", f"{RELEASE}-disagg-operator-dashboard-operator"
    ]
    for cm in maps:
        meta = cm["metadata"]
        assert meta["namespace"] == NAMESPACE
        assert meta["labels"]["grafana_dashboard"] == "1" and meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert meta["annotations"] == {"grafana_folder": "disagg-operator"}
        ((key, text),) = cm["data"].items()
        assert json.loads(text) == load(key), f"{key}: the ConfigMap does not carry the generated file"


def test_chart_dashboard_values(tmp_path: Path) -> None:
    values = {"dashboards": {
        "enabled": True, "namespace": "monitoring", "label": "grafana.example.com/dashboard", "labelValue": "disagg",
        "folderAnnotation": "grafana.example.com/folder", "folder": "LLM serving", "labels": {"team": "ml"},
        "annotations": {"owner": "ml-platform"},
    }}  # fmt: skip
    maps = config_maps(render(values, tmp_path))
    assert len(maps) == len(dashboards.DASHBOARDS)
    for cm in maps:
        meta = cm["metadata"]
        assert meta["namespace"] == "monitoring"
        assert meta["labels"]["grafana.example.com/dashboard"] == "disagg" and meta["labels"]["team"] == "ml"
        assert "grafana_dashboard" not in meta["labels"]
        assert meta["annotations"] == {"grafana.example.com/folder": "LLM serving", "owner": "ml-platform"}
    no_folder = config_maps(render({"dashboards": {"enabled": True, "folder": ""}}, tmp_path))
    assert all("annotations" not in cm["metadata"] for cm in no_folder)


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"enabled": True, "labelValue": 1}, "/dashboards/labelValue"),
        ({"enabled": True, "label": "has space"}, "/dashboards/label"),
        ({"enabled": True, "namespace": "Monitoring"}, "/dashboards/namespace"),
        ({"enabled": True, "folders": "x"}, "additional properties 'folders' not allowed"),
    ],
    ids=["label-value-not-a-string", "bad-label-key", "bad-namespace", "unknown-key"],
)
def test_schema_refuses_bad_dashboard_values(values: dict[str, Any], fragment: str, tmp_path: Path) -> None:
    result = helm("template", RELEASE, str(CHART), *values_args({"dashboards": values}, tmp_path), check=False)
    assert result.returncode != 0 and fragment in result.stderr, result.stderr
