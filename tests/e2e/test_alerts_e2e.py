"""The chart's alerts and dashboards on a real Prometheus (built by hack/cluster.sh from its Go module): it finds the
model's router pods through the local API server (kubernetes service discovery, role pod, with the RBAC a Prometheus
needs: a ServiceAccount allowed to list and watch pods) with the scrape config prometheus-operator generates from the
chart's own PodMonitor for the routers (namespace and pod target labels), scrapes the router on the pod's IP (where
the router process serves, as in a cluster) and the operator, and evaluates the PrometheusRule the chart renders.

- When the simulated decode engines fail every KV transfer, the alert DisaggKVTransfersFailing goes pending, then
  firing, naming the model and revision; when they recover, it resolves; every dashboard query then answers.
- The panels of what only a day-2 operation or a failed pass brings answer once it happens: a decode drained while
  streams run on it, a child the spec no longer asks for deleted, a pass blocked by a name someone else holds.

The rules run with a short window and `for` (values), so the tests take seconds, not minutes."""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Any, Callable

from kubernetes import client

from disagg_connector import contract
from hack.gen import dashboard_png, dashboards
from tests.fixtures.helm import CHART, helm, values_args
from hack.gen.prometheus import PrometheusServer, pod_monitor_scrape_config
from disagg_bench.vllm_sim.harness import FAST
from disagg_bench.vllm_sim.pods import router_kubeconfig

from tests.fixtures.e2e.operator import OPERATOR_NAMESPACE
from tests.fixtures.e2e.models import model_manifest
from tests.fixtures.e2e.serving import Serving
from tests.fixtures.e2e.traffic import control
from tests.fixtures.e2e.streams import TPOT_MS, LongStreams, check_whole, decode_settled, draining_pod, long_model
from tests.fixtures.e2e.traffic import wait_for
from tests.fixtures.e2e.waiting import condition

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
ALERT = "DisaggKVTransfersFailing"
# Prometheus scrapes every second; a 10 s window holds 10 samples (at least 4 intervals, as the values say).
ALERT_VALUES = {"enabled": True, "rateWindow": "10s", "kvTransfersFailing": {"for": "8s"}, "noReadyPair": {"for": "8s"}}


def chart_objects(namespace: str, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The PrometheusRule's groups and the routers' PodMonitor, as rendered by the real helm from the chart's values.
    The PodMonitor looks in the test's namespace only: this Prometheus may list pods there alone (a cluster-wide
    one lists them everywhere, and the chart's default is every namespace)."""
    values = {"alerts": ALERT_VALUES,
              "metrics": {"routerPodMonitor": {"enabled": True, "interval": "1s", "namespaceSelector": {"matchNames": [namespace]}}}}
    docs = helm("template", "dop", str(CHART), "--namespace", OPERATOR_NAMESPACE, *values_args(values, tmp_path)).docs()
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    return {"groups": rule["spec"]["groups"]}, monitor  # fmt: skip


def prometheus_kubeconfig(cluster: Any, namespace: str, path: Path) -> Path:
    """A token of a ServiceAccount `prometheus` that may list and watch the namespace's pods: what kubernetes_sd
    with role pod needs (kube-prometheus grants its Prometheus the same on pods)."""
    core, rbac = client.CoreV1Api(cluster.api_client()), client.RbacAuthorizationV1Api(cluster.api_client())
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "prometheus"}})
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "prometheus"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]})  # fmt: skip
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "prometheus"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "prometheus"},
        "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": namespace}]})  # fmt: skip
    token = cluster.kubectl("create", "token", "prometheus", "-n", namespace, "--duration=1h").stdout.strip()
    return router_kubeconfig(cluster.kubeconfig, token, namespace, path)


def scrape_config(pod_monitor: dict[str, Any], kubeconfig: Path, operator_port: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            # what prometheus-operator makes of the chart's PodMonitor: the routers, found through the API server
            *pod_monitor_scrape_config(pod_monitor, kubeconfig),
            # The e2e operator is a process beside the cluster, not a pod: scraped where it serves, with the
            # namespace label the chart's ServiceMonitor would give it.
            {"job_name": "disagg-operator",
             "static_configs": [{"targets": [f"127.0.0.1:{operator_port}"], "labels": {"namespace": OPERATOR_NAMESPACE}}]},
        ],
    }  # fmt: skip


def start_prometheus(cluster: Any, namespace: str, operator: Any, tmp_path: Path) -> tuple[PrometheusServer, str]:
    """A Prometheus (not started yet) with the chart's rules and its PodMonitor's scrape config; and the `job` the
    PodMonitor gives the routers' series (<its namespace>/<its name>)."""
    rules, monitor = chart_objects(namespace, tmp_path)
    config = scrape_config(monitor, prometheus_kubeconfig(cluster, namespace, tmp_path / "pk"), operator.metrics_port)
    job = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    return PrometheusServer(config, tmp_path / "prometheus", {"rules.yaml": rules}), job


