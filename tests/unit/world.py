"""Builders of desired and observed worlds for the planner and status tests: children as the API server
would return them (the rendered manifests, stamped, with a uid and status), pods of a revision."""

from __future__ import annotations

import copy
import itertools
from typing import Any, Iterable

from disagg_connector import contract
from disagg_operator.api.validation import parse
from disagg_operator.drift import stamped
from disagg_operator.render import render
from disagg_operator.state import Desired, ModelRef, Observed, key_of

from ..conftest import dm

UID = "uid-1"
_uids = itertools.count(1)


def desired(patch: dict[str, Any] | None = None, previous: dict[str, Any] | None = None, generation: int = 3) -> Desired:
    model = parse(dm(patch, uid=UID))
    return Desired(ModelRef("ns", "m", UID, generation), model, render(model), previous)


def live(obj: dict[str, Any], **status: Any) -> dict[str, Any]:
    """A child as the API server stores it: what we applied, plus a uid and a status."""
    out = copy.deepcopy(stamped(obj))
    out["metadata"]["uid"] = f"child-{next(_uids)}"
    out["metadata"]["resourceVersion"] = "1"
    if status:
        out["status"] = status
    return out


def children(world: Desired, kinds: Iterable[str] | None = None, gangs: bool = False) -> dict[tuple[str, str], dict[str, Any]]:
    """The rendered children as stored; PodGroups only with `gangs` (an API server that serves them: the planner
    makes them only then), each bound by the scheduler once (its pods are there)."""
    bound = {"conditions": [{"type": "PodGroupInitiallyScheduled", "status": "True", "reason": "Scheduled"}]}
    return {key_of(o): live(o, **(bound if o["kind"] == "PodGroup" else {})) for o in world.rendered.objects
            if (kinds is None or o["kind"] in kinds) and (gangs or o["kind"] != "PodGroup")}


def pod(role: str, name: str, revision: str | None, ready: bool = True, **status: Any) -> dict[str, Any]:
    labels = contract.child_labels("m", role, revision if role != "router" else None)
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "ns", "labels": labels, "uid": f"pod-{name}"},
            "status": {"conditions": conditions, **status}}  # fmt: skip


def serving_pods(revision: str, prefill: int = 1, decode: int = 1, routers: int = 2, ready: bool = True) -> tuple[dict[str, Any], ...]:
    return (
        *(pod("prefill", f"p-{revision}-{i}", revision, ready) for i in range(prefill)),
        *(pod("decode", f"d-{revision}-{i}", revision, ready) for i in range(decode)),
        *(pod("router", f"r-{i}", None) for i in range(routers)),
    )


def with_role_status(observed: Observed, revision: str) -> Observed:
    """The DisaggregatedRoles carrying the status the operator writes for these pods."""
    out = dict(observed.children)
    for key, obj in observed.children.items():
        if key[0] != contract.ROLE_KIND:
            continue
        role = obj["metadata"]["labels"][contract.LABEL_ROLE]
        pods = [p for p in observed.pods if p["metadata"]["labels"].get(contract.LABEL_ROLE) == role]
        ready = sum(1 for p in pods if p["status"]["conditions"][0]["status"] == "True")
        selector = ",".join(f"{k}={v}" for k, v in contract.selector_labels("m", role).items())
        out[key] = {**obj, "status": {"replicas": len(pods), "readyReplicas": ready, "selector": selector, "revision": revision}}
    return Observed(out, observed.pods, observed.foreign, observed.refused)


def steady(world: Desired) -> Observed:
    """Everything applied and serving."""
    return with_role_status(Observed(children=children(world), pods=serving_pods(world.revision)), world.revision)


def deployment_of(observed: Observed, role: str, revision: str | None = None) -> dict[str, Any]:
    return next(d for d in observed.workloads if d["metadata"]["labels"].get(contract.LABEL_ROLE) == role
                and (revision is None or d["metadata"]["labels"].get(contract.LABEL_REVISION) == revision))
