"""A revision's first prefill and decode pods are bound together or not at all (render/gang.py, the pair
PodGroup), where the cluster serves PodGroups: a half pair serves nothing and holds its accelerators. Pure:
planner and render on worlds of tests/fixtures/world.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from disagg_connector import contract
from disagg_operator import planner
from disagg_operator.state import Observed

from tests.fixtures.planner import NOW, cond
from tests.fixtures.world import children, desired, serving_pods, steady, with_role_status

ONE_POD = desired()
NEW_IMAGE = desired({"engine": {"image": "registry.example/vllm:new"}})


def pair_groups(plan: planner.Plan, action: type = planner.Apply) -> list[dict[str, Any]]:
    return [a.obj for a in plan.actions if isinstance(a, action) and a.obj["kind"] == "PodGroup"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def test_a_revisions_first_pair_is_one_pod_group_made_before_its_pods() -> None:
    plan = planner.plan(ONE_POD, Observed(pod_groups_served=True), NOW)
    (group,) = pair_groups(plan)
    name = contract.pair_pod_group_name("m", ONE_POD.revision)
    assert group["metadata"]["name"] == name
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": 2}}}  # one prefill and one decode pod
    kinds = [a.obj["kind"] for a in plan.applies]
    assert kinds.index("PodGroup") < kinds.index("Deployment")
    engines = [a.obj for a in plan.applies if a.obj["kind"] == "Deployment" and a.obj["metadata"]["labels"].get(contract.LABEL_ROLE) != "router"]
    assert len(engines) == 2
    for deployment in engines:  # what the chart's policy reads to put each pod in the group
        assert pod_labels(deployment)[contract.LABEL_GANG] == contract.GANG_PAIR
        assert pod_labels(deployment)[contract.LABEL_POD_GROUP] == name
    gang = cond(plan.status, "GangScheduled")
    assert (gang["status"], gang["reason"]) == ("True", "PodGroups")


def test_without_pod_groups_served_nothing_is_made_and_nothing_said() -> None:
    plan = planner.plan(ONE_POD, Observed(pod_groups_served=False), NOW)
    assert not pair_groups(plan)
    assert "GangScheduled" not in {c["type"] for c in plan.status["conditions"]}  # the usual case today: no news


def test_a_role_scaled_to_zero_does_not_hold_the_other_back() -> None:
    zero = desired({"decode": {"replicas": 0}})
    (group,) = pair_groups(planner.plan(zero, Observed(pod_groups_served=True), NOW))
    assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == 1


def test_roles_of_different_priorities_are_not_one_gang() -> None:
    """A PodGroup's pods must share its priority: no pair, and no pod labelled for one."""
    apart = desired({"prefill": {"priorityClassName": "batch"}})
    plan = planner.plan(apart, Observed(pod_groups_served=True), NOW)
    assert not pair_groups(plan)
    assert all(contract.LABEL_GANG not in pod_labels(a.obj) for a in plan.applies if a.obj["kind"] == "Deployment")


def test_steady_with_its_pod_group_writes_nothing() -> None:
    world = steady(ONE_POD)
    served = replace(world, children={**world.children, **children(ONE_POD, kinds=["PodGroup"], gangs=True)}, pod_groups_served=True)
    assert planner.plan(ONE_POD, served, NOW).actions == ()


def test_an_old_revisions_pair_stays_while_its_engines_do_and_goes_with_them() -> None:
    old = children(ONE_POD, kinds=["Deployment", "PodGroup"], gangs=True)
    old = {k: o for k, o in old.items() if o["metadata"]["labels"].get(contract.LABEL_ROLE) != "router"}
    old_group = ("PodGroup", contract.pair_pod_group_name("m", ONE_POD.revision))
    new = with_role_status(Observed(children(NEW_IMAGE, gangs=True), serving_pods(NEW_IMAGE.revision)), NEW_IMAGE.revision)

    # the old revision still serves: its PodGroup stays (a pod of it may be recreated)
    rolling = replace(new, children={**old, **new.children}, pods=new.pods + serving_pods(ONE_POD.revision, routers=0),
                      pod_groups_served=True)
    assert old_group not in {key for key in (planner.key_of(o) for o in pair_groups(planner.plan(NEW_IMAGE, rolling, NOW), planner.Delete))}

    # its pods are gone: its Deployments are retired and its PodGroup with them
    done = replace(new, children={**old, **new.children}, pod_groups_served=True)
    plan = planner.plan(NEW_IMAGE, done, NOW)
    assert [planner.key_of(o) for o in pair_groups(plan, planner.Delete)] == [old_group]
    assert not pair_groups(plan)  # the new revision's is in place
