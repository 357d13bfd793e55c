"""What one reconcile pass knows: the desired world (from the spec) and the observed one (from the cache
and the pass's own probes). Plain frozen data, shared by the pure planner and status code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from disagg_connector import contract

from .api.models import DisaggregatedModel
from .render import Rendered

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


def is_engine_deployment(obj: Obj) -> bool:
    return obj["kind"] == "Deployment" and role_of(obj) in contract.ENGINE_ROLES


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
class ChildProblem:
    """Why a child cannot be written this pass. `reason` is a stable condition reason."""

    reason: str  # ChildRejected | OwnershipConflict | Forbidden | QuotaExceeded | Conflict | ApplyFailed
    kind: str
    name: str
    message: str

    def describe(self) -> str:
        return f"{self.kind} {self.name}: {self.message}"


@dataclass(frozen=True)
class Observed:
    """The children this model controls (from the watch-fed cache), its pods, and what this pass's probes
    found out about the children it wants to write: same-named objects it does not control, and
    refusals of a server-side dry run."""

    children: Mapping[Key, Obj] = field(default_factory=dict)
    pods: tuple[Obj, ...] = ()
    foreign: Mapping[Key, Obj] = field(default_factory=dict)
    refused: Mapping[Key, ChildProblem] = field(default_factory=dict)

    @property
    def deployments(self) -> list[Obj]:
        return [o for k, o in self.children.items() if k[0] == "Deployment"]

    def with_probes(self, foreign: Mapping[Key, Obj], refused: Mapping[Key, ChildProblem]) -> "Observed":
        return Observed(self.children, self.pods, foreign, refused)
