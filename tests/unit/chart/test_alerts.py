"""The chart's alerts (templates/prometheusrule.yaml), judged by the real promtool and Prometheus's own parser.

The PrometheusRule is rendered by the real helm with `alerts.enabled` and otherwise default values (what a user
gets), its groups written out as a rule file, and then: `promtool check rules`; `promtool test rules` with the unit
tests in tests/promtool/ (kept beside this module rather than in the chart: they are tests, not something the
chart should package), which must show every alert both firing and not firing; every metric a rule selects is one
the operator or the router exports (names from their real registries) or one the rules record; the failure causes
the KV alerts match are the contract's categories; every alert has its runbook in docs/alerts.md.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_connector import contract
from disagg_connector.contract.health import CAUSES, DEADLINE, PROTOCOL, TRANSFER
from disagg_connector.router.migration import MIGRATED, OUTCOMES, UNCUT
from tests.fixtures.helm import CHART, REPO, helm, values_args
from hack.gen.prometheus import exported_metric_names, run_promtool, selected_metrics

PROMTOOL_TESTS = REPO / "tests" / "promtool"
RUNBOOKS = REPO / "docs" / "alerts.md"
RELEASE, NAMESPACE, KUBE_VERSION = "dop", "disagg-system", "1.34.0"


def render(values: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                  *values_args(values, tmp_path))  # fmt: skip
    return [d for d in result.docs() if d["kind"] == "PrometheusRule"]


def rules_of(values: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    (rule,) = render({"alerts": {"enabled": True, **values}}, tmp_path)
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rules.yaml (the chart's groups, as Prometheus loads a rule file) beside copies of the promtool tests."""
    d = tmp_path_factory.mktemp("alerts")
    (rule,) = render({"alerts": {"enabled": True}}, d)
    (d / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    for f in PROMTOOL_TESTS.glob("*.yaml"):
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def rules(workdir: Path) -> list[dict[str, Any]]:
    return [r for group in yaml.safe_load((workdir / "rules.yaml").read_text())["groups"] for r in group["rules"]]


def alert_names(rules: list[dict[str, Any]]) -> list[str]:
    return [r["alert"] for r in rules if "alert" in r]


def promtool_tests() -> list[tuple[str, dict[str, Any]]]:
    """(file, test group) of every promtool unit test."""
    files = sorted(PROMTOOL_TESTS.glob("*.yaml"))
    assert files, f"no promtool tests in {PROMTOOL_TESTS}"
    return [(f.name, group) for f in files for group in yaml.safe_load(f.read_text())["tests"]]


# --- promtool ---------------------------------------------------------------------------------------------
def test_promtool_checks_the_rules(workdir: Path, rules: list[dict[str, Any]]) -> None:
    result = run_promtool("check", "rules", str(workdir / "rules.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout, result.stdout


def test_promtool_unit_tests_pass(workdir: Path) -> None:
    files = sorted(f.name for f in PROMTOOL_TESTS.glob("*.yaml"))
    result = run_promtool("test", "rules", *files, cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(files), result.stdout


def test_every_alert_is_tested_firing_and_not_firing(rules: list[dict[str, Any]]) -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for name, group in promtool_tests():
        assert group["input_series"], f"{name}: {group.get('name')}: no input"
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = set(alert_names(rules))
    assert firing | quiet <= alerts, f"tests of alerts the chart does not have: {sorted((firing | quiet) - alerts)}"
    assert not alerts - firing, f"never shown firing: {sorted(alerts - firing)}"
    assert not alerts - quiet, f"never shown not firing: {sorted(alerts - quiet)}"


def test_a_broken_threshold_fails_the_promtool_tests(workdir: Path, tmp_path: Path) -> None:
    """The unit tests see the rules' numbers: the KV alert at a 50% bound no longer fires where they expect it."""
    for f in workdir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    doc = yaml.safe_load((tmp_path / "rules.yaml").read_text())
    (kv,) = [r for g in doc["groups"] for r in g["rules"] if r.get("alert") == "DisaggKVTransfersFailing"]
    assert kv["expr"].endswith("> 0.05"), "the default bound"
    kv["expr"] = kv["expr"].removesuffix("> 0.05") + "> 0.5"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = run_promtool("test", "rules", "kv.yaml", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "alertname: DisaggKVTransfersFailing, time: 12m" in output, output


# --- what the rules read ----------------------------------------------------------------------------------
def test_rules_select_only_exported_or_recorded_metrics(rules: list[dict[str, Any]]) -> None:
    exported = exported_metric_names()
    recorded = {r["record"] for r in rules if "record" in r}
    assert recorded.isdisjoint(exported)
    names = [r.get("alert") or r["record"] for r in rules]
    for name, found in zip(names, selected_metrics(r["expr"] for r in rules), strict=True):
        assert isinstance(found, set), f"{name}: {found}"
        assert found, f"{name} selects no metric"
        unknown = found - exported - recorded
        assert not unknown, f"{name} reads {sorted(unknown)}, which neither the components export nor a rule records"


def test_the_names_come_from_the_registries() -> None:
    """A metric the code does not export is not in the set (so the test above can fail)."""
    exported = exported_metric_names()
    assert {"disagg_router_failures_total", "disagg_router_prefill_seconds_count", "workqueue_depth",
            "controller_runtime_reconcile_errors_total", "disagg_operator_model_condition"} <= exported  # fmt: skip
    assert "disagg_router_failures" not in exported and "disagg_router_kv_transfer_failures_total" not in exported
    assert selected_metrics(['sum(rate(disagg_router_kv_transfer_failures_total[5m])) > 0', "rate(x[5m]"]) == [
        {"disagg_router_kv_transfer_failures_total"}, "1:11: parse error: unclosed left parenthesis"]


def _causes(rules: list[dict[str, Any]], record: str) -> set[str]:
    (rule,) = [r for r in rules if r.get("record") == record]
    (match,) = re.findall(r'cause=~"([^"]+)"', rule["expr"])
    return set(match.split("|"))


def test_kv_alerts_match_the_contract_categories(rules: list[dict[str, Any]]) -> None:
    by = lambda *cats: {c for c, cat in CAUSES.items() if cat in cats}  # noqa: E731
    assert _causes(rules, "namespace_model_revision:disagg_router_transfer_failures:rate5m") == by(TRANSFER, PROTOCOL)
    assert _causes(rules, "namespace_model_revision:disagg_router_deadline_failures:rate5m") == by(DEADLINE)


def test_cut_streams_are_the_outcomes_the_router_counts(rules: list[dict[str, Any]]) -> None:
    """DisaggStreamsCut counts every outcome of disagg_router_migrations_total but the router's UNCUT ones as a cut
    stream (a renamed outcome would make every migrated stream a cut one), and the runbook says what each means."""
    outcomes = set(OUTCOMES)
    (rule,) = [r for r in rules if r.get("record") == "namespace_model:disagg_router_cut_streams:rate5m"]
    (match,) = re.findall(r'outcome!~"([^"]+)"', rule["expr"])
    assert set(match.split("|")) == set(UNCUT)
    (migrated,) = [r for r in rules if r.get("record") == "namespace_model:disagg_router_migrated_streams:rate5m"]
    assert f'outcome="{MIGRATED}"' in migrated["expr"]
    runbook = RUNBOOKS.read_text()
    undocumented = [o for o in outcomes if f"| `{o}` |" not in runbook]
    assert not undocumented, f"docs/alerts.md, DisaggStreamsCut: no row for the outcomes {undocumented}"


def test_the_model_label_comes_from_the_router_pod_name(rules: list[dict[str, Any]]) -> None:
    """Router pods are the Deployment <model>-router's: <model>-router-<template hash>-<suffix>."""
    patterns = {m for r in rules for m in re.findall(r'"model", "\$1", "pod", "([^"]+)"', r["expr"])}
    (pattern,) = patterns
    for model in ("qwen3-32b", "m", "a-router-b"):
        pod = f"{contract.router_name(model)}-7c9d8f6b5-x2x4z"
        match = re.fullmatch(pattern, pod)  # Prometheus anchors label_replace's regex
        assert match and match.group(1) == model, (pod, pattern)
    assert not re.fullmatch(pattern, "qwen3-32b-decode-r1-7c9d8f6b5-x2x4z")


# --- values and docs --------------------------------------------------------------------------------------
def test_off_by_default(tmp_path: Path) -> None:
    assert render({}, tmp_path) == []


def test_values_shape_the_rules(tmp_path: Path) -> None:
    values = {
        "labels": {"release": "kube-prometheus-stack"},
        "disabled": ["DisaggRouterQueueing"],
        "runbookBaseUrl": "https://wiki.example.com/llm/alerts",
        "kvTransfersFailing": {"ratio": 0.2, "for": "10m", "severity": "page"},
        "engineDrainingTooLong": {"for": "3h"},
        "rateWindow": "2m",
    }
    (rule,) = render({"alerts": {"enabled": True, **values}}, tmp_path)
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert all(r["record"].endswith(":rate2m") for r in rules if "record" in r)
    ranges = {m for r in rules for m in re.findall(r"\[(\w+)\]", r["expr"])}
    assert ranges == {"2m"}, ranges
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert "DisaggRouterQueueing" not in alerts and len(alerts) == 11
    kv = alerts["DisaggKVTransfersFailing"]
    assert kv["expr"].endswith("> 0.2") and kv["for"] == "10m" and kv["labels"] == {"severity": "page"}
    drain = alerts["DisaggEngineDrainingTooLong"]
    assert drain["for"] == "3h" and drain["labels"] == {"severity": "warning"}, "a partial block keeps the other defaults"
    assert all(a["annotations"]["runbook_url"] == f"https://wiki.example.com/llm/alerts#{n.lower()}" for n, a in alerts.items())


BAD = [
    ("ratio-above-one", {"kvTransfersFailing": {"ratio": 2}}, "/alerts/kvTransfersFailing/ratio"),
    ("for-in-words", {"rolloutStuck": {"for": "two hours"}}, "/alerts/rolloutStuck/for"),
    ("unknown-alert-disabled", {"disabled": ["DisaggEverything"]}, "/alerts/disabled/0"),
    ("typo", {"noReadyPairs": {"for": "5m"}}, "noReadyPairs"),
    ("negative-depth", {"workQueueBacklog": {"depth": -1}}, "/alerts/workQueueBacklog/depth"),
]


@pytest.mark.parametrize(("case", "values", "fragment"), BAD, ids=[b[0] for b in BAD])
def test_schema_refuses_bad_alert_values(case: str, values: dict[str, Any], fragment: str, tmp_path: Path) -> None:
    result = helm("template", RELEASE, str(CHART), *values_args({"alerts": {"enabled": True, **values}}, tmp_path), check=False)
    message = result.stderr + result.stdout
    assert result.returncode != 0 and "values don't meet the specifications of the schema" in message, message
    assert fragment in message, f"{case}: {fragment!r} not in:\n{message}"


def test_every_alert_has_its_runbook(rules: list[dict[str, Any]]) -> None:
    sections = re.findall(r"^## (\S+)$", RUNBOOKS.read_text(), re.MULTILINE)
    alerts = alert_names(rules)
    assert sorted(sections) == sorted(alerts), "docs/alerts.md has one '## <alert>' section per alert"
    for r in rules:
        if "alert" in r:
            assert r["annotations"]["runbook_url"].endswith("docs/alerts.md#" + r["alert"].lower())
            assert {"summary", "description", "runbook_url"} <= set(r["annotations"]), r["alert"]
            assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]


def test_a_missing_promtool_fails_naming_the_setup_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hack.gen import prometheus

    monkeypatch.setenv("DISAGG_PROMTOOL", str(tmp_path / "promtool"))
    with pytest.raises(prometheus.PrometheusMissing, match=r"bash hack/cluster.sh build"):
        prometheus._binary("promtool", "DISAGG_PROMTOOL")
