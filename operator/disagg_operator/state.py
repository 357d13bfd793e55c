"""What one reconcile pass knows: the desired world (from the spec) and the observed one (from the cache
and the pass's own probes). Plain frozen data, shared by the pure planner and status code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Mapping

from disagg_connector import contract
from disagg_connector.contract.health import RouterHealth

from .api.models import DisaggregatedModel
from .api.validation import SpecError, parse
from .api.vocabulary import Reason
from .config import RenderDefaults
from .render import Rendered, render
from .render.engine import ENGINE_KINDS

Key = tuple[str, str]  # (kind, name): unique among one model's children
Obj = dict[str, Any]


def key_of(obj: Obj) -> Key:
    return obj["kind"], obj["metadata"]["name"]


def labels_of(obj: Obj) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def role_of(obj: Obj) -> str | None:
    return labels_of(obj).get(contract.LABEL_ROLE)


def revision_of(obj: Obj) -> str | None:
    return labels_of(obj).get(contract.LABEL_REVISION)


def controlled_by(obj: Obj, uid: str) -> bool:
    owners = obj.get("metadata", {}).get("ownerReferences") or []
    return any(o.get("uid") == uid and o.get("controller") for o in owners)


def is_engine_workload(obj: Obj) -> bool:
    """A role's engines of one revision: a Deployment, or a LeaderWorkerSet when an engine spans pods."""
    return obj["kind"] in ENGINE_KINDS and role_of(obj) in contract.ENGINE_ROLES


@dataclass(frozen=True)
class ModelRef:
    namespace: str
    name: str
    uid: str
    generation: int | None = None


@dataclass(frozen=True)
class Desired:
    """The parsed model, what it renders to, and the status it carried when the pass began."""

    ref: ModelRef
    model: DisaggregatedModel
    rendered: Rendered
    previous_status: Mapping[str, Any] | None = None

    @property
    def revision(self) -> str:
        return self.rendered.revision


@dataclass(frozen=True)
class SpecProblems:
    """A spec admission would have refused (an older CRD, or none): every problem, each saying what to change."""

    problems: tuple[str, ...]


def desire(body: Mapping[str, Any], defaults: RenderDefaults, previous_status: Mapping[str, Any] | None) -> Desired | SpecProblems:
    """The desired world of a model object in one step: parse its spec and render it."""
    meta = body["metadata"]
    try:
        model = parse({k: body[k] for k in ("apiVersion", "kind", "spec") if k in body}
                      | {"metadata": {k: meta[k] for k in ("name", "namespace", "uid", "generation") if k in meta}})
        rendered = render(model, defaults, previous_status)
    except (SpecError, ValueError) as error:
        return SpecProblems(tuple(str(p) for p in error.problems) if isinstance(error, SpecError) else (str(error),))
    ref = ModelRef(meta["namespace"], meta["name"], meta["uid"], meta.get("generation"))
    return Desired(ref, model, rendered, previous_status)


@dataclass(frozen=True)
class ChildProblem:
    """Why a child cannot be written this pass. `reason` is a stable condition reason."""

    reason: Reason  # ChildRejected | OwnershipConflict | Forbidden | QuotaExceeded | Conflict | ApplyFailed | KindNotInstalled | ApiUnavailable
    kind: str
    name: str
    message: str

    def describe(self) -> str:
        return f"{self.kind} {self.name}: {self.message}"


@dataclass(frozen=True)
class RouterView:
    """What the routers of the model say (their /health), as the executor read it: one entry per ready
    router pod, None for one that did not answer (then nobody can say a pod is idle before the timeout).
    `names`: the router pods, in the order of `reports` (for messages; may be empty)."""

    reports: tuple[RouterHealth | None, ...] = ()
    names: tuple[str, ...] = ()

    def holding(self, pod_name: str) -> str | None:
        """What still holds a draining pod, in words; None when every ready router reports it draining with
        nothing in flight (or does not route to it at all), streams included, or when no router is ready."""
        for index, report in enumerate(self.reports):
            router = self.names[index] if index < len(self.names) else f"#{index}"
            if report is None:
                return f"router {router} did not answer"
            entries = [b for b in report.backends if b.pod == pod_name]
            inflight = sum(b.inflight for b in entries)
            if inflight:
                return f"{inflight} request(s) in flight on router {router}"
            if any(not b.draining for b in entries):
                return f"router {router} has not seen the mark yet"
        return None

    def idle(self, pod_name: str) -> bool:
        return self.holding(pod_name) is None


def terminating(obj: Obj) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))


@dataclass(frozen=True)
class PodView:
    """The facts about one pod that every decision reads, derived once (contract.pod_serving for `ready`)."""

    obj: Obj
    name: str
    role: str | None
    revision: str | None
    ready: bool  # Ready=True and not terminating: it serves
    terminating: bool
    draining: bool  # marked to leave (contract.ANNOTATION_DRAINING)
    engine: contract.EngineGroup  # the engine it is (part of): itself, or its LeaderWorkerSet group

    @classmethod
    def of(cls, pod: Obj) -> "PodView":
        meta = pod.get("metadata", {})
        name, annotations = meta.get("name", ""), meta.get("annotations") or {}
        try:
            engine = contract.engine_group(name, labels_of(pod), annotations)
        except ValueError:  # annotations no engine pod of ours carries: count it as an engine of its own
            engine = contract.EngineGroup(name, 1)
        return cls(pod, name, role_of(pod), revision_of(pod), contract.pod_serving(pod), terminating(pod),
                   contract.ANNOTATION_DRAINING in annotations, engine)  # fmt: skip