def wait_for_targets(prom: PrometheusServer, router_job: str, router_pods: set[str]) -> None:
    """The routers found through the API server, under their pods' names, and nothing else of the namespace (the
    engines' pods, on their own port `http`, are not routers); the operator beside them; all up."""

    def targets() -> dict[tuple[str, str], str]:
        return {(s["metric"]["job"], s["metric"].get("pod", "")): s["value"][1] for s in prom.query("up")}

    want = {**{(router_job, pod): "1" for pod in router_pods}, ("disagg-operator", ""): "1"}
    wait_for("the routers and the operator scraped", lambda: targets() == want, 60)


def test_kv_transfer_alert_pending_firing_resolved(operator, cluster, api_client, namespace, tmp_path: Path) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "alrt"
    # An Advisory SLO autoscaler (targets nothing misses, so it decides no change) for the model dashboard's
    # "SLO autoscaler" row: its gauges exist only for a model with spec.autoscaling.
    advisory = {"ttftMilliseconds": 60000, "tpotMilliseconds": 10000, "prefill": {"maxEngines": 1},
                "decode": {"maxEngines": 1}, "intervalSeconds": 5, "warmupSeconds": 0}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name, {
        "router": {"disaggregationThresholdTokens": 0}, "autoscaling": advisory}))  # fmt: skip
    obj = wait_for("Ready", lambda: (o := custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
                   and condition(o, "Ready").get("status") == "True" and o, 120)  # fmt: skip
    revision, served = obj["status"]["revision"], obj["spec"]["model"]["name"]
    (router_pod,) = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=router").items
    prom, router_job = start_prometheus(cluster, namespace, operator, tmp_path)
    ours = {"namespace": namespace, "model": name, "revision": revision}

    with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 1)) as serving:
        wait_for("router table", lambda: serving.router.table() == {revision: (1, 1)}, 60)
        serving.start_client(workers=2)
        with prom:
            assert router_pod.metadata.name.startswith(contract.router_name(name) + "-")
            wait_for_targets(prom, router_job, {router_pod.metadata.name})
            check_alert_on_failing_transfers(prom, serving, ours)
            missing = unanswered_queries(prom, ours, lambda title: title not in DAY_2_PANELS)
            assert not missing, "no series for:\n" + "\n".join(missing)


def check_alert_on_failing_transfers(prom: PrometheusServer, serving: Serving, ours: dict[str, str]) -> None:
    """With traffic through the router: no alert; transfers failing: the alert of OURS (namespace, model, revision)
    pending, then firing; transfers back: resolved."""
    namespace, name, revision = ours["namespace"], ours["model"], ours["revision"]

    def alert() -> dict[str, Any] | None:
        found = [a for a in prom.alerts(ALERT) if all(a["labels"].get(k) == v for k, v in ours.items())]
        assert len(found) <= 1, found
        return found[0] if found else None

    # the operator's model conditions, scraped: Ready=True for this model
    ready = f'disagg_operator_model_condition{{model_namespace="{namespace}", model="{name}", type="Ready", status="True"}}'
    wait_for("the model's Ready condition scraped", lambda: prom.query(ready), 60)
    answers = (f"namespace_model_revision:disagg_router_disaggregated_answers:rate{ALERT_VALUES['rateWindow']}"
               f'{{namespace="{namespace}", model="{name}", revision="{revision}"}}')
    answered = lambda: [s for s in prom.query(answers) if float(s["value"][1]) > 0]  # noqa: E731
    wait_for("successful answers recorded per model and revision", answered, 60)
    assert alert() is None, "healthy transfers: no alert"

    for engine in serving.engines.live("decode"):
        control(engine.url, fail_transfers=True)
    pending = wait_for("alert pending", lambda: (a := alert()) and a["state"] == "pending" and a, 60)
    firing = wait_for("alert firing", lambda: (a := alert()) and a["state"] == "firing" and a, 60)
    assert firing["labels"] == {"alertname": ALERT, **ours, "severity": "critical"}, firing
    assert f"revision {revision} of {namespace}/{name} failed their KV transfer" in firing["annotations"]["description"]
    assert firing["annotations"]["runbook_url"].endswith("docs/alerts.md#disaggkvtransfersfailing")
    assert pending["activeAt"] == firing["activeAt"], "one alert, pending then firing"

    for engine in serving.engines.live("decode"):
        control(engine.url, fail_transfers=False)
    wait_for("alert resolved", lambda: alert() is None, 90)
    assert answered(), "the model serves again"


