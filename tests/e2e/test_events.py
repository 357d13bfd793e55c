"""Events on the real API server: `kubectl describe dm` tells a rollout's story in order, and a repeated
Event is one Event with a count (events.k8s.io/v1 series), not a flood."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from disagg_connector import contract
from disagg_operator.events import Event
from disagg_operator.kube import EventRecorder

from tests.fixtures.e2e.models import model_manifest
from tests.fixtures.e2e.models import get_model, wait_ready
from tests.fixtures.e2e.waiting import condition, wait_for

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL


def model_events(api_client: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    """events.k8s.io/v1 Events regarding the model, oldest first (as raw JSON: Events that other components
    wrote through core/v1 have no eventTime, which the client's typed model refuses)."""
    raw = client.EventsV1Api(api_client).list_namespaced_event(namespace, _preload_content=False)
    listed = json.loads(raw.data)["items"]
    mine = [e for e in listed if (e.get("regarding") or {}).get("kind") == contract.KIND and e["regarding"]["name"] == name]
    return sorted(mine, key=lambda e: (e.get("eventTime") or "", int(e["metadata"]["resourceVersion"])))


def test_kubectl_describe_tells_a_rollouts_story_in_order(operator, cluster, api_client, namespace) -> None:
    custom = client.CustomObjectsApi(api_client)
    name = "story"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name))
    first = wait_ready(custom, namespace, name)["status"]["revision"]
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                          {"spec": {"engine": {"image": "registry.example/vllm-runtime:0.33.0-next"}}})  # fmt: skip

    def complete() -> bool:
        obj = get_model(custom, namespace, name)
        status = obj.get("status") or {}
        return (status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("revision") != first
                and condition(obj, "Progressing").get("reason") == "Complete")  # fmt: skip

    wait_for("the rollout complete", complete, 180)
    reasons = wait_for("RolloutComplete recorded", lambda: (r := [e["reason"] for e in model_events(api_client, namespace, name)])
                       and "RolloutComplete" in r and r, 30)  # fmt: skip
    story = [r for r in reasons if r in ("RolloutStarted", "PodDraining", "PodRetired", "RevisionRetired", "RolloutComplete")]
    assert story[0] == "RolloutStarted" and story[-1] == "RolloutComplete", reasons
    assert story.index("PodDraining") < story.index("PodRetired") < story.index("RevisionRetired"), reasons
    assert story.count("PodDraining") == 2 and story.count("PodRetired") == 2, reasons  # the old prefill and decode
    # kwok's router pod runs no router: the operator cannot ask it and lets each old pod go at the (e2e-short)
    # drain timeout with a warning. While the router pod is Ready for less than status.ROUTER_START_GRACE_S the
    # operator takes it to be starting (RouterStarting: transient, no warning); past that it says once that it is
    # unreachable (a slow run gets there). Nothing else is worth a warning in a routine rollout.
    warnings = [(e["reason"], e.get("series")) for e in model_events(api_client, namespace, name) if e["type"] == "Warning"]
    assert "DrainTimedOut" in {r for r, _ in warnings}, warnings
    assert {r for r, _ in warnings} <= {"RouterUnreachable", "DrainTimedOut"}, warnings
    assert [r for r, _ in warnings].count("RouterUnreachable") <= 1 and not any(s for _, s in warnings), warnings
    kv = condition(get_model(custom, namespace, name), "KVTransferHealthy")
    assert kv.get("reason") in ("RouterStarting", "RouterUnreachable"), kv
    described = cluster.kubectl("describe", f"{PLURAL}/{name}", "-n", namespace).stdout
    for reason in ("RolloutStarted", "PodDraining", "PodRetired", "RolloutComplete"):
        assert reason in described, described[-3000:]


@dataclass
class Clock:
    now: float = 1_900_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_event_is_one_event_with_a_count(cluster, crd_installed, api_client, namespace) -> None:
    custom = client.CustomObjectsApi(api_client)
    model = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest("loud"))
    clock = Clock()
    recorder = EventRecorder(cluster.api_client(), instance="e2e", clock=clock)
    warning = Event("Conflict", "Apply", "0 of 3 changes made, then Pod p: the object has been modified")
    for _ in range(3):
        recorder.record(model, warning)
        clock.now += 5
    (event,) = [e for e in model_events(api_client, namespace, "loud") if e.get("reportingInstance") == "e2e"]
    assert event["reason"] == "Conflict" and event["type"] == "Warning" and event["series"]["count"] == 3, event
    clock.now += EventRecorder.SERIES_SECONDS  # long after: a new Event, not a count on the old one
    recorder.record(model, warning)
    assert len([e for e in model_events(api_client, namespace, "loud") if e.get("reportingInstance") == "e2e"]) == 2
