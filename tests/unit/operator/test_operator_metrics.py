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
