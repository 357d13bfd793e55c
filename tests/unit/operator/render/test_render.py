"""Rendering: golden manifests of the examples, and the invariants every rendering must keep."""

from __future__ import annotations

import os

import pytest

from disagg_connector import contract
from disagg_operator.api.validation import parse
from disagg_operator.manifests import dump_all
from disagg_operator.render import gang, render

from tests.fixtures.models import EXAMPLES, REPO, dm, load_example
from tests.fixtures.render import by_kind, check_invariants, engine_container, kv_config

GOLDEN = REPO / "tests" / "golden"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_golden(path) -> None:
    """Reviewed by eye once; regenerate with DISAGG_UPDATE_GOLDEN=1 and review the diff."""
    rendered = dump_all(render(parse(load_example(path))).objects)
    golden = GOLDEN / f"{path.stem}.yaml"
    if os.environ.get("DISAGG_UPDATE_GOLDEN") == "1":
        golden.write_text(rendered)
    assert golden.read_text() == rendered


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_keep_invariants(path) -> None:
    check_invariants(load_example(path))


def test_children_of_a_model() -> None:
    objects = render(parse(dm())).objects
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    revision = render(parse(dm())).revision
    assert kinds == sorted([
        ("Deployment", f"m-prefill-{revision}"), ("Deployment", f"m-decode-{revision}"), ("Deployment", "m-router"),
        ("Service", "m-prefill"), ("Service", "m-decode"), ("Service", "m-router"),
        ("PodDisruptionBudget", "m-prefill"), ("PodDisruptionBudget", "m-decode"), ("PodDisruptionBudget", "m-router"),
        ("ServiceAccount", "m-router"), ("Role", "m-router"), ("RoleBinding", "m-router"),
        ("NetworkPolicy", "m-engines"), (contract.ROLE_KIND, "m-prefill"), (contract.ROLE_KIND, "m-decode"),
        ("PodGroup", f"m-{revision}-pair"),  # applied only where the cluster serves PodGroups (the planner's call)
    ])  # fmt: skip


def test_long_names_fit_and_stay_distinct() -> None:
    a = render(parse(dm(name="a" * 200 + "-one"))).objects
    b = render(parse(dm(name="a" * 200 + "-two"))).objects
    names_a = {o["metadata"]["name"] for o in a}
    names_b = {o["metadata"]["name"] for o in b}
    assert all(len(n) <= 63 for n in names_a | names_b)
    assert not names_a & names_b
    check_invariants(dm(name="b" * 253))


def test_revision_follows_what_p_and_d_share_but_not_replicas() -> None:
    base = render(parse(dm())).revision
    assert render(parse(dm({"prefill": {"replicas": 5}}))).revision == base
    assert render(parse(dm({"engine": {"image": "other:1"}}))).revision != base
    assert render(parse(dm({"engine": {"blockSize": 64}}))).revision != base
    assert render(parse(dm({"kvTransfer": {"mode": "Pull"}}))).revision != base


