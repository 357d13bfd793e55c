"""The Grafana dashboards the chart ships, built with grafana-foundation-sdk (never JSON by hand).

    python -m hack.gen.dashboards          # write charts/disagg-operator/dashboards/*.json
    python -m hack.gen.dashboards --check  # exit 1 and name the stale files (tests/unit/chart/test_dashboards.py does this)

Two dashboards, each a file the chart puts into a ConfigMap for Grafana's sidecar (`dashboards.enabled`):
- ``disagg-model.json``: one DisaggregatedModel, per revision: its conditions, the TTFT split (prefill leg, KV
  wait, first token), TPOT, E2E, request rate and failures by cause, retries, stream migrations by outcome and
  the gap they add, ready pairs, traffic weights, in-flight, draining and ejected backends, the router's
  discovery. Routing decisions and the prefix cache hit rate (issue 19) get a row of their own when their
  metrics exist: the place is marked in model_dashboard().
- ``disagg-operator.json``: the operator's reconcile view in controller-runtime's names: reconciles by result,
  errors and errors by reason, latency, active workers, the work queue, children applied and deleted,
  models by phase.

Every query names only metrics that disagg_operator.metrics and disagg_connector.router.metrics export
(tests/unit/chart/test_dashboards.py collects them from the real registries and parses every query with promtool).
The router's series are told apart by the standard target labels of a Kubernetes scrape, ``namespace`` and
``pod`` (what kube-prometheus-stack's ServiceMonitor and PodMonitor attach, and the usual kubernetes_sd
relabelling): a model's routers are the pods of its Deployment ``<model>-router``. The exported ``pod`` of
the per-backend gauges (the engine's pod) becomes ``exported_pod`` under that scrape, so panels name engines
by ``backend`` (the pod, or ``pod#dpN`` for one data-parallel rank) instead.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.common import StackingConfig, VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from disagg_operator.metrics import CONTROLLER  # the controller / work queue name label
from hack.gen import generated

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "charts" / "disagg-operator" / "dashboards"
TAGS = ["disagg-operator"]
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
QUANTILES = (0.5, 0.95, 0.99)

# A model's routers: the pods of its Deployment `<model>-router` (`<deployment>-<template hash>-<suffix>`).
ROUTER_PODS = '$model-router-[a-z0-9]+-[a-z0-9]+'
MODEL_FROM_POD = r"/^(.+)-router-[a-z0-9]+-[a-z0-9]+$/"
ROUTER = f'namespace="$namespace", pod=~"{ROUTER_PODS}"'
ROUTER_REV = f'{ROUTER}, revision=~"$revision"'
OPERATOR = 'namespace=~"$namespace"'
# The operator's per-model series name the model by labels of their own (its target namespace is the operator's).
MODEL = 'model_namespace="$namespace", model="$model"'


# --- pieces ---------------------------------------------------------------------------------------------
def query(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)


def series(title: str, description: str, unit: str, *targets: prometheus.Dataquery, stacked: bool = False,
           width: int = 12, height: int = 8) -> timeseries.Panel:  # fmt: skip
    panel = (
        timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
        .span(width).height(height).min(0).fill_opacity(10 if not stacked else 40).line_width(1)
        .legend(VizLegendOptions().display_mode(LegendDisplayMode.TABLE).placement(LegendPlacement.BOTTOM)
                .show_legend(True).calcs(["mean", "max", "lastNotNull"]))
    )  # fmt: skip
    if stacked:
        panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL))
    for ref, t in zip("ABCDEFGH", targets, strict=False):
        panel = panel.with_target(t.ref_id(ref))
    return panel


def single(title: str, description: str, unit: str, target: prometheus.Dataquery, width: int = 6) -> stat.Panel:
    return (
        stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
        .span(width).height(4).with_target(target.ref_id("A"))
    )  # fmt: skip


def rate(metric: str, selector: str) -> str:
    return f"rate({metric}{{{selector}}}[$__rate_interval])"


def ratio(counter: str, part: str, whole: str) -> str:
    """The share of a counter's rate that matches ``part`` among what matches ``whole``: 0, not "No data", while
    nothing matches ``part`` (its series appear with their first increment)."""
    return f"(sum({rate(counter, part)}) or vector(0))\n/\nsum({rate(counter, whole)})"


def quantiles(histogram: str, selector: str, by: str = "") -> list[prometheus.Dataquery]:
    """p50/p95/p99 of a histogram, summed over the router replicas (by ``by`` as well)."""
    group = f"le, {by}" if by else "le"
    out = []
    for q in QUANTILES:
        legend = f"p{int(q * 100)}" + (f" {{{{{by}}}}}" if by else "")
        expr = f"histogram_quantile({q}, sum by ({group}) ({rate(histogram + '_bucket', selector)}))"
        out.append(query(expr, legend))
    return out


def mean(histogram: str, selector: str, legend: str, by: str = "") -> prometheus.Dataquery:
    group = f" by ({by})" if by else ""
    expr = (f"sum{group} ({rate(histogram + '_sum', selector)})\n"
            f"/\nsum{group} ({rate(histogram + '_count', selector)})")  # fmt: skip
    return query(expr, legend)


def datasource_variable() -> gd.DatasourceVariable:
    return gd.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(name: str, label: str, expr: str, *, regex: str = "", multi: bool = False) -> gd.QueryVariable:
    v = (
        gd.QueryVariable(name).label(label).query(expr).datasource(DATASOURCE)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
    )  # fmt: skip
    if regex:
        v = v.regex(regex)
    if multi:
        v = v.multi(True).include_all(True).all_value(".*")
    return v


def base(title: str, uid: str, description: str) -> gd.Dashboard:
    return (
        gd.Dashboard(title).uid(uid).description(description).tags(TAGS).editable()
        .refresh("30s").time("now-1h", "now").timezone("browser").tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(datasource_variable())
    )  # fmt: skip


# --- the model ------------------------------------------------------------------------------------------
def model_dashboard() -> gd.Dashboard:
    d = (
        base("disagg-operator / Model", "disagg-model",
             "One DisaggregatedModel as its routers see it: the TTFT split, TPOT, E2E, traffic and failures per "
             "revision, ready pairs and the backends behind them.")
        .with_variable(query_variable("namespace", "Namespace", "label_values(disagg_router_ready_pairs, namespace)"))
        .with_variable(query_variable("model", "Model",
                                      'label_values(disagg_router_ready_pairs{namespace="$namespace"}, pod)',
                                      regex=MODEL_FROM_POD))
        .with_variable(query_variable("revision", "Revision",
                                      f"label_values(disagg_router_ready_pairs{{{ROUTER}}}, revision)", multi=True))
    )  # fmt: skip

    d = d.with_row(gd.Row("Overview"))
    d = d.with_panel(single("Ready pairs", "Usable prefill/decode pairs of the selected revisions (as the routers see them).",
                            "none", query(f"sum(max by (revision) (disagg_router_ready_pairs{{{ROUTER_REV}}}))", "ready pairs")))
    d = d.with_panel(single("Requests", "Client requests per second.", "reqps",
                            query(f"sum({rate('disagg_router_requests_total', ROUTER_REV)})", "requests/s")))
    d = d.with_panel(single("Failed answers", "Share of requests answered with a status other than 2xx.", "percentunit",
                            query(ratio("disagg_router_requests_total", ROUTER_REV + ', code!~"2.."', ROUTER_REV), "failed")))
    d = d.with_panel(single("Not disaggregated", "Share of requests served by decode alone (mode local: prompts below the "
                            "router's disaggregation threshold).", "percentunit",
                            query(ratio("disagg_router_requests_total", ROUTER_REV + ', mode="local"', ROUTER_REV), "local")))  # fmt: skip

    d = d.with_panel(
        table.Panel().title("Conditions").datasource(DATASOURCE).span(24).height(6)
        .description("The model's status conditions as the operator last wrote them (docs/reasons.md says what each "
                     "reason asks of you).")
        .with_target(query(f"max by (type, status, reason) (disagg_operator_model_condition{{{MODEL}}})", "")
                     .instant().format(PromQueryFormat.TABLE).ref_id("A"))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {"Time": True, "Value": True},
            "indexByName": {"type": 0, "status": 1, "reason": 2},
            "renameByName": {"type": "condition"},
        }))
    )  # fmt: skip

    d = d.with_row(gd.Row("Time to first token: the split"))
    d = d.with_panel(series(
        "TTFT split (mean)",
        "Mean of each part, per transfer mode: the prefill leg (dispatch to prefill's answer), the wait for the KV "
        "(decode's first token after both its leg started and the prefill finished: all of it in pull, the part "
        "after the prefill in push), and the time to first token seen by the client.",
        "s",
        mean("disagg_router_prefill_seconds", ROUTER_REV, "prefill leg {{mode}}", by="mode"),
        mean("disagg_router_kv_wait_seconds", ROUTER_REV, "KV wait {{mode}}", by="mode"),
        mean("disagg_router_time_to_first_token_seconds", ROUTER_REV, "first token {{mode}}", by="mode"),
    ))  # fmt: skip
    d = d.with_panel(series(
        "TTFT split (p95)", "95th percentile of each part, all modes together.", "s",
        query(f"histogram_quantile(0.95, sum by (le) ({rate('disagg_router_prefill_seconds_bucket', ROUTER_REV)}))", "prefill leg"),
        query(f"histogram_quantile(0.95, sum by (le) ({rate('disagg_router_kv_wait_seconds_bucket', ROUTER_REV)}))", "KV wait"),
        query(f"histogram_quantile(0.95, sum by (le) ({rate('disagg_router_time_to_first_token_seconds_bucket', ROUTER_REV)}))",
              "first token"),
    ))  # fmt: skip
    d = d.with_panel(series("Time to first token", "Request arrival to the first streamed chunk, per revision.", "s",
                            *quantiles("disagg_router_time_to_first_token_seconds", ROUTER_REV, by="revision")))
    d = d.with_panel(series("Prefill leg", "Dispatch to prefill's answer, per revision.", "s",
                            *quantiles("disagg_router_prefill_seconds", ROUTER_REV, by="revision")))
    d = d.with_panel(series("KV wait", "The wait for the KV cache, per revision.", "s",
                            *quantiles("disagg_router_kv_wait_seconds", ROUTER_REV, by="revision")))

    d = d.with_row(gd.Row("Decode and end to end"))
    d = d.with_panel(series(
        "Time per output token",
        "Streamed answers: the first chunk to the end of the stream over the events after the first (vLLM streams one "
        "token per event unless --stream-interval says otherwise).",
        "s", *quantiles("disagg_router_time_per_output_token_seconds", ROUTER_REV, by="revision"),
    ))  # fmt: skip
    d = d.with_panel(series("End-to-end latency", "Request arrival to the end of the answer, as the router sees it.", "s",
                            *quantiles("disagg_router_request_duration_seconds", ROUTER_REV, by="revision")))

    d = d.with_row(gd.Row("Traffic and failures"))
    d = d.with_panel(series("Requests by status", "Client requests per second by revision, mode and HTTP status.", "reqps",
                            query(f"sum by (revision, mode, code) ({rate('disagg_router_requests_total', ROUTER_REV)})",
                                  "{{revision}} {{mode}} {{code}}"), stacked=True))
    d = d.with_panel(series("Failures by cause", "Failed attempts and streams per second by cause (docs/router.md has the "
                            "causes and what the client gets).", "ops",
                            query(f"sum by (revision, cause) ({rate('disagg_router_failures_total', ROUTER_REV)})",
                                  "{{revision}} {{cause}}"), stacked=True))
    d = d.with_panel(series("Retries", "Retries on another pair with fresh ids, per second.", "ops",
                            query(f"sum by (revision) ({rate('disagg_router_retries_total', ROUTER_REV)})", "{{revision}}")))
    d = d.with_panel(series("Routed despite ejections", "Attempts sent to ejected backends because ejections left no pair, "
                            "per second (panic routing: a stall ejected every engine at once, or they are dead).", "ops",
                            query(f"sum by (revision) ({rate('disagg_router_routed_despite_ejections_total', ROUTER_REV)})",
                                  "{{revision}}")))
    d = d.with_panel(series("Requests in flight", "Client requests in progress per router replica.", "none",
                            query(f"sum by (pod) (disagg_router_requests_in_flight{{{ROUTER}}})", "{{pod}}")))

    d = d.with_row(gd.Row("Stream migrations"))
    d = d.with_panel(series(
        "Stream migrations",
        "Streams whose decode engine failed after the first token, per second, by what became of them and the cause: "
        "migrated (continued on another pair, the client saw nothing but a gap), complete (every token was out); "
        "cut, with an error event and no [DONE]: refused (the request cannot be continued faithfully), exhausted "
        "(maxMigrations reached), failed (no pair took the continuation in time), off (migration is off). docs/alerts.md, "
        "DisaggStreamsCut.",
        "ops",
        query(f"sum by (outcome, cause) ({rate('disagg_router_migrations_total', ROUTER_REV)})", "{{outcome}} {{cause}}"),
        stacked=True,
    ))  # fmt: skip
    d = d.with_panel(series("Migration gap", "What a migration added to the client's stream: its last chunk before the "
                            "failure to the continuation's first.", "s",
                            *quantiles("disagg_router_migration_gap_seconds", ROUTER_REV)))
    d = d.with_panel(series("Streams waiting for a pair", "Streams whose decode failed that wait in the router for a pair "
                            "to continue on (none took them at once: every decode gone, a group being recreated), per "
                            "router replica; they end cut after spec.router.migration.waitSeconds.", "none",
                            query(f"sum by (pod) (disagg_router_migrations_waiting{{{ROUTER}}})", "{{pod}}")))

    d = d.with_row(gd.Row("Pairs and backends"))
    d = d.with_panel(series("Ready pairs", "Usable prefill/decode pairs per revision: a rollout moves them from the old "
                            "revision to the new one.", "none",
                            query(f"max by (revision) (disagg_router_ready_pairs{{{ROUTER_REV}}})", "{{revision}}")))
    d = d.with_panel(series("Traffic weight", "Share of new requests per revision (in proportion to its ready pairs).",
                            "percentunit",
                            query(f"max by (revision) (disagg_router_revision_weight{{{ROUTER_REV}}})", "{{revision}}")))
    d = d.with_panel(series("Ready backends", "Usable backends per role and revision (ready, not draining, not ejected).",
                            "none",
                            query(f"max by (revision, role) (disagg_router_ready_backends{{{ROUTER_REV}}})",
                                  "{{revision}} {{role}}")))
    d = d.with_panel(series("In flight per backend", "Legs in flight per backend, summed over the router replicas.", "none",
                            query(f"sum by (revision, role, backend) (disagg_router_backend_in_flight{{{ROUTER_REV}}})",
                                  "{{role}} {{backend}}")))
    d = d.with_panel(series(
        "Draining backends: in flight",
        "Backends whose pod is draining, with what is still in flight on them: a pod leaves once every router "
        "reports nothing in flight on it, streams included.",
        "none",
        query(f"sum by (revision, role, backend) (disagg_router_backend_in_flight{{{ROUTER_REV}}})\n"
              f"and on (revision, role, backend)\n"
              f"max by (revision, role, backend) (disagg_router_backend_draining{{{ROUTER_REV}}}) > 0",
              "{{role}} {{backend}}"),
    ))  # fmt: skip
    d = d.with_panel(series("Draining and ejected backends", "Backends marked draining, and backends ejected after failures "
                            "(re-probed until they answer again).", "none",
                            query(f"sum by (revision, role) (max by (revision, role, backend) "
                                  f"(disagg_router_backend_draining{{{ROUTER_REV}}}))", "draining {{revision}} {{role}}"),
                            query(f"sum by (revision, role) (max by (revision, role, backend) "
                                  f"(disagg_router_backend_ejected{{{ROUTER_REV}}}))", "ejected {{revision}} {{role}}")))

    d = d.with_row(gd.Row("Routing: policies, load and the prefix cache"))
    d = d.with_panel(series("Picks by reason", "Engines picked per role and policy, by the reason the policy gives: "
                            "cache_hit (the longest expected cached prefix), load, in_flight (this router's own counts "
                            "decided: least-outstanding, or no data), only (one candidate).", "ops",
                            query(f"sum by (role, policy, reason) ({rate('disagg_router_picks_total', ROUTER)})",
                                  "{{role}} {{policy}} {{reason}}")))
    d = d.with_panel(series("Expected prefix hit ratio", "Per prefill backend, of the prompt tokens sent, the share the "
                            "router's prefix index expected cached there (vLLM's own: vllm:prefix_cache_hits_total over "
                            "vllm:prefix_cache_queries_total).", "percentunit",
                            query(f"sum by (backend) ({rate('disagg_router_prefix_expected_hit_tokens_total', ROUTER)})\n/\n"
                                  f"sum by (backend) ({rate('disagg_router_prefix_prompt_tokens_total', ROUTER)})", "{{backend}}")))
    d = d.with_panel(series("Load per backend", "Requests ahead of a new one as the policies see it: the engine's running "
                            "and waiting at the router's last read of its /metrics plus the router's legs since then still in flight.", "none",
                            query(f"max by (role, backend) (disagg_router_backend_load{{{ROUTER_REV}}})", "{{role}} {{backend}}")))
    d = d.with_panel(series("Engines' queues and KV in use", "The engines' own scheduler gauges at the router's last fresh "
                            "read of their /metrics: requests waiting for room (vllm:num_requests_waiting_by_reason{reason=\"capacity\"}) and the share of the KV "
                            "cache in use (vllm:kv_cache_usage_perc), what the SLO autoscaler sizes the roles on.", "none",
                            query(f"max by (role, backend) (disagg_router_backend_waiting{{{ROUTER_REV}}})", "waiting {{role}} {{backend}}"),
                            query(f"max by (role, backend) (disagg_router_backend_kv_usage{{{ROUTER_REV}}})", "KV {{role}} {{backend}}")))
    d = d.with_panel(series("Indexes and load reads", "Prompt chunks the prefix index holds and KV blocks the KV-event "
                            "index holds per router replica, and its reads of the engines' /metrics by result.", "none",
                            query(f"sum by (pod) (disagg_router_prefix_index_chunks{{{ROUTER}}})", "chunks {{pod}}"),
                            query(f"sum by (pod) (disagg_router_kv_index_blocks{{{ROUTER}}})", "KV blocks {{pod}}"),
                            query(f"sum by (result) ({rate('disagg_router_load_reads_total', ROUTER)})", "reads/s {{result}}")))

    d = d.with_row(gd.Row("SLO autoscaler"))
    d = d.with_panel(series("Engines: current and decided", "Per role, the engines the model ran when the SLO autoscaler "
                            "(spec.autoscaling) last decided, and the size it decided (Active: written; Advisory: "
                            "recommended). Blocked: 1 while a role it would grow cannot be scheduled.", "none",
                            query(f"max by (role, size) (disagg_operator_autoscaler_engines{{{MODEL}}})", "{{role}} {{size}}"),
                            query(f"max(disagg_operator_autoscaler_blocked{{{MODEL}}})", "blocked"), width=8))
    d = d.with_panel(series("TTFT and TPOT against the targets", "The targets' percentile the routers measured over the "
                            "autoscaler's last interval (prefill_leg: queue and compute on prefill; local_ttft: the prompts decode "
                            "prefilled itself), and the targets.", "s",
                            query(f"max by (slo) (disagg_operator_autoscaler_measured_seconds{{{MODEL}}})", "{{slo}}"),
                            query(f"max by (slo) (disagg_operator_autoscaler_target_seconds{{{MODEL}}})", "{{slo}} target"),
                            width=8))  # fmt: skip
    d = d.with_panel(series("Demand and capacity", "What the autoscaler estimates: prompt tokens/s and decode KV tokens "
                            "(now and forecast), and one engine's learned capacity (docs/autoscaling.md).", "none",
                            query(f"max by (estimate) (disagg_operator_autoscaler_estimate{{{MODEL}}})", "{{estimate}}"),
                            width=8))  # fmt: skip

    d = d.with_row(gd.Row("Router discovery"))
    d = d.with_panel(series("Discovery", "Pod watch events applied, and discovery failures (the router keeps its last table).",
                            "ops",
                            query(f"sum by (pod) ({rate('disagg_router_discovery_events_total', ROUTER)})", "events {{pod}}"),
                            query(f"sum by (pod) ({rate('disagg_router_discovery_errors_total', ROUTER)})", "errors {{pod}}"),
                            width=24))  # fmt: skip
    return d


# --- the operator ---------------------------------------------------------------------------------------
def operator_dashboard() -> gd.Dashboard:
    ctl = f'{OPERATOR}, controller="{CONTROLLER}"'
    queue = f'{OPERATOR}, name="{CONTROLLER}"'
    d = (
        base("disagg-operator / Operator", "disagg-operator",
             "The operator's reconcile loop in controller-runtime's names, plus its errors by reason and the children "
             "it writes.")
        .with_variable(query_variable("namespace", "Namespace",
                                      f'label_values(controller_runtime_max_concurrent_reconciles{{controller="{CONTROLLER}"}}, namespace)',
                                      multi=True))
    )  # fmt: skip

    d = d.with_row(gd.Row("Reconciles"))
    d = d.with_panel(series("Reconciles by result", "Passes per second: success, error, requeue.", "ops",
                            query(f"sum by (result) ({rate('controller_runtime_reconcile_total', ctl)})", "{{result}}"),
                            stacked=True))
    d = d.with_panel(series("Reconcile errors", "Passes that failed, per second.", "ops",
                            query(f"sum({rate('controller_runtime_reconcile_errors_total', ctl)})", "errors/s")))
    d = d.with_panel(series("Errors by reason", "Passes that failed or were blocked, by reason (docs/reasons.md).", "ops",
                            query(f"sum by (reason) ({rate('disagg_operator_reconcile_errors_by_reason_total', OPERATOR)})",
                                  "{{reason}}"), stacked=True))
    d = d.with_panel(series("Reconcile latency", "Length of a pass: milliseconds when nothing changes, seconds when the "
                            "API server is slow.", "s", *quantiles("controller_runtime_reconcile_time_seconds", ctl)))

    d = d.with_row(gd.Row("Workers and queue"))
    d = d.with_panel(series("Active workers", "Workers reconciling now per replica (a standby replica of a peering shows 0), "
                            "and the most that may run at once.", "none",
                            query(f"sum by (pod) (controller_runtime_active_workers{{{ctl}}})", "active {{pod}}"),
                            query(f"max(controller_runtime_max_concurrent_reconciles{{{ctl}}})", "max")))
    d = d.with_panel(series("Work queue", "Models waiting for a pass, adds and retries per second.", "none",
                            query(f"sum by (pod) (workqueue_depth{{{queue}}})", "depth {{pod}}"),
                            query(f"sum({rate('workqueue_adds_total', queue)})", "adds/s"),
                            query(f"sum({rate('workqueue_retries_total', queue)})", "retries/s")))

    d = d.with_row(gd.Row("Children and models"))
    d = d.with_panel(series("Children applied", "Children written by server-side apply, per second, by kind.", "ops",
                            query(f"sum by (kind) ({rate('disagg_operator_children_applied_total', OPERATOR)})", "{{kind}}"),
                            stacked=True))
    d = d.with_panel(series("Children deleted", "Children deleted, per second, by kind (old revisions, drained pods, "
                            "what a spec no longer asks for).", "ops",
                            query(f"sum by (kind) ({rate('disagg_operator_children_deleted_total', OPERATOR)})", "{{kind}}"),
                            stacked=True))
    d = d.with_panel(series("Models by phase", "DisaggregatedModels by status phase, as the working replica's cache holds them.",
                            "none", query(f"max by (phase) (disagg_operator_models{{{OPERATOR}}})", "{{phase}}"),
                            stacked=True, width=24))  # fmt: skip
    return d


# --- files ----------------------------------------------------------------------------------------------
DASHBOARDS: dict[str, Callable[[], gd.Dashboard]] = {
    "disagg-model.json": model_dashboard,
    "disagg-operator.json": operator_dashboard,
}


# --- reading them back: what a test checks --------------------------------------------------------------
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\)$", re.DOTALL)


def load(name: str) -> dict[str, Any]:
    """A committed dashboard, as Grafana's sidecar loads it."""
    return json.loads((OUT_DIR / name).read_text())


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its own


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and of every query variable's selector."""
    out = []
    for panel in panels(board):
        for target in panel.get("targets", []):
            out.append((f"{board['uid']}: panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            match = LABEL_VALUES.match(var["query"])
            assert match, f"{board['uid']}: variable {var['name']}: not label_values(selector, label): {var['query']}"
            out.append((f"{board['uid']}: variable {var['name']}", match["selector"]))
    return out


def concrete(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana's template variables (``$model``, ``$__rate_interval``...) replaced by ``values``."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    return expr


def render(build: Callable[[], gd.Dashboard]) -> str:
    board = build().build()
    for number, panel in enumerate(board.panels or [], start=1):  # stable ids: links to a panel survive regeneration
        panel.id_val = number
    return JSONEncoder(sort_keys=True, indent=2).encode(board) + "\n"


def expected() -> dict[Path, str]:
    return {OUT_DIR / name: render(build) for name, build in DASHBOARDS.items()}


def strays(want: dict[Path, str]) -> list[Path]:
    """Dashboards in the chart that nothing builds any more."""
    return [p for p in OUT_DIR.glob("*.json") if p not in want] if OUT_DIR.is_dir() else []


def stale() -> list[Path]:
    want = expected()
    return generated.stale(want, strays(want))


def main(argv: list[str] | None = None) -> int:
    return generated.main("python -m hack.gen.dashboards", __doc__.splitlines()[0], expected, argv, strays=strays,
                          check_text=json.loads)  # the encoder's output is JSON, or nothing is written


if __name__ == "__main__":
    sys.exit(main())
