"""Lease-aware retirement: which pods of a Deployment leave, and when. Pure.

A Deployment that must shrink (an old revision in a rollout, or scale-in) loses exactly the pods chosen
here, and a ready pod only once no request is left on it:

1. Pods that are not ready go first: no router sends them anything, and the ReplicaSet controller removes
   not-ready pods before ready ones anyway. Pods not created yet count the same.
2. Each further pod to go is **marked draining** (`contract.ANNOTATION_DRAINING` = the time of marking). The
   router sends it no new request and reports its in-flight count on /health.
3. A marked pod is **drained** when it is idle: every ready router reports it draining with nothing in flight
   (or does not route to it at all), streams included, or no router is ready (nothing can reach it). Only
   when that cannot be known does a bound end the wait (`bound_s`, counted from the mark): for a decode,
   `spec.rollout.drainTimeoutSeconds` (a router that never answers, a stream that never ends); a decode
   streams for as long as generation runs, so no request deadline bounds it. For a prefill, the router's leg
   deadline plus the KV lease when that is shorter: its own leg ends within the deadline, and no decode can
   read its KV after the lease.
4. A drained pod gets the lowest **pod-deletion-cost** (`controller.kubernetes.io/pod-deletion-cost`), and
   only when that annotation is observed does the Deployment shrink: the ReplicaSet controller removes, among
   ready pods, those of lowest cost first, so it removes exactly the drained pods. (Why not delete the pod:
   its ReplicaSet would replace it at once. Why two passes: the ReplicaSet controller must see the cost
   before it picks.)

A pod marked draining that no longer has to go (the target rose again) is unmarked, unless its controller is
removing it already: the workload was shrunk past it and the pod is not terminating yet (`_removed_now`). Unmarked
then, a router would send it new requests in the moment before it goes, and a ReplicaSet that had not picked yet
would pick by deletion cost among pods that no longer carry it.

**Engines that span pods** (a LeaderWorkerSet, one group per engine) leave a group at a time, and the LWS
controller always removes the groups of highest index (it cannot be told which): so the groups at and above
the new size are the ones that drain (`retire_groups`): every serving pod of theirs is marked, and the LWS
shrinks past a group once each of its pods is drained by the rule of step 3. No deletion cost is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterable, Mapping

from disagg_connector import contract

from .state import Obj, RouterView

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LEAVING_COST = "-2147483648"  # the lowest int32 the annotation takes


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def annotations(pod: Obj) -> Mapping[str, str]:
    return pod.get("metadata", {}).get("annotations") or {}


def marked(pod: Obj) -> bool:
    return contract.ANNOTATION_DRAINING in annotations(pod)


@dataclass(frozen=True)
class Retirement:
    replicas: int  # what the Deployment may be scaled to now
    mark: tuple[Obj, ...] = ()  # pods to mark draining now
    unmark: tuple[Obj, ...] = ()  # marked pods that stay after all
    cost: tuple[Obj, ...] = ()  # drained pods to give the lowest deletion cost
    waiting: tuple[str, ...] = field(default=())  # pods still draining (or waiting for their cost to be seen)
    holding: Mapping[str, str] = field(default_factory=dict)  # draining pod -> what still holds it, in words
    overdue: tuple[str, ...] = ()  # pods let go at the bound although a router could not say they were idle

    @property
    def busy(self) -> bool:
        return bool(self.mark or self.cost or self.waiting)


def _newest_first(pods: Iterable[Obj]) -> list[Obj]:
    return sorted(pods, key=lambda p: (p.get("metadata", {}).get("creationTimestamp") or "", p["metadata"]["name"]),
                  reverse=True)  # fmt: skip


def _name(pod: Obj) -> str:
    return pod["metadata"]["name"]


def _removed_now(active: list[Obj], live_replicas: int) -> set[str]:
    """The drained pods a ReplicaSet is removing now: its Deployment was shrunk to `live_replicas` past them (their
    lowest deletion cost picks them) and they are not terminating yet."""
    costed = [p for p in active if annotations(p).get(DELETION_COST) == LEAVING_COST]
    return {_name(p) for p in costed[: max(0, len(active) - live_replicas)]}


def retire(pods: Iterable[Obj], live_replicas: int, want: int, routers: RouterView | None, now: str, bound_s: float) -> Retirement:
    """How far a Deployment of `live_replicas` can shrink toward `want` now, and what to do to get further.
    `routers` None: not asked this pass (a pod is then drained only at the bound)."""
    active = [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")]
    if want >= live_replicas:
        going = _removed_now(active, live_replicas)
        return Retirement(replicas=want, unmark=tuple(p for p in active if marked(p) and _name(p) not in going))
    ready = [p for p in active if contract.pod_serving(p)]
    excess = live_replicas - want
    free = min(excess, live_replicas - len(ready))  # not ready, or not even created
    need = excess - free

    def holding(pod: Obj) -> str | None:
        return "the routers not asked yet" if routers is None else routers.holding(pod["metadata"]["name"])

    def overdue(pod: Obj) -> bool:
        return (parse_time(now) - parse_time(annotations(pod)[contract.ANNOTATION_DRAINING])).total_seconds() >= bound_s

    def drained(pod: Obj) -> bool:
        return holding(pod) is None or overdue(pod)

    leaving = [p for p in ready if marked(p)]
    # Keep the pods that are furthest along (drained, cost set), then the earliest marked.
    leaving.sort(key=lambda p: (annotations(p).get(DELETION_COST) != LEAVING_COST, not drained(p),
                                annotations(p)[contract.ANNOTATION_DRAINING]))  # fmt: skip
    staying_marked, leaving = leaving[need:], leaving[:need]
    fresh = [p for p in _newest_first(ready) if not marked(p)][: need - len(leaving)]

    removable = [p for p in leaving if drained(p) and annotations(p).get(DELETION_COST) == LEAVING_COST]
    to_cost = [p for p in leaving if drained(p) and annotations(p).get(DELETION_COST) != LEAVING_COST]
    waiting = [p["metadata"]["name"] for p in leaving if p not in removable] + [p["metadata"]["name"] for p in fresh]
    held = {p["metadata"]["name"]: why for p in leaving if not drained(p) and (why := holding(p))}
    return Retirement(
        replicas=live_replicas - free - len(removable),
        mark=tuple(fresh),
        unmark=tuple(staying_marked),
        cost=tuple(to_cost),
        waiting=tuple(waiting),
        holding=held,
        overdue=tuple(p["metadata"]["name"] for p in to_cost if holding(p) is not None),
    )


def _group_index(pod: Obj) -> int:
    return int((pod.get("metadata", {}).get("labels") or {}).get(contract.LWS_GROUP_INDEX_LABEL, "-1"))


def retire_groups(pods: Iterable[Obj], live_replicas: int, want: int, routers: RouterView | None, now: str,
                  bound_s: float) -> Retirement:  # fmt: skip
    """How far a LeaderWorkerSet of `live_replicas` groups can shrink toward `want` now: the groups of index
    `want` and above leave, from the top, each once all its serving pods are drained."""
    active = [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")]
    if want >= live_replicas:  # the groups at and above `live_replicas` are the LWS controller's to remove now
        return Retirement(replicas=want, unmark=tuple(p for p in active if marked(p) and _group_index(p) < live_replicas))

    def holding(pod: Obj) -> str | None:
        return "the routers not asked yet" if routers is None else routers.holding(pod["metadata"]["name"])

    def drained(pod: Obj) -> bool:
        if not marked(pod):
            return False
        since = (parse_time(now) - parse_time(annotations(pod)[contract.ANNOTATION_DRAINING])).total_seconds()
        return holding(pod) is None or since >= bound_s

    serving_in = {g: [p for p in active if _group_index(p) == g and contract.pod_serving(p)]
                  for g in range(want, live_replicas)}  # fmt: skip
    removable = live_replicas
    while removable > want and all(drained(p) for p in serving_in[removable - 1]):
        removable -= 1
    leaving = [p for g in range(want, live_replicas) for p in serving_in[g]]
    return Retirement(
        replicas=removable,
        mark=tuple(p for p in leaving if not marked(p)),
        unmark=tuple(p for p in active if marked(p) and _group_index(p) < want),
        waiting=tuple(p["metadata"]["name"] for p in leaving if not drained(p)),
        holding={p["metadata"]["name"]: why for p in leaving if marked(p) and not drained(p) and (why := holding(p))},
        overdue=tuple(p["metadata"]["name"] for p in leaving if drained(p) and holding(p) is not None
                      and _group_index(p) >= removable),
    )