# Panels of what only a day-2 operation or a failed pass brings: their series appear with the first draining pod,
# the first child deleted, the first reason a pass failed for. test_day_2_panels_answer makes each happen.
DRAINING, DELETED, ERRORS = "Draining backends: in flight", "Children deleted", "Errors by reason"
DAY_2_PANELS = {DRAINING, DELETED, ERRORS}


def board_values(ours: dict[str, str], board: str) -> dict[str, str]:
    """Grafana's variables for OUR model and revision on BOARD (the operator's dashboard: the operator's namespace),
    with the rate window as short as this Prometheus's scrapes allow."""
    namespace = ours["namespace"] if board == "disagg-model.json" else OPERATOR_NAMESPACE
    return {"${datasource}": "prometheus", "$__rate_interval": ALERT_VALUES["rateWindow"], "$namespace": namespace,
            "$model": ours["model"], "$revision": ours["revision"]}  # fmt: skip


def unanswered_queries(prom: PrometheusServer, ours: dict[str, str], panel: Callable[[str], bool]) -> list[str]:
    """The queries of both dashboards, of the panels whose title PANEL accepts and of every variable, that return
    no series for OURS (board_values), waited on for up to a minute."""

    def unanswered() -> list[str]:
        return [
            f"{where}: {expr}"
            for board in dashboards.DASHBOARDS
            for where, expr in dashboards.queries(dashboards.load(board))
            if (not (title := re.search(r": panel '(.*)' \w+$", where)) or panel(title.group(1)))
            and not prom.query(dashboards.concrete(expr, board_values(ours, board)))
        ]

    with contextlib.suppress(AssertionError):  # timed out: the caller asserts on what is still missing
        wait_for("the dashboard queries answered", lambda: not unanswered(), 60)
    return unanswered()


def panel_series(prom: PrometheusServer, title: str, ours: dict[str, str]) -> list[dict[str, Any]]:
    """The series of panel TITLE's query (the day-2 panels have one each), for OURS."""
    ((board, expr),) = [(board, expr) for board in dashboards.DASHBOARDS
                        for where, expr in dashboards.queries(dashboards.load(board)) if f": panel {title!r} " in where]  # fmt: skip
    return prom.query(dashboards.concrete(expr, board_values(ours, board)))


def counter(prom: PrometheusServer, expr: str) -> float:
    return sum(float(s["value"][1]) for s in prom.query(expr))


