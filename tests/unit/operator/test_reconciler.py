"""The Reconciler's outcomes, as a table: one pass against a scripted cluster and an in-memory cache, for every
way a pass can end (the spec invalid, first create, steady, a child refused, a name taken, a write that fails
half-way, the API server away, a bug, the model gone). Each row checks the pass's result, the writes it made,
the status it wrote and the Events it recorded."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from disagg_connector import contract
from disagg_operator.api.models import DEFAULT_VLLM_VERSION
from disagg_operator.config import ENGINE_REPOSITORY, RenderDefaults
from disagg_operator.metrics import OperatorMetrics
from disagg_operator.reconcile import Reconciler
from disagg_operator.state import Desired, SpecProblems, desire

from tests.fixtures.models import dm
from tests.fixtures.memory_cache import MemoryCache
from tests.fixtures.world import UID, children, desired, steady

NOW = "2026-12-01T00:00:00Z"
KEY = ("ns", "m")


class ScriptedCluster:
    """The calls the executor and the reconciler make, answering from a script: which GETs find a foreign
    object, which dry runs the API server refuses, which real write fails and how."""

    def __init__(self, foreign: dict[str, Any] | None = None, refuse: dict[str, tuple[int, str]] | None = None,
                 fail_write: tuple[int, BaseException] | None = None, get_raises: BaseException | None = None):  # fmt: skip
        self.foreign, self.refuse, self.fail_write, self.get_raises = foreign or {}, refuse or {}, fail_write, get_raises
        self.writes: list[tuple[str, str]] = []  # (verb, kind/name)
        self.statuses: list[dict[str, Any]] = []

    def serves(self, api_version: str, kind: str) -> bool:
        return False  # no Workload API (GenericWorkload is off by default): no PodGroups

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if self.get_raises is not None:
            raise self.get_raises
        return self.foreign.get(obj["metadata"]["name"])

    def _write(self, verb: str, obj: dict[str, Any]) -> None:
        if self.fail_write is not None and len(self.writes) == self.fail_write[0]:
            raise self.fail_write[1]
        self.writes.append((verb, f"{obj['kind']}/{obj['metadata']['name']}"))

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        if dry_run:
            refused = self.refuse.get(obj["metadata"]["name"])
            if refused:
                raise ApiException(status=refused[0], reason="x", body=json.dumps({"message": refused[1]}))
            return obj
        self._write("apply", obj)
        return obj

    def delete(self, obj: dict[str, Any]) -> None:
        self._write("delete", obj)

    def scale(self, obj: dict[str, Any], replicas: int) -> None:
        self._write("scale", obj)

    def annotate(self, obj: dict[str, Any], annotations: dict[str, Any]) -> None:
        self._write("annotate", obj)

    def set_status(self, obj: dict[str, Any], status: dict[str, Any]) -> None:
        self._write("set_status", obj)

    def write_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.statuses.append(copy.deepcopy(status))
        return {"metadata": {"resourceVersion": str(100 + len(self.statuses))}, "status": status}


class Events:
    def __init__(self) -> None:
        self.recorded: list[tuple[str, str]] = []

    def record(self, model: dict[str, Any], event: Any) -> None:
        self.recorded.append((event.type, event.reason))


def model(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body = dm(spec, uid=UID)
    body["metadata"].update(generation=3, resourceVersion="7")
    if status is not None:
        body["status"] = status
    return body


def steady_objects() -> list[dict[str, Any]]:
    observed = steady(desired())
    return [*observed.children.values(), *({**p, "kind": "Pod"} for p in observed.pods)]


def steady_status() -> dict[str, Any]:
    return planner_status(desired(), steady(desired()))


def planner_status(world: Desired, observed: Any) -> dict[str, Any]:
    from disagg_operator import planner

    return planner.plan(world, observed, NOW).status


@dataclass(frozen=True)
class Row:
    id: str
    cache: Callable[[], MemoryCache]
    cluster: Callable[[], ScriptedCluster]
    result: tuple[str, str | None]
    writes: Callable[[list[tuple[str, str]]], bool]
    ready: tuple[str, str] | None  # the written status's Ready (status, reason); None: no status written
    events: Callable[[list[tuple[str, str]]], bool] = field(default=lambda e: True)


def _conflict() -> ApiException:
    return ApiException(status=409, reason="Conflict", body=json.dumps({"message": "the object has been modified"}))


ROWS = [
    Row("model-gone", lambda: MemoryCache(), ScriptedCluster, ("gone", None), lambda w: w == [], None),
    Row("invalid-spec", lambda: MemoryCache([model({"kvTransfer": {"mode": "Push", "bidirectional": True}})]), ScriptedCluster,
        ("invalid", "InvalidSpec"), lambda w: w == [], ("False", "InvalidSpec"), lambda e: e == [("Warning", "InvalidSpec")]),
    Row("first-create", lambda: MemoryCache([model()]), ScriptedCluster, ("success", None),
        lambda w: len(w) == len(children(desired())) and {v for v, _ in w} == {"apply"}, ("False", "WaitingForPods"),
        lambda e: e == []),
    # Steady: no child is written; the first pass of an operator asks the routers (none has an IP here), which
    # KVTransferHealthy then says.
    Row("steady", lambda: MemoryCache([model(status=steady_status())], steady_objects()), ScriptedCluster, ("success", None),
        lambda w: w == [], ("True", "Ready"), lambda e: e == []),
    Row("child-refused", lambda: MemoryCache([model({"engine": {"image": "x/y:new"}}, steady_status())], steady_objects()),
        lambda: ScriptedCluster(refuse={n: (422, "spec.template: Invalid value") for n in _engine_names({"engine": {"image": "x/y:new"}})}),
        ("blocked", "ChildRejected"), lambda w: w == [], ("False", "ChildRejected"),
        lambda e: ("Warning", "ChildRejected") in e and "Normal" not in {t for t, _ in e}),
    Row("name-taken", lambda: MemoryCache([model()]),
        lambda: ScriptedCluster(foreign={"m-router": {"metadata": {"name": "m-router", "ownerReferences": []}}}),
        ("blocked", "OwnershipConflict"), lambda w: w == [], ("False", "OwnershipConflict"),
        lambda e: e[0] == ("Warning", "OwnershipConflict")),
    Row("write-fails-half-way", lambda: MemoryCache([model()]), lambda: ScriptedCluster(fail_write=(3, _conflict())),
        ("error", "Conflict"), lambda w: len(w) == 3, ("False", "Conflict"), lambda e: ("Warning", "Conflict") in e),
    Row("write-fails-while-serving", lambda: MemoryCache([model({"engine": {"image": "x/y:new"}}, steady_status())], steady_objects()),
        lambda: ScriptedCluster(fail_write=(0, _conflict())), ("error", "Conflict"), lambda w: w == [], ("True", "Ready"),
        lambda e: ("Warning", "Conflict") in e),
    Row("api-unavailable", lambda: MemoryCache([model()]),
        lambda: ScriptedCluster(get_raises=urllib3.exceptions.MaxRetryError(None, "/", "connection refused")),
        ("error", "ApiUnavailable"), lambda w: w == [], ("False", "ApiUnavailable")),
    Row("operator-bug", lambda: MemoryCache([model()]), lambda: ScriptedCluster(get_raises=KeyError("metadata")),
        ("error", "InternalError"), lambda w: w == [], ("False", "InternalError")),
]


def _engine_names(spec: dict[str, Any]) -> list[str]:
    world = desired(spec)
    return [o["metadata"]["name"] for o in world.rendered.objects if o["kind"] == "Deployment" and "router" not in o["metadata"]["name"]]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_reconciler_outcomes(row: Row) -> None:
    cluster, events = row.cluster(), Events()
    reconciler = Reconciler(row.cache(), cluster, RenderDefaults(), OperatorMetrics(workers=1), now=lambda: NOW,  # type: ignore[arg-type]
                            recorder=events)  # type: ignore[arg-type]
    result = reconciler.reconcile(KEY)
    assert (result.result, result.reason) == row.result, result
    assert row.writes(cluster.writes), cluster.writes
    if row.ready is None:
        assert cluster.statuses == []
    else:
        ready = next(c for c in cluster.statuses[-1]["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == row.ready, ready
    assert row.events(events.recorded), events.recorded


def test_a_pass_starts_from_the_status_it_wrote_until_the_cache_catches_up() -> None:
    """The cache still holds the model without status (resourceVersion 7); the second pass must not flip
    lastTransitionTime back, nor write the same status again."""
    cluster = ScriptedCluster()
    reconciler = Reconciler(MemoryCache([model()]), cluster, RenderDefaults(), OperatorMetrics(workers=1), now=lambda: NOW)  # type: ignore[arg-type]
    reconciler.reconcile(KEY)
    written = len(cluster.statuses)
    reconciler.reconcile(KEY)
    assert len(cluster.statuses) == written, "an unchanged world writes no status"


def test_an_operator_whose_default_release_moved_writes_nothing_to_a_steady_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model runs 0.33.0 and says so in its status; the upgraded operator's default is 0.34.0 (its chart's
    engineImage a 0.34.0 image): the pass keeps the model's release, so no child changes."""
    status, running = steady_status(), steady_objects()  # what the operator before the upgrade made
    assert status["vllmVersion"] == "0.33.0"
    monkeypatch.setitem(DEFAULT_VLLM_VERSION, "nvidia", "0.34.0")
    moved = RenderDefaults(engine_image=f"{ENGINE_REPOSITORY}:0.34.0-efa")
    cluster = ScriptedCluster()
    reconciler = Reconciler(MemoryCache([model(status=status)], running), cluster, moved,  # type: ignore[arg-type]
                            OperatorMetrics(workers=1), now=lambda: NOW)  # fmt: skip
    assert reconciler.reconcile(KEY).result == "success"
    assert cluster.writes == [] and all(s["vllmVersion"] == "0.33.0" for s in cluster.statuses)
    # Without the status's release (an operator before status.vllmVersion wrote it) the same pass would roll it.
    assert desire(model(), moved, None).revision != desire(model(), moved, status).revision  # type: ignore[union-attr]


