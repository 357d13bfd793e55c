"""The operator's scrape-time gauges read the models in its cache: models by phase and one series per condition
(what the chart's alerts read for a rollout that does not finish), through the Controller's real wiring."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from disagg_operator.config import RenderDefaults
from disagg_operator.metrics import OperatorMetrics
from disagg_operator.reconcile import Controller, Reconciler

from tests.fixtures.models import dm
from tests.fixtures.memory_cache import MemoryCache


def _model(namespace: str, name: str, status: dict[str, Any] | None) -> dict[str, Any]:
    body = dm(name=name, namespace=namespace)
    if status is not None:
        body["status"] = status
    return body


def _samples(metrics: OperatorMetrics, family: str) -> list[tuple[dict[str, str], float]]:
    text = generate_latest(metrics.registry).decode()
    return [(dict(s.labels), s.value) for f in text_string_to_metric_families(text) if f.name == family for s in f.samples]


def test_conditions_and_phases_of_the_cached_models_at_scrape_time() -> None:
    rolling = {"phase": "Ready", "conditions": [
        {"type": "Ready", "status": "True", "reason": "Ready"},
        {"type": "Progressing", "status": "True", "reason": "RolloutInProgress"},
    ]}  # fmt: skip
    cache = MemoryCache([_model("a", "m1", rolling), _model("b", "m2", {"phase": "Pending"}), _model("a", "m3", None)])
    metrics = OperatorMetrics(workers=1)
    controller = Controller(Reconciler(cache, None, RenderDefaults(), metrics), workers=1)  # type: ignore[arg-type]
    controller.start()
    try:
        conditions = _samples(metrics, "disagg_operator_model_condition")
        phases = _samples(metrics, "disagg_operator_models")
        # a status written later shows in the next scrape: nothing keeps a copy
        waiting = {"type": "Ready", "status": "False", "reason": "WaitingForPods"}
        cache.model("b", "m2")["status"]["conditions"] = [waiting]  # type: ignore[index]
        later = _samples(metrics, "disagg_operator_model_condition")
    finally:
        controller.stop()
    assert sorted((l["model_namespace"], l["model"], l["type"], l["status"], l["reason"], v) for l, v in conditions) == [
        ("a", "m1", "Progressing", "True", "RolloutInProgress", 1.0),
        ("a", "m1", "Ready", "True", "Ready", 1.0),
    ]
    assert sorted((l["phase"], v) for l, v in phases) == [("Pending", 1.0), ("Ready", 1.0), ("Unknown", 1.0)]
    assert ({"model_namespace": "b", "model": "m2", "type": "Ready", "status": "False", "reason": "WaitingForPods"}, 1.0) in later


def test_the_slo_autoscalers_targets_and_last_decision_at_scrape_time() -> None:
    slo = {"autoscaling": {"mode": "Active", "ttftMilliseconds": 2000, "tpotMilliseconds": 50,
                           "prefill": {"maxEngines": 4}, "decode": {"maxEngines": 4}}}  # fmt: skip
    decided = {"mode": "Active", "decidedAt": "2026-12-04T00:00:00Z",
               "prefill": {"current": 1, "recommended": 3, "reason": "TTFT"}, "decode": {"current": 2, "recommended": 2, "reason": "on target"},
               "blocked": "prefill: 1 engine(s) cannot be scheduled", "measured": {"requests": 40, "ttftSeconds": 9.0, "prefillLegSeconds": 8.5},
               "estimates": {"prefill_tokens_per_s": 26666.7}}  # fmt: skip
    scaled = dm(slo, name="m1", namespace="a")
    scaled["status"] = {"autoscaling": decided}
    cache = MemoryCache([scaled, dm(slo, name="m2", namespace="a"), _model("a", "plain", None)])
    metrics = OperatorMetrics(workers=1)
    controller = Controller(Reconciler(cache, None, RenderDefaults(), metrics), workers=1)  # type: ignore[arg-type]
    controller.start()
    try:
        def family(name: str) -> dict[tuple[str, ...], float]:
            return {(labels.pop("model_namespace"), labels.pop("model"), *labels.values()): value
                    for labels, value in _samples(metrics, name)}

        engines, targets = family("disagg_operator_autoscaler_engines"), family("disagg_operator_autoscaler_target_seconds")
        measured, estimates = family("disagg_operator_autoscaler_measured_seconds"), family("disagg_operator_autoscaler_estimate")
        blocked = family("disagg_operator_autoscaler_blocked")
    finally:
        controller.stop()
    # model_namespace, model, then the family's own labels
    assert engines == {("a", "m1", "prefill", "current"): 1, ("a", "m1", "prefill", "decided"): 3,
                       ("a", "m1", "decode", "current"): 2, ("a", "m1", "decode", "decided"): 2}  # fmt: skip
    assert targets == {("a", m, slo): v for m in ("m1", "m2") for slo, v in (("ttft", 2.0), ("tpot", 0.05))}, "no decision yet: the targets"
    assert measured == {("a", "m1", "ttft"): 9.0, ("a", "m1", "prefill_leg"): 8.5}, "no TPOT measured: no series"
    assert estimates == {("a", "m1", "prefill_tokens_per_s"): 26666.7} and blocked == {("a", "m1"): 1.0}
