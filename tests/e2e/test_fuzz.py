"""A live fuzz: 200 generated DisaggregatedModels applied to the real API server with the operator running.

A third are valid, a third break one admission rule, a third pass admission but hold a free-form field
that makes the API server refuse a child. What must hold for every one: the API server and the offline
validator (`disagg-operator validate`) agree on admission; every admitted model gets a status for its
generation; a refused child is reported as ChildRejected with nothing of that model written; no pass ends
in an internal error; the operator process never restarts.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg_connector import contract
from disagg_operator.api.validation import SpecError, parse

from ..strategies import BREAKERS, CHILD_BREAKERS, models
from .waiting import condition, wait_for

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
COUNT = 200


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    obj = draw(models())
    # Small sizes: the fuzz is about verdicts and status, not about scheduling hundreds of pods.
    for role in ("prefill", "decode"):
        obj["spec"][role]["replicas"] = draw(st.integers(0, 1))
        obj["spec"][role].pop("autoscaling", None)
    obj["spec"]["router"]["replicas"] = draw(st.integers(0, 1))
    kind = draw(st.sampled_from(["valid", "invalid", "child-refused"]))
    if kind == "invalid":
        _, mutations, _ = draw(st.sampled_from(BREAKERS))
    elif kind == "child-refused":
        _, mutations = draw(st.sampled_from(CHILD_BREAKERS))
    else:
        mutations = []
    for mutate in mutations:
        mutate(obj)
    return kind, obj


def _offline_verdict(obj: dict[str, Any]) -> bool:
    try:
        parse(obj)
    except SpecError:
        return False
    return True


@settings(max_examples=1, deadline=None, phases=[Phase.generate], database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(st.lists(cases(), min_size=COUNT, max_size=COUNT))
def test_live_fuzz(operator, api_client, generated: list[tuple[str, dict[str, Any]]]) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    pid = operator.proc.pid
    namespaces = [f"fuzz-{uuid.uuid4().hex[:6]}" for _ in range(4)]
    for ns in namespaces:
        core.create_namespace({"metadata": {"name": ns}})
    admitted: dict[tuple[str, str], str] = {}
    disagreements = []
    try:
        for i, (kind, obj) in enumerate(generated):
            ns = namespaces[i % len(namespaces)]
            obj = {**copy.deepcopy(obj), "metadata": {"name": f"fz{i}"}}
            offline = _offline_verdict({**obj, "metadata": {"name": f"fz{i}", "namespace": ns, "uid": "u"}})
            try:
                custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, obj)
                server = True
            except ApiException as error:
                assert error.status == 422, error.body
                server = False
            if server != offline:
                disagreements.append((kind, obj["spec"], server))
            if server:
                admitted[(ns, f"fz{i}")] = kind
        assert not disagreements, disagreements[:3]
        assert sum(1 for k in admitted.values() if k == "child-refused") >= 10, "the fuzz reached the child refusals"

        def statuses() -> dict[tuple[str, str], dict[str, Any]]:
            found = {}
            for ns in namespaces:
                for item in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]:
                    status = item.get("status") or {}
                    if status.get("observedGeneration") == item["metadata"]["generation"] and condition(item, "Ready"):
                        found[(ns, item["metadata"]["name"])] = item
            return found

        seen = wait_for(f"a status on each of {len(admitted)} admitted models",
                        lambda: (s := statuses()) if set(admitted) <= set(s) else None, 300, interval=2)
        reasons = {key: condition(seen[key], "Ready").get("reason") for key in admitted}
        assert "InternalError" not in reasons.values(), [k for k, r in reasons.items() if r == "InternalError"]
        for key, kind in admitted.items():
            if kind == "child-refused":
                assert reasons[key] == "ChildRejected", (key, reasons[key], condition(seen[key], "Ready").get("message"))
                apps = client.AppsV1Api(api_client)
                owned = [d for d in apps.list_namespaced_deployment(key[0]).items
                         if (d.metadata.labels or {}).get(contract.LABEL_MODEL) == key[1]]
                assert not owned, f"{key}: a refused pass wrote nothing"
        time.sleep(1)
        assert operator.alive() and operator.proc.pid == pid, "the operator never restarts"
    finally:
        for ns in namespaces:
            core.delete_namespace(ns, propagation_policy="Background")
