"""The Events a pass records on its DisaggregatedModel: one per decision, in the vocabulary's names. Pure.

`kubectl describe dm <name>` (and `kubectl events --for dm/<name>`) then tells a rollout's story: started,
each step, each pod draining and retired, done; and what went wrong: a refused child, an ownership conflict,
a write that failed, Ready lost, KV transfers failing, a drain that hit its timeout. Only actions the
executor carried out make an Event. Repeats (a looping failure) are aggregated by the recorder (kube.py) into
one Event with a count, as client-go's recorder does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, cast

from disagg_connector import contract

from . import planner
from .api import vocabulary
from .api.vocabulary import GANG_SCHEDULED, KV_TRANSFER_HEALTHY, READY, ConditionType, EventReason, Reason
from .state import ChildProblem, Desired, Observed, Obj, is_engine_workload, key_of, revision_of, role_of


@dataclass(frozen=True)
class Event:
    reason: EventReason | Reason  # an Event's own reason, or a condition reason
    action: str  # what the operator did or saw (events.k8s.io `action`)
    note: str
    related: Obj | None = None  # the child or pod it is about

    @property
    def type(self) -> Literal["Normal", "Warning"]:
        return vocabulary.event_type(self.reason)


def _condition(status: Mapping[str, Any] | None, type_: ConditionType) -> Mapping[str, Any]:
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == type_), {})


def _unit(workload: Obj) -> str:
    """What an engine workload's replicas count."""
    return "pods" if workload["kind"] == "Deployment" else "engines (LeaderWorkerSet groups)"


def _name(obj: Obj) -> str:
    return obj["metadata"]["name"]


def _action_event(action: planner.Action, observed: Observed, rolling: bool) -> Event | None:
    obj = action.obj
    if isinstance(action, planner.Annotate) and action.why == "leaving":
        return Event(EventReason.POD_DRAINING, "Drain", f"{role_of(obj)} pod {_name(obj)} drains: no new request; it goes once "
                     "no router has anything in flight on it", obj)  # fmt: skip
    if isinstance(action, planner.Annotate) and action.why == "drained":
        return Event(EventReason.POD_RETIRED, "Retire", f"{role_of(obj)} pod {_name(obj)} is idle: it goes", obj)
    if isinstance(action, planner.Scale):
        before = int((obj.get("spec") or {}).get("replicas") or 0)
        return Event(EventReason.ROLLOUT_STEP, "Scale", f"{role_of(obj)} of revision {revision_of(obj)}: {before} -> "
                     f"{action.replicas} {_unit(obj)}", obj)  # fmt: skip
    if isinstance(action, planner.Delete) and action.why == "retired":
        return Event(EventReason.REVISION_RETIRED, "Delete", f"{role_of(obj)} {obj['kind']} {_name(obj)} of revision "
                     f"{revision_of(obj)} deleted: its pods are gone", obj)  # fmt: skip
    if isinstance(action, planner.Apply) and is_engine_workload(obj):
        live = next((c for c in observed.workloads if key_of(c) == key_of(obj)), None)
        before = int((live.get("spec") or {}).get("replicas") or 0) if live else 0
        after = int(obj["spec"]["replicas"])
        if (live is not None and before == after) or (live is None and not rolling):
            return None  # a template change, not a size change; or the model's first pods
        verb = EventReason.ROLLOUT_STEP if rolling else EventReason.SCALED
        return Event(verb, "Scale", f"{role_of(obj)} of revision {revision_of(obj)}: {before} -> {after} {_unit(obj)}", obj)
    return None