def test_desire_parses_and_renders_in_one_step_or_says_every_problem() -> None:
    desired = desire(model(), RenderDefaults(), previous_status={"phase": "Ready"})
    assert isinstance(desired, Desired) and desired.ref.name == model()["metadata"]["name"]
    assert desired.previous_status == {"phase": "Ready"} and desired.rendered.objects
    refused = desire(model({"kvTransfer": {"mode": "Push", "bidirectional": True}}), RenderDefaults(), None)
    assert isinstance(refused, SpecProblems) and refused.problems
    assert all("bidirectional" in p or "Push" in p for p in refused.problems), refused.problems


# --- spec.autoscaling: a decision every interval in status; Advisory writes no size, Active writes it ---------------

SLO = {"autoscaling": {"ttftMilliseconds": 2000, "tpotMilliseconds": 50, "prefill": {"maxEngines": 4}, "decode": {"maxEngines": 4},
                       "intervalSeconds": 15}}  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.at = 1000.0

    def monotonic(self) -> float:
        return self.at

    def time(self) -> float:
        return 1.8e9 + self.at


@pytest.mark.parametrize("mode", ["Advisory", "Active"])
def test_autoscaling_decides_each_interval_and_only_active_writes_the_size(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg_connector.contract.health import BackendHealth, BackendRouting, RouterHealth
    from disagg_connector.router.metrics import RouterMetrics
    from prometheus_client import generate_latest

    from disagg_operator import executor, reconcile
    from disagg_operator.state import RouterView

    slo = {"autoscaling": {**SLO["autoscaling"], "mode": mode}}
    world = desired(slo)
    revision = world.revision
    router = RouterMetrics(lambda: RouterHealth("ok", True, "Push", 60.0, (), {}))
    backends = tuple(BackendHealth(f"{r[0]}-{revision}-0", f"{r[0]}-{revision}-0", r, revision, "Push", 0, False, False,
                                   BackendRouting(3.0, 0.5, waiting=12.0 if r == "prefill" else 0.0, kv_usage=0.2,
                                                  kv_capacity_tokens=200_000))
                     for r in ("prefill", "decode"))  # fmt: skip
    health = RouterHealth("ok", True, "Push", 60.0, backends, {})
    monkeypatch.setattr(executor, "read_routers", lambda observed, ready: RouterView((health,), ("r-0",)))
    monkeypatch.setattr(executor, "read_router_metrics", lambda observed, ready: {"r-0": generate_latest(router.registry).decode()})
    clock = Clock()
    monkeypatch.setattr(reconcile, "time", clock)

    observed = steady(world)
    objects = [*observed.children.values(), *({**p, "kind": "Pod"} for p in observed.pods)]
    cluster = ScriptedCluster()
    status = planner_status(world, observed)
    reconciler = Reconciler(MemoryCache([model(slo, status)], objects), cluster, RenderDefaults(), OperatorMetrics(workers=1),  # type: ignore[arg-type]
                            now=lambda: NOW)  # fmt: skip
    first = reconciler.reconcile(KEY)
    assert first.requeue_after == 15, "back for the next decision"
    assert "autoscaling" not in (cluster.statuses[-1] if cluster.statuses else {}), "the first read only starts the interval"

    for _ in range(40):  # prompts queue on the one prefill: TTFT 9 s, the prefill leg 8.5 s of it
        router.child(router.ttft, revision, "Push").observe(9.0)
        router.child(router.prefill, revision, "Push").observe(8.5)
        router.child(router.tpot, revision, "Push").observe(0.02)
    router.child(router.prompt_tokens, f"prefill-{revision}-0").inc(400_000)
    clock.at += 15
    reconciler.reconcile(KEY)
    scaling = cluster.statuses[-1]["autoscaling"]
    assert scaling["mode"] == mode and scaling["prefill"]["current"] == 1 and scaling["prefill"]["recommended"] >= 2
    assert "TTFT" in scaling["prefill"]["reason"] and scaling["decode"]["recommended"] == 1
    assert scaling["measured"]["requests"] == 40 and scaling["measured"]["ttftSeconds"] > 7.5
    grown = scaling["prefill"]["recommended"]
    if mode == "Advisory":
        assert cluster.writes == [], "Advisory writes no size"
        assert cluster.statuses[-1]["prefill"]["targetReplicas"] == 1
    else:  # the DisaggregatedRole, then the current revision's prefill Deployment, at the decided size
        written = {name for _, name in cluster.writes}
        assert {f"{contract.ROLE_KIND}/m-prefill", f"Deployment/{contract.engine_deployment_name('m', 'prefill', revision)}"} <= written
        assert not [n for n in written if "decode" in n], cluster.writes
        assert cluster.statuses[-1]["prefill"]["targetReplicas"] == grown
    clock.at += 5
    reconciler.reconcile(KEY)
    assert cluster.statuses[-1]["autoscaling"] == scaling, "within the interval the last decision stands"
