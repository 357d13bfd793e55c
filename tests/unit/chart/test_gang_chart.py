"""The chart's gang admission policy (templates/gang-policy.yaml), rendered by the real helm: only where the
cluster serves PodGroups and MutatingAdmissionPolicies, selecting the pods the operator labels and naming the
PodGroups the operator makes (contract.py's names; render/gang.py). tests/e2e/test_gang_scheduling.py installs
this same rendering on the real API server and scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg_connector import contract
from disagg_operator import gangs
from disagg_operator.render import gang

from tests.fixtures.helm import CHART, helm, values_args

SERVED = ("--api-versions", "scheduling.k8s.io/v1beta1/PodGroup",
          "--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")  # fmt: skip


def rendered(*args: str) -> list[dict]:
    return helm("template", "rel", str(CHART), "--namespace", "ops", *args).docs()


def policies(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"].startswith("MutatingAdmissionPolicy")]


def test_the_policy_puts_the_operators_pods_in_the_pod_groups_it_makes() -> None:
    """The names the policy reads are contract.py's (the e2e shows the policy at work on the API server)."""
    policy, binding = policies(rendered(*SERVED))
    assert binding["spec"] == {"policyName": policy["metadata"]["name"]}
    selector = policy["spec"]["matchConstraints"]["objectSelector"]["matchExpressions"]
    assert selector == [{"key": contract.LABEL_GANG, "operator": "In", "values": [contract.GANG_LWS_GROUP, contract.GANG_PAIR]}]
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    expression = policy["spec"]["mutations"][0]["applyConfiguration"]["expression"]
    assert f"variables.inPair ? object.metadata.labels['{contract.LABEL_POD_GROUP}'] : variables.leader" in expression
    # an LWS pod's group: the leader's own name, a worker's leader-name annotation: gang.pod_group_name's <lws>-<index>
    assert f"'{contract.LWS_LEADER_NAME_ANNOTATION}'" in variables["leader"] and "object.metadata.name" in variables["leader"]
    # the pair: a one-pod engine's pods, and group 0's (gang.pod_groups leaves group 0 to the pair)
    assert f"== '{contract.GANG_PAIR}'" in variables["inPair"]
    assert f"variables.leader == object.metadata.labels['{contract.LWS_NAME_LABEL}'] + '-0'" in variables["inPair"]
    assert gang.pod_group_name("m-decode-abc", 3) == "m-decode-abc-3"
    assert gang.POD_GROUP_API_VERSION == "scheduling.k8s.io/v1beta1"


@pytest.mark.parametrize("args", [(), SERVED[:2], SERVED[2:]], ids=["neither", "podgroups-only", "policies-only"])
def test_no_policy_where_the_cluster_cannot_use_it(args: tuple[str, ...]) -> None:
    assert policies(rendered(*args)) == []


def test_the_policy_can_be_turned_off(tmp_path: Path) -> None:
    off = values_args({"gangScheduling": {"admissionPolicy": {"enabled": False}}}, tmp_path)
    assert policies(rendered(*SERVED, *off)) == []


def test_validate_and_plan_read_the_charts_policy_as_covering_both_gangs() -> None:
    """`disagg-operator validate --cluster` and `plan --from-cluster` judge a cluster's policies with
    gangs.policy_covers: the chart's covers both labels; without its binding, or of another shape, none."""
    policy, binding = policies(rendered(*SERVED))
    assert gangs.policy_covers([policy], [binding]) == {contract.GANG_LWS_GROUP, contract.GANG_PAIR}
    assert gangs.policy_covers([policy], []) == frozenset()  # not bound: it does nothing
    other = {**policy, "spec": {**policy["spec"], "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": "[]"}}]}}
    assert gangs.policy_covers([other], [binding]) == frozenset()
