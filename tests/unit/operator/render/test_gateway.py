"""spec.gateway: admission refuses malformed references, and the InferencePool and HTTPRoute put the router pods
behind the parent Gateways (docs/gateway.md). The upstream CRDs judge the same objects in tests/e2e/test_gateway.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from disagg_connector import contract
from disagg_operator.api.models import LWEPP_IMAGE
from disagg_operator.api.validation import SpecError, parse
from disagg_operator import executor, planner
from disagg_operator.drift import needs_apply, stamped
from disagg_operator.executor import _problem
from disagg_operator.rbac import rules
from disagg_operator.render import INSTALL_HINTS, MANAGED_KINDS, render
from disagg_operator.render.gateway import HTTP_ROUTE_KIND, INFERENCE_POOL_KIND
from disagg_operator.state import Observed
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from tests.fixtures.models import dm
from tests.fixtures.planner import NOW, cond
from tests.fixtures.world import desired

GATEWAY = {"parentRefs": [{"name": "gw", "namespace": "infra", "sectionName": "https"}], "hostnames": ["m.example.com"]}


def children(gateway: dict[str, Any] | None, name: str = "m") -> dict[tuple[str, str], dict[str, Any]]:
    objects = render(parse(dm({"gateway": gateway} if gateway is not None else {}, name=name))).objects
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def problems(gateway: Any) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as raised:
        parse(dm({"gateway": gateway}))
    return [(p.path, p.message) for p in raised.value.problems]


def test_without_gateway_nothing_of_it_is_rendered() -> None:
    kinds = {kind for kind, _ in children(None)}
    assert not kinds & {INFERENCE_POOL_KIND, HTTP_ROUTE_KIND}
    assert ("Deployment", "m-lwepp") not in children(None)


def test_the_pool_is_the_router_pods_on_the_router_port() -> None:
    objs = children(GATEWAY)
    pool, router = objs[(INFERENCE_POOL_KIND, "m-router")], objs[("Deployment", "m-router")]
    # Exactly the router Deployment's pods: every revision's traffic goes through the router's own split.
    assert pool["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": contract.ROUTER_PORT}]
    assert router["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == contract.ROUTER_PORT
    assert "endpointPickerRef" not in pool["spec"]  # endpointPicker None: the gateway balances itself
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"


def test_the_route_goes_from_the_parents_to_the_pool() -> None:
    route = children(GATEWAY)[(HTTP_ROUTE_KIND, "m-route")]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw",
                                            "namespace": "infra", "sectionName": "https"}]  # fmt: skip
    assert route["spec"]["hostnames"] == ["m.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "m-router"}]


def test_a_parent_in_the_models_namespace_and_no_hostnames() -> None:
    route = children({"parentRefs": [{"name": "gw"}]})[(HTTP_ROUTE_KIND, "m-route")]
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}]
    assert "hostnames" not in route["spec"]


def test_lwepp_picks_for_the_pool_fail_closed_with_only_the_rights_it_needs() -> None:
    objs = children({**GATEWAY, "endpointPicker": "Lwepp"})
    pool = objs[(INFERENCE_POOL_KIND, "m-router")]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "m-lwepp",
                                                 "port": {"number": contract.LWEPP_GRPC_PORT}, "failureMode": "FailClose"}  # fmt: skip
    deploy, service = objs[("Deployment", "m-lwepp")], objs[("Service", "m-lwepp")]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == LWEPP_IMAGE
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == "m-router" and args[args.index("--pool-namespace") + 1] == "ns"
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["port"] == contract.LWEPP_GRPC_PORT
    # Its pods are not the model's: the router and the operator's census select on the model label.
    assert contract.LABEL_MODEL not in deploy["spec"]["template"]["metadata"]["labels"]
    role = objs[("Role", "m-lwepp")]
    assert {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]} == {
        ("", "pods"), ("inference.networking.k8s.io", "inferencepools")}
    assert all(rule["verbs"] == ["get", "list", "watch"] for rule in role["rules"])
    assert objs[("RoleBinding", "m-lwepp")]["subjects"][0]["name"] == deploy["spec"]["template"]["spec"]["serviceAccountName"]
    # The operator may grant what lwepp's Role holds only because it holds it itself (RBAC's escalation check).
    granted = {(g, r) for rule in rules() for g in rule["apiGroups"] for r in rule["resources"] if "watch" in rule["verbs"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted


def test_lwepp_image_can_be_set() -> None:
    objs = children({**GATEWAY, "endpointPicker": "Lwepp", "endpointPickerImage": "example.com/lwepp:dev"})
    assert objs[("Deployment", "m-lwepp")]["spec"]["template"]["spec"]["containers"][0]["image"] == "example.com/lwepp:dev"


def test_the_gateway_kinds_are_managed_and_granted() -> None:
    managed = {kind: (api_version, plural) for api_version, kind, plural in MANAGED_KINDS}
    assert managed[INFERENCE_POOL_KIND] == ("inference.networking.k8s.io/v1", "inferencepools")
    assert managed[HTTP_ROUTE_KIND] == ("gateway.networking.k8s.io/v1", "httproutes")
    granted = {(g, r) for rule in rules() for g in rule["apiGroups"] for r in rule["resources"] if "create" in rule["verbs"]}
    assert {("inference.networking.k8s.io", "inferencepools"), ("gateway.networking.k8s.io", "httproutes")} <= granted


def test_long_names_fit() -> None:
    name = "a-very-long-model-name-that-goes-on-and-on-and-on-and-on-x"
    for kind, child in children({**GATEWAY, "endpointPicker": "Lwepp"}, name=name):
        assert contract.is_dns_label(child), (kind, child)


@pytest.mark.parametrize("kind", [INFERENCE_POOL_KIND, HTTP_ROUTE_KIND])
def test_a_cluster_without_the_crds_says_what_to_install(kind: str) -> None:
    obj = children(GATEWAY)[(kind, "m-router" if kind == INFERENCE_POOL_KIND else "m-route")]
    problem = _problem(obj, ResourceNotFoundError("no such kind"))
    assert problem.reason == "KindNotInstalled"
    assert INSTALL_HINTS[kind] in problem.message and "remove spec.gateway" in problem.message


INVALID = [
    ("no-parents", {"parentRefs": []}, "spec.gateway.parentRefs", "at least 1"),
    ("parents-missing", {"hostnames": ["a.example.com"]}, "spec.gateway.parentRefs", "required"),
    ("parent-name-not-a-name", {"parentRefs": [{"name": "My_Gateway"}]}, "spec.gateway.parentRefs[0].name", "pattern"),
    ("parent-namespace-not-a-label", {"parentRefs": [{"name": "gw", "namespace": "infra.system"}]},
     "spec.gateway.parentRefs[0].namespace", "pattern"),
    ("section-not-a-name", {"parentRefs": [{"name": "gw", "sectionName": "HTTPS"}]},
     "spec.gateway.parentRefs[0].sectionName", "pattern"),
    ("parent-twice", {"parentRefs": [{"name": "gw"}, {"name": "gw"}]}, "spec.gateway.parentRefs", "twice"),
    ("listener-twice", {"parentRefs": [{"name": "gw", "sectionName": "a"}, {"name": "gw", "sectionName": "a"}]},
     "spec.gateway.parentRefs", "twice"),
    ("whole-gateway-and-listener", {"parentRefs": [{"name": "gw"}, {"name": "gw", "sectionName": "a"}]},
     "spec.gateway.parentRefs", "sectionName on each"),
    ("hostname-with-port", {"parentRefs": [{"name": "gw"}], "hostnames": ["m.example.com:443"]},
     "spec.gateway.hostnames[0]", "pattern"),
    ("hostname-ip-like-upper", {"parentRefs": [{"name": "gw"}], "hostnames": ["M.Example.com"]},
     "spec.gateway.hostnames[0]", "pattern"),
    ("hostname-twice", {"parentRefs": [{"name": "gw"}], "hostnames": ["a.example.com", "a.example.com"]},
     "spec.gateway.hostnames", "repeats"),
    ("unknown-picker", {"parentRefs": [{"name": "gw"}], "endpointPicker": "llm-d"}, "spec.gateway.endpointPicker", "None"),
    ("picker-image-without-lwepp", {"parentRefs": [{"name": "gw"}], "endpointPickerImage": "x/lwepp:1"},
     "spec.gateway.endpointPickerImage", "set endpointPicker to Lwepp"),
    ("unknown-field", {"parentRefs": [{"name": "gw", "port": 80}]}, "spec.gateway.parentRefs[0].port", "unknown field"),
]


@pytest.mark.parametrize(("gateway", "path", "phrase"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_malformed_gateway_is_refused_with_the_field(gateway: dict, path: str, phrase: str) -> None:
    found = problems(gateway)
    assert any(p == path and phrase in m for p, m in found), found


@pytest.mark.parametrize("gateway", [
    {"parentRefs": [{"name": "gw", "sectionName": "a"}, {"name": "gw", "sectionName": "b"}]},
    {"parentRefs": [{"name": "gw"}, {"name": "gw", "namespace": "other"}]},
    {"parentRefs": [{"name": "gw"}], "hostnames": ["*.example.com", "example.com"]},
    {"parentRefs": [{"name": "gw"}], "endpointPicker": "Lwepp", "endpointPickerImage": "x/lwepp:1"},
])  # fmt: skip
def test_valid_gateways_are_accepted(gateway: dict) -> None:
    assert parse(dm({"gateway": gateway})).spec.gateway is not None


def test_the_api_servers_defaults_are_no_drift() -> None:
    """What the upstream CRDs default (a backend's weight, the picker's group and kind) is not a change to undo:
    in steady state the operator writes neither object again."""
    objs = children({**GATEWAY, "endpointPicker": "Lwepp"})
    pool, route = (stamped(objs[k]) for k in ((INFERENCE_POOL_KIND, "m-router"), (HTTP_ROUTE_KIND, "m-route")))
    live_pool, live_route = copy.deepcopy(pool), copy.deepcopy(route)
    live_pool["spec"]["endpointPickerRef"]["group"] = ""
    live_pool["status"] = {"parents": []}
    live_route["spec"]["rules"][0]["backendRefs"][0]["weight"] = 1
    assert not needs_apply(pool, live_pool) and not needs_apply(route, live_route)
    live_route["spec"]["rules"][0]["backendRefs"][0]["name"] = "edited-by-hand"
    assert needs_apply(route, live_route)


def test_a_new_revision_leaves_pool_and_route_alone() -> None:
    """The revision split is the router's (by ready pairs, per request): a rollout changes neither object, so the
    gateway never routes by a weight older than the router's."""
    before = render(parse(dm({"gateway": GATEWAY})))
    after = render(parse(dm({"gateway": GATEWAY, "engine": {"image": "registry.example/vllm:next"}})))
    assert before.revision != after.revision
    for kind in (INFERENCE_POOL_KIND, HTTP_ROUTE_KIND):
        assert [o for o in before.objects if o["kind"] == kind] == [o for o in after.objects if o["kind"] == kind]


class NoGatewayCrdsCluster:
    """A cluster without the inference extension's and Gateway API's CRDs: discovery finds neither kind."""

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if obj["kind"] in (INFERENCE_POOL_KIND, HTTP_ROUTE_KIND):
            raise ResourceNotFoundError(f"No matches found for {{'api_version': '{obj['apiVersion']}', 'kind': '{obj['kind']}'}}")
        return None

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        return self.get(obj) or obj


def test_without_the_crds_nothing_is_written_and_status_says_what_to_install() -> None:
    """A model that asks for a gateway is not served without one: nothing of it is written, and Ready says why."""
    want = desired({"gateway": GATEWAY})
    tentative = planner.plan(want, Observed(), NOW)
    assert {INFERENCE_POOL_KIND, HTTP_ROUTE_KIND} <= {a.obj["kind"] for a in tentative.applies}
    probes = executor.probe(tentative, NoGatewayCrdsCluster(), "uid-1")  # type: ignore[arg-type]
    final = planner.plan(want, Observed().with_probes(probes.foreign, probes.refused), NOW)
    assert final.actions == ()
    ready = cond(final.status, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "KindNotInstalled"
    assert "InferencePool" in ready["message"] and "remove spec.gateway" in ready["message"]
