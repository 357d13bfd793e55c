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
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg_connector import contract
from disagg_operator.api.validation import SpecError, parse

from tests.fixtures.strategies import BREAKERS, CHILD_BREAKERS, models
from tests.fixtures.e2e.waiting import condition, wait_for

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
BATCH, BATCHES = 25, 8  # hypothesis cannot draw 200 models in one example (its buffer): 8 examples of 25
TALLY: Counter[str] = Counter()  # what the batches applied, checked by the test after them


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


def _offline_problems(obj: dict[str, Any]) -> list[str]:
    try:
        parse(obj)
    except SpecError as error:
        return [str(p) for p in error.problems]
    return []


@settings(max_examples=BATCHES, deadline=None, phases=[Phase.generate], database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                 HealthCheck.function_scoped_fixture])
@given(st.lists(cases(), min_size=BATCH, max_size=BATCH))
def test_live_fuzz(operator, api_client, generated: list[tuple[str, dict[str, Any]]]) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    pid = operator.proc.pid
    namespaces = [f"fuzz-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    for ns in namespaces:
        core.create_namespace({"metadata": {"name": ns}})
    admitted: dict[tuple[str, str], str] = {}
    disagreements = []
    try:
        for i, (kind, obj) in enumerate(generated):
            ns = namespaces[i % len(namespaces)]
            obj = {**copy.deepcopy(obj), "metadata": {"name": f"fz{i}"}}
            problems = _offline_problems({**obj, "metadata": {"name": f"fz{i}", "namespace": ns, "uid": "u"}})
            offline = not problems
            refusal = ""
            try:
                # Strict, as kubectl sends it: unknown fields are refused, not silently pruned.
                custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, obj, field_validation="Strict")
                server = True
            except ApiException as error:
                assert error.status in (400, 422), error.body  # 400: an unknown field (strict decoding)
                server, refusal = False, error.body
            if server != offline:
                disagreements.append({"kind": kind, "offline": problems, "server": refusal or "admitted", "spec": obj["spec"]})
            if server:
                admitted[(ns, f"fz{i}")] = kind
        assert not disagreements, "\n".join(f"{d['kind']}: offline {d['offline']}; server {d['server']}" for d in disagreements)
        TALLY.update(kind for kind, _ in generated)
        TALLY.update(f"admitted {kind}" for kind in admitted.values())

        def statuses() -> dict[tuple[str, str], dict[str, Any]]:
            found = {}
            for ns in namespaces:
                for item in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]:
                    status = item.get("status") or {}
                    if status.get("observedGeneration") == item["metadata"]["generation"] and condition(item, "Ready"):
                        found[(ns, item["metadata"]["name"])] = item
            return found

        def all_have_status() -> dict[tuple[str, str], dict[str, Any]] | None:
            found = statuses()
            return found if set(admitted) <= set(found) else None

        seen = wait_for(f"a status on each of {len(admitted)} admitted models", all_have_status, 120, interval=1)
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


def test_the_fuzz_covered_every_kind() -> None:
    """Runs after test_live_fuzz (file order): the batches together applied 200 specs of every kind."""
    assert sum(TALLY[k] for k in ("valid", "invalid", "child-refused")) == BATCH * BATCHES, TALLY
    assert TALLY["admitted valid"] >= 20 and TALLY["admitted child-refused"] >= 20 and TALLY["invalid"] >= 20, TALLY
    assert not TALLY["admitted invalid"], TALLY