def test_push_and_pull_wiring() -> None:
    push = render(parse(dm({"kvTransfer": {"mode": "Push"}}))).objects
    pull = render(parse(dm({"kvTransfer": {"mode": "Pull", "bidirectional": True}}))).objects
    assert kv_config(engine_container(push, "decode"))["kv_connector"] == "NixlPushConnector"
    pull_cfg = kv_config(engine_container(pull, "prefill"))
    assert pull_cfg["kv_connector"] == "NixlConnector"
    assert pull_cfg["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    routers = [by_kind(objs, "Deployment")[-1] for objs in (push, pull)]
    assert routers[0]["spec"] == routers[1]["spec"], "a Push <-> Pull change does not restart the routers"
    assert "--mode" not in routers[0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_efa_wiring() -> None:
    efa = {"efa": {"count": 4}, "resources": {"requests": {"memory": "64Gi"}}}
    objects = render(parse(dm({"prefill": efa, "decode": efa}))).objects
    container = engine_container(objects, "prefill")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_HUGE_PAGE"] == "1"
    assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == "4"
    assert container["resources"]["limits"]["hugepages-2Mi"] == "5120Mi"
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert kv_config(container)["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]
    (policy,) = by_kind(objects, "NetworkPolicy")
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 5600}]

    privileged = render(parse(dm({"prefill": efa, "decode": efa, "network": {"efa": {"privileged": True}}}))).objects
    assert engine_container(privileged, "decode")["securityContext"] == {"privileged": True}

    plain = engine_container(render(parse(dm())).objects, "prefill")
    assert "securityContext" not in plain and not any(e["name"].startswith("FI_") for e in plain["env"])


def test_engines_pre_stop_waits_for_idle_within_the_grace_period() -> None:
    """The vllm container's preStop is disagg-drain on the engine's own port, bounded by the grace period
    less the margin vLLM's shutdown needs; its router deadline plays no part (streams outlive it)."""
    from disagg_operator.render.engine import SHUTDOWN_MARGIN_SECONDS

    for grace, deadline in ((120, 120 - SHUTDOWN_MARGIN_SECONDS), (3600, 3600 - SHUTDOWN_MARGIN_SECONDS), (5, 0), (0, 0)):
        objects = render(parse(dm({"engine": {"terminationGracePeriodSeconds": grace}, "router": {"requestDeadlineSeconds": 5}}))).objects
        for role in contract.ENGINE_ROLES:
            (deploy,) = [d for d in by_kind(objects, "Deployment") if d["metadata"]["labels"].get(contract.LABEL_ROLE) == role]
            pod = deploy["spec"]["template"]["spec"]
            assert pod["terminationGracePeriodSeconds"] == grace
            assert pod["containers"][0]["lifecycle"] == {"preStop": {"exec": {"command": [
                contract.DRAIN_COMMAND, "--port", str(contract.HTTP_PORT), "--deadline-seconds", str(deadline)]}}}  # fmt: skip
    assert 10 <= SHUTDOWN_MARGIN_SECONDS < 120, "the default grace period leaves the preStop most of its time"


def test_network_policy_lets_only_router_reach_http() -> None:
    # Without KV events (prefill policy LeastOutstanding) the router's rule is vLLM's HTTP port alone.
    (policy,) = by_kind(render(parse(dm({"router": {"prefillPolicy": "LeastOutstanding"}}))).objects, "NetworkPolicy")
    http_rules = [r for r in policy["spec"]["ingress"] if r.get("ports") == [{"protocol": "TCP", "port": 8000}]]
    (rule,) = http_rules
    assert rule["from"][0]["podSelector"]["matchExpressions"][0]["values"] == ["router"]
    assert not by_kind(render(parse(dm({"network": {"networkPolicy": {"enabled": False}}}))).objects, "NetworkPolicy")


WAITING = {"type": "Pods", "pods": {"metric": {"name": "vllm:num_requests_waiting"},
                                     "target": {"type": "AverageValue", "averageValue": "4"}}}


def test_each_role_has_a_scale_target_and_autoscaling_an_hpa_on_it() -> None:
    objects = render(parse(dm({"decode": {"replicas": 9, "autoscaling": {"minReplicas": 2, "maxReplicas": 6,
                                                                        "metrics": [WAITING]}}}))).objects
    scalers = {o["metadata"]["name"]: o for o in by_kind(objects, contract.ROLE_KIND)}
    assert set(scalers) == {"m-prefill", "m-decode"}, "one per role, no revision in the name"
    assert scalers["m-decode"]["spec"]["replicas"] == 6, "the initial size within the HPA's bounds"
    (hpa,) = by_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "disagg.dev/v1alpha1", "kind": contract.ROLE_KIND, "name": "m-decode"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"], hpa["spec"]["metrics"]) == (2, 6, [WAITING])
    assert not [o for o in by_kind(objects, "HorizontalPodAutoscaler") if o["metadata"]["name"] == "m-prefill"]


@pytest.mark.parametrize("pair_gang", [True, False])
def test_every_role_with_autoscaling_gets_its_hpa(pair_gang: bool) -> None:
    """Whichever roles autoscale, with or without a pair PodGroup (063ad76 rendered only the last role's HPA, and
    only with one: prefill's never)."""
    scaled = {"autoscaling": {"minReplicas": 1, "maxReplicas": 4, "metrics": [WAITING]}}
    spec = {"prefill": scaled, "decode": scaled, **({} if pair_gang else {"decode": {**scaled, "priorityClassName": "low"}})}
    model = parse(dm(spec))
    assert gang.pairs(model) == pair_gang
    hpas = by_kind(render(model).objects, "HorizontalPodAutoscaler")
    assert sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas) == ["m-decode", "m-prefill"]


def test_data_parallel_ports_and_identity() -> None:
    objects = render(parse(dm({"decode": {"parallelism": {"data": 4}, "accelerator": {"count": 4}}}))).objects
    container = engine_container(objects, "decode")
    ranks = range(4)
    assert [p["containerPort"] for p in container["ports"]] == [
        8000, *(5600 + r for r in ranks), *(contract.KV_EVENTS_PORT + r for r in ranks),
        *(contract.KV_EVENTS_REPLAY_PORT + r for r in ranks)]  # fmt: skip
    (deploy,) = [d for d in by_kind(objects, "Deployment") if d["metadata"]["labels"].get(contract.LABEL_ROLE) == "decode"]
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    identities = contract.identities_from_pod("m-decode-x", "u", "10.0.0.1", annotations)
    assert [(i.engine_id, i.side_channel_port) for i in identities] == [
        (f"m-decode-x.u_dp{r}", 5600 + r) for r in range(4)
    ]


def test_printed_manifests_keep_hash_labels_strings_for_yaml_1_2_readers() -> None:
    """kubectl reads an unquoted 8132e40521 as a number (YAML 1.2); PyYAML would not quote it."""
    labels = {contract.LABEL_REVISION: "8132e40521", "zero": "0109345567", "octal": "0o17", "other": "0231f32d94"}
    text = dump_all([{"metadata": {"labels": labels}}])
    assert "'8132e40521'" in text and "'0109345567'" in text and "'0o17'" in text


def test_the_operator_reaches_the_routers_and_nothing_more() -> None:
    """The operator asks each router pod's /health on the router port; the engines' policy selects only engine
    pods (the operator never talks to an engine), so no rendered policy stands between operator and router."""
    (policy,) = by_kind(render(parse(dm())).objects, "NetworkPolicy")
    selected = policy["spec"]["podSelector"]["matchExpressions"]
    assert selected == [{"key": contract.LABEL_ROLE, "operator": "In", "values": list(contract.ENGINE_ROLES)}]
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert all(p["podSelector"]["matchLabels"] == {contract.LABEL_MODEL: "m"} for p in peers), "only this model's own pods"