def of_pass(desired: Desired, observed: Observed, plan: planner.Plan, done: int, failure: ChildProblem | None,
            status: Mapping[str, Any]) -> list[Event]:  # fmt: skip
    """The Events of one pass: its problems, the actions it carried out (the first `done`), a failed write,
    and the conditions that changed meaning (a rollout started or done, Ready lost, KV transfers failing)."""
    previous = desired.previous_status
    events = [Event(p.reason, "Plan", f"nothing was changed: {p.describe()}") for p in plan.problems]
    # From the actions, not from Progressing: status may count an old revision's pods again for a pass after
    # their Deployments went (the garbage collector takes the pods later), and a rollout happens once.
    carried = plan.actions[:done]
    old = {_name(d): revision_of(d) for d in observed.workloads
           if is_engine_workload(d) and revision_of(d) != desired.revision}  # fmt: skip
    rolling = bool(old)
    created = [a for a in carried if isinstance(a, planner.Apply) and a.why == "create" and is_engine_workload(a.obj)]
    if rolling and created:
        events.append(Event(EventReason.ROLLOUT_STARTED, "Rollout", f"revision {desired.revision} replaces "
                            f"{', '.join(sorted({v or '' for v in old.values()}))}"))  # fmt: skip
    events += [e for a in carried if (e := _action_event(a, observed, rolling)) is not None]
    events += [Event(EventReason.DRAIN_TIMED_OUT, "Retire", f"pod {pod} let go at spec.rollout.drainTimeoutSeconds: no router "
                     "could say it was idle") for pod in plan.overdue if done == len(plan.actions)]  # fmt: skip
    if failure is not None:
        events.append(Event(failure.reason, "Apply", f"{done} of {len(plan.actions)} changes made, then {failure.describe()}"))
    retired = {_name(a.obj) for a in carried if isinstance(a, planner.Delete) and a.why == "retired"}
    if rolling and retired and retired >= set(old):
        events.append(Event(EventReason.ROLLOUT_COMPLETE, "Rollout", f"revision {desired.revision} serves alone"))
    events += of_status(previous, status)
    return events


def of_status(previous: Mapping[str, Any] | None, status: Mapping[str, Any]) -> list[Event]:
    """Ready lost or back, KV transfers failing, gangs not to be had: once per change, not once per pass."""
    out = []
    was, now = _condition(previous, READY), _condition(status, READY)
    reason = cast(Reason, now.get("reason", ""))  # as status wrote it
    known = vocabulary.BY_NAME.get(reason)
    # Pods starting at create are no news; a model that stops serving, or a reason that needs someone, is.
    worth = was.get("status") == "True" or (known is not None and known.klass != "transient")
    if now.get("status") == "False" and worth and (was.get("status") != "False" or was.get("reason") != reason):
        out.append(Event(reason, "Status", f"not ready: {now.get('message', '')}"))
    elif now.get("status") == "True" and was.get("status") == "False":
        out.append(Event(Reason.READY, "Status", now.get("message", "")))
    was, now = _condition(previous, KV_TRANSFER_HEALTHY), _condition(status, KV_TRANSFER_HEALTHY)
    if now.get("status") == "False" and (was.get("status") != "False" or was.get("reason") != now.get("reason")):
        out.append(Event(cast(Reason, now.get("reason", "")), "Status", now.get("message", "")))
    elif now.get("reason") == Reason.ROUTER_UNREACHABLE and was.get("reason") != Reason.ROUTER_UNREACHABLE:
        out.append(Event(Reason.ROUTER_UNREACHABLE, "Status", now.get("message", "")))
    was, now = _condition(previous, GANG_SCHEDULED), _condition(status, GANG_SCHEDULED)
    if now.get("status") == "False" and (was.get("status") != "False" or was.get("reason") != now.get("reason")):
        out.append(Event(cast(Reason, now.get("reason", "")), "Status", now.get("message", "")))
    return out + _of_autoscaling((previous or {}).get("autoscaling") or {}, status.get("autoscaling") or {})


def _of_autoscaling(was: Mapping[str, Any], now: Mapping[str, Any]) -> list[Event]:
    """A new decision that differs from the roles' sizes (Advisory: recommended; Active: set), and a role newly
    blocked: once per decision."""
    if not now or now.get("decidedAt") == was.get("decidedAt"):
        return []
    out = []
    moves = {r: (now[r]["current"], now[r]["recommended"]) for r in contract.ENGINE_ROLES if now[r]["recommended"] != now[r]["current"]}
    before = {r: (was[r]["current"], was[r]["recommended"]) for r in contract.ENGINE_ROLES if was and was[r]["recommended"] != was[r]["current"]}
    if moves and moves != before:
        reason = EventReason.AUTOSCALER_SCALED if now.get("mode") == "Active" else EventReason.AUTOSCALER_RECOMMENDS
        out.append(Event(reason, "Scale", "; ".join(
            f"{r} {a} -> {b}: {now[r]['reason']}" for r, (a, b) in moves.items())))  # fmt: skip
    if now.get("blocked") and now.get("blocked") != was.get("blocked"):
        out.append(Event(EventReason.AUTOSCALER_BLOCKED, "Scale", str(now["blocked"])))
    return out

