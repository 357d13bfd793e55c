"""The chart's alerts on a real Prometheus (built by hack/cluster.sh from its Go module): it finds the model's
router pod through the local API server (kubernetes service discovery, role pod, with the RBAC a Prometheus needs:
a ServiceAccount allowed to list and watch pods) and relabels it as a PodMonitor would (namespace, pod), scrapes
the router on the pod's IP (where the router process serves, as in a cluster) and the operator, and evaluates
the PrometheusRule the chart renders. When the simulated decode engines fail every KV transfer, the alert
DisaggKVTransfersFailing goes pending, then firing, naming the model and revision; when they recover, it
resolves. The rules run with a short window and `for` (values), so the test takes seconds, not minutes."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from kubernetes import client

from disagg_connector import contract
from tests.support import dashboards
from tests.support.helm import CHART, helm, values_args
from tests.support.prometheus import PrometheusServer
from tests.vllm_sim.pods import router_kubeconfig

from .conftest import OPERATOR_NAMESPACE, model_manifest
from .serving import Serving
from .test_kv_health import control
from .test_router_e2e import wait_for
from .waiting import condition

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
ALERT = "DisaggKVTransfersFailing"
# Prometheus scrapes every second; a 10 s window holds 10 samples (at least 4 intervals, as the values say).
ALERT_VALUES = {"enabled": True, "rateWindow": "10s", "kvTransfersFailing": {"for": "8s"}}


def chart_rules(tmp_path: Path) -> dict[str, Any]:
    """The PrometheusRule's groups, as rendered by the real helm from the chart's values."""
    docs = helm("template", "dop", str(CHART), "--namespace", OPERATOR_NAMESPACE,
                *values_args({"alerts": ALERT_VALUES}, tmp_path)).docs()  # fmt: skip
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return {"groups": rule["spec"]["groups"]}


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


def scrape_config(namespace: str, kubeconfig: Path, operator_port: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "disagg-routers",
                "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig), "namespaces": {"names": [namespace]}}],
                # what a PodMonitor for the router pods (docs/observability.md) generates
                "relabel_configs": [
                    {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"], "regex": "router", "action": "keep"},
                    {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_managed_by"], "regex": contract.OPERATOR_NAME,
                     "action": "keep"},
                    {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": contract.HTTP_PORT_NAME, "action": "keep"},
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                ],
            },
            # The e2e operator is a process beside the cluster, not a pod: scraped where it serves, with the
            # namespace label the chart's ServiceMonitor would give it.
            {"job_name": "disagg-operator",
             "static_configs": [{"targets": [f"127.0.0.1:{operator_port}"], "labels": {"namespace": OPERATOR_NAMESPACE}}]},
        ],
    }  # fmt: skip


def test_kv_transfer_alert_pending_firing_resolved(operator, cluster, api_client, namespace, tmp_path: Path) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "alrt"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                           model_manifest(name, {"router": {"disaggregationThresholdTokens": 0}}))  # fmt: skip
    obj = wait_for("Ready", lambda: (o := custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
                   and condition(o, "Ready").get("status") == "True" and o, 120)  # fmt: skip
    revision, served = obj["status"]["revision"], obj["spec"]["model"]["name"]
    (router_pod,) = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=router").items

    prom = PrometheusServer(scrape_config(namespace, prometheus_kubeconfig(cluster, namespace, tmp_path / "pk"), operator.metrics_port),
                            tmp_path / "prometheus", {"rules.yaml": chart_rules(tmp_path)})  # fmt: skip
    ours = {"namespace": namespace, "model": name, "revision": revision}

    with Serving(cluster, namespace, name, served, tmp_path, listening=(1, 1)) as serving:
        wait_for("router table", lambda: serving.router.table() == {revision: (1, 1)}, 60)
        serving.start_client(workers=2)
        with prom:
            check_alert_on_failing_transfers(prom, serving, router_pod.metadata.name, ours)
            check_every_dashboard_query_answers(prom, ours)


def check_alert_on_failing_transfers(prom: PrometheusServer, serving: Serving, router_pod: str, ours: dict[str, str]) -> None:
    """With traffic through the router: both targets scraped, no alert; transfers failing: the alert of OURS
    (namespace, model, revision) pending, then firing; transfers back: resolved."""
    namespace, name, revision = ours["namespace"], ours["model"], ours["revision"]

    def alert() -> dict[str, Any] | None:
        found = [a for a in prom.alerts(ALERT) if all(a["labels"].get(k) == v for k, v in ours.items())]
        assert len(found) <= 1, found
        return found[0] if found else None

    def targets() -> dict[tuple[str, str], str]:
        return {(s["metric"]["job"], s["metric"].get("pod", "")): s["value"][1] for s in prom.query("up")}

    # the router found through the API server, under its pod's name; the operator beside it
    want = {("disagg-routers", router_pod): "1", ("disagg-operator", ""): "1"}
    wait_for("both targets up", lambda: targets() == want, 60)
    assert router_pod.startswith(contract.router_name(name) + "-")
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


# Panels of what only a day-2 operation or a failed pass brings, none of which this test makes: their series
# appear with the first draining pod, the first reason a pass failed for, the first child deleted.
ONLY_ONCE_IT_HAPPENS = {"Draining backends: in flight", "Errors by reason", "Children deleted"}


def check_every_dashboard_query_answers(prom: PrometheusServer, ours: dict[str, str]) -> None:
    """After traffic, failed transfers and recovery: every panel's query and every variable's selector of both
    dashboards returns at least one series, for OUR model and revision (the operator's dashboard for the
    operator's namespace), with Grafana's rate window as short as this Prometheus's scrapes allow; except the
    panels of ONLY_ONCE_IT_HAPPENS."""
    values = {"${datasource}": "prometheus", "$__rate_interval": ALERT_VALUES["rateWindow"], "$model": ours["model"],
              "$revision": ours["revision"]}  # fmt: skip
    namespaces = {"disagg-model.json": ours["namespace"], "disagg-operator.json": OPERATOR_NAMESPACE}

    def unanswered() -> list[str]:
        return [
            f"{where}: {expr}"
            for name in dashboards.DASHBOARDS
            for where, expr in dashboards.queries(dashboards.load(name))
            if not any(f"panel {title!r} " in where for title in ONLY_ONCE_IT_HAPPENS)
            and not prom.query(dashboards.concrete(expr, {**values, "$namespace": namespaces[name]}))
        ]

    with contextlib.suppress(AssertionError):  # timed out: the assertion below says which
        wait_for("every dashboard query answered", lambda: not unanswered(), 60)
    missing = unanswered()
    assert not missing, "no series for:\n" + "\n".join(missing)