@dataclass(frozen=True)
class EngineView:
    """One engine of a role: a pod, or the pods of one LeaderWorkerSet group. It serves only when every one of
    its pods does (vLLM's data-parallel ranks of one engine step together)."""

    key: str
    role: str | None
    revision: str | None
    size: int  # pods it should have
    pods: tuple[PodView, ...]

    @property
    def ready(self) -> bool:
        return sum(p.ready for p in self.pods) == self.size

    @property
    def terminating(self) -> bool:
        return all(p.terminating for p in self.pods)


_ANY = object()


@dataclass(frozen=True)
class Census:
    """The observed pods, each one's facts derived once per pass, and the counts everything reads from them."""

    pods: tuple[PodView, ...]

    def select(self, role: str | None = None, revision: Any = _ANY, ready: bool | None = None,
               terminating: bool | None = None) -> list[PodView]:  # fmt: skip
        """Pods of a role (None: any), of a revision (default: any; None is a pod without one), by readiness
        and by whether they terminate."""
        return [p for p in self.pods
                if (role is None or p.role == role) and (revision is _ANY or p.revision == revision)
                and (ready is None or p.ready == ready) and (terminating is None or p.terminating == terminating)]  # fmt: skip

    def count(self, role: str | None = None, revision: Any = _ANY, ready: bool | None = None,
              terminating: bool | None = None) -> int:  # fmt: skip
        return len(self.select(role, revision, ready, terminating))

    def engines(self, role: str, revision: Any = _ANY, ready: bool | None = None,
                terminating: bool | None = None) -> list[EngineView]:  # fmt: skip
        """The engines of a role (each pod of a one-pod engine, each LeaderWorkerSet group of the others), by
        revision, by readiness (every pod ready) and by whether they terminate (every pod does)."""
        return [e for e in self._engines
                if e.role == role and (revision is _ANY or e.revision == revision)
                and (ready is None or e.ready == ready) and (terminating is None or e.terminating == terminating)]  # fmt: skip

    @cached_property
    def _engines(self) -> tuple[EngineView, ...]:
        """Every engine, grouped once per pass (a pass asks for them a dozen times)."""
        groups: dict[tuple[str | None, str | None, str], list[PodView]] = {}
        for pod in self.pods:
            groups.setdefault((pod.role, pod.revision, pod.engine.key), []).append(pod)
        return tuple(EngineView(key, role, rev, pods[0].engine.pods, tuple(pods)) for (role, rev, key), pods in groups.items())

    def count_engines(self, role: str, revision: Any = _ANY, ready: bool | None = None,
                      terminating: bool | None = None) -> int:  # fmt: skip
        return len(self.engines(role, revision, ready, terminating))

    def paired_revisions(self) -> set[str | None]:
        """Revisions with a ready prefill and a ready decode engine (the router pairs only within one)."""
        return {e.revision for e in self.engines("prefill", ready=True)} & {e.revision for e in self.engines("decode", ready=True)}


@dataclass(frozen=True)
class Observed:
    """The children this model controls (from the watch-fed cache), its pods, what this pass's probes
    found out about the children it wants to write (same-named objects it does not control, refusals of a
    server-side dry run), and what its routers said, when they were asked."""

    children: Mapping[Key, Obj] = field(default_factory=dict)
    pods: tuple[Obj, ...] = ()
    foreign: Mapping[Key, Obj] = field(default_factory=dict)
    refused: Mapping[Key, ChildProblem] = field(default_factory=dict)
    routers: RouterView | None = None  # None: not asked this pass
    # Whether the API server serves PodGroups (gang scheduling); None: not asked (no engine spans pods).
    pod_groups_served: bool | None = None
    # The model's weights claim (spec.model.source pvc://), when this pass found it missing: asked only while an
    # engine pod has a scheduler error (a gang's cycle hides the missing claim behind one: status._unschedulable).
    missing_claim: str | None = None
    # status.autoscaling: the SLO autoscaler's last decision, made by the reconciler every spec.autoscaling interval
    autoscaling: Mapping[str, Any] | None = None

    @cached_property
    def census(self) -> Census:
        return Census(tuple(PodView.of(p) for p in self.pods))

    @property
    def workloads(self) -> list[Obj]:
        """The Deployments (engines and router) and LeaderWorkerSets (engines that span pods)."""
        return [o for k, o in self.children.items() if k[0] in ENGINE_KINDS]

    def with_probes(self, foreign: Mapping[Key, Obj], refused: Mapping[Key, ChildProblem]) -> "Observed":
        return replace(self, foreign=foreign, refused=refused)