def test_day_2_panels_answer(operator, cluster, api_client, namespace, tmp_path: Path, dashboard_png_dir: Path | None) -> None:
    """A 1P2D model under long streams (tests/e2e/test_no_cut_streams.py's): its decode scaled in while streams run
    on both decodes (the draining one's backend, with what is in flight on it, on "Draining backends: in flight");
    its NetworkPolicy turned off in the spec (the policy deleted: "Children deleted" by kind); a second model
    whose router Service name someone else holds (its passes blocked: "Errors by reason"). Each counter is shown to
    grow across its operation, so a series left by an earlier test of the same operator does not pass for it."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "day2"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, long_model(name))
    obj = wait_for("1P2D Ready", lambda: (o := custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
                   and condition(o, "Ready").get("status") == "True" and o["status"]["decode"]["readyReplicas"] == 2 and o, 180)  # fmt: skip
    revision, served = obj["status"]["revision"], obj["spec"]["model"]["name"]
    ours = {"namespace": namespace, "model": name, "revision": revision}
    (router_pod,) = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=router").items
    prom, router_job = start_prometheus(cluster, namespace, operator, tmp_path)
    deleted_policies = 'disagg_operator_children_deleted_total{kind="NetworkPolicy"}'
    conflicts = 'disagg_operator_reconcile_errors_by_reason_total{reason="OwnershipConflict"}'

    with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 2), timing={**FAST, "tpot_ms": TPOT_MS}) as serving, prom:
        wait_for("router table 1P2D", lambda: serving.router.table() == {revision: (1, 2)}, 60)
        wait_for_targets(prom, router_job, {router_pod.metadata.name})
        shown_from = time.time()
        before = {what: counter(prom, what) for what in (deleted_policies, conflicts)}
        assert not panel_series(prom, DRAINING, ours), "nothing drains yet"

        # a drain that streams hold open: the draining decode's backend on the panel while they run
        streams = LongStreams(serving.router.url, served, first=0)
        wait_for("every long stream has its first token", streams.all_started, 60)
        scaler = contract.role_scaler_name(name, "decode")
        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL, scaler, {"spec": {"replicas": 1}})
        leaving = wait_for("a decode draining", lambda: draining_pod(core, namespace, name), 60)
        drained = wait_for("the draining backend on its panel", lambda: panel_series(prom, DRAINING, ours), 30)
        assert [s["metric"]["role"] for s in drained] == ["decode"], drained
        assert drained[0]["metric"]["backend"].split("#")[0] == leaving, (drained, leaving)
        assert float(drained[0]["value"][1]) > 0, f"streams in flight on {leaving}: {drained}"

        # a child the spec no longer asks for, and a pass blocked by someone else's object, while the streams run
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                              {"spec": {"network": {"networkPolicy": {"enabled": False}}}})  # fmt: skip
        core.create_namespaced_service(namespace, {"metadata": {"name": contract.router_name("taken")},
                                                   "spec": {"ports": [{"port": 80}], "selector": {"app": "web"}}})  # fmt: skip
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("taken"))
        wait_for("the NetworkPolicy's deletion counted", lambda: counter(prom, deleted_policies) > before[deleted_policies], 60)
        wait_for("the blocked passes counted", lambda: counter(prom, conflicts) > before[conflicts], 60)
        # each panel's own series (other kinds and reasons may be there already: wait for this one, not for any)
        wait_for("NetworkPolicy on the children deleted panel",
                 lambda: [s for s in panel_series(prom, DELETED, ours) if s["metric"]["kind"] == "NetworkPolicy"], 30)
        wait_for("OwnershipConflict on the errors by reason panel",
                 lambda: [s for s in panel_series(prom, ERRORS, ours) if s["metric"]["reason"] == "OwnershipConflict"], 30)

        check_whole(streams.wait(), "scale-in")
        wait_for("scaled in to 1 decode", lambda: decode_settled(custom, namespace, name, 1), 120)
        wait_for("nothing draining on the panel", lambda: not panel_series(prom, DRAINING, ours), 30)
        if dashboard_png_dir is not None:  # the operator dashboard drawn (docs/observability.md)
            dashboard_png.render_board(prom, "disagg-operator.json", board_values(ours, "disagg-operator.json"), shown_from,
                                       time.time(), "the e2e's day-2 test on the local control plane (a decode scaled in "
                                       "under streams, a NetworkPolicy deleted, a model blocked by OwnershipConflict), "
                                       "a real Prometheus", dashboard_png_dir)  # fmt: skip


def test_no_ready_pair_alert_pending_firing_resolved(operator, cluster, api_client, namespace, tmp_path: Path) -> None:
    """A 1P1D model whose prefill role is scaled to zero: its router knows no ready pair, and DisaggModelNoReadyPair
    goes pending, then firing, naming the model; scaled back to one, the pair is ready again and the alert resolves."""
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "nopair"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name))
    obj = wait_for("Ready", lambda: (o := custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
                   and condition(o, "Ready").get("status") == "True" and o, 120)  # fmt: skip
    revision, served = obj["status"]["revision"], obj["spec"]["model"]["name"]
    (router_pod,) = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=router").items
    prom, router_job = start_prometheus(cluster, namespace, operator, tmp_path)
    ours = {"namespace": namespace, "model": name}
    scaler = contract.role_scaler_name(name, "prefill")
    pairs = f'disagg_router_ready_pairs{{namespace="{namespace}", revision="{revision}"}}'

    def alert() -> dict[str, Any] | None:
        found = [a for a in prom.alerts("DisaggModelNoReadyPair") if all(a["labels"].get(k) == v for k, v in ours.items())]
        assert len(found) <= 1, found
        return found[0] if found else None

    with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 1)) as serving, prom:
        wait_for("router table", lambda: serving.router.table() == {revision: (1, 1)}, 60)
        wait_for_targets(prom, router_job, {router_pod.metadata.name})
        wait_for("one ready pair scraped", lambda: [s for s in prom.query(pairs) if s["value"][1] == "1"], 60)
        assert alert() is None, "a ready pair: no alert"

        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL, scaler, {"spec": {"replicas": 0}})
        pending = wait_for("alert pending", lambda: (a := alert()) and a["state"] == "pending" and a, 90)
        firing = wait_for("alert firing", lambda: (a := alert()) and a["state"] == "firing" and a, 60)
        assert firing["labels"] == {"alertname": "DisaggModelNoReadyPair", **ours, "severity": "critical"}, firing
        assert f"No router of {namespace}/{name} has a revision with a ready prefill and decode pair" in firing["annotations"]["description"]
        assert firing["annotations"]["runbook_url"].endswith("docs/alerts.md#disaggmodelnoreadypair")
        assert pending["activeAt"] == firing["activeAt"], "one alert, pending then firing"

        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, contract.ROLE_PLURAL, scaler, {"spec": {"replicas": 1}})
        wait_for("alert resolved", lambda: alert() is None, 120)
        assert [s for s in prom.query(pairs) if s["value"][1] == "1"], "the pair is back"
