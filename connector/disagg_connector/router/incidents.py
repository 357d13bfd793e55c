"""The Events a router records on its DisaggregatedModel when a decode engine fails mid-stream: one per failed engine
and cause, not one per stream (a wide decode group that dies carries hundreds), so that ``kubectl describe dm``
says what happened to the clients: every stream went on (``StreamsMigrated``, Normal), or some were cut and why
(``StreamsCut``, Warning). The metrics count the same streams (``disagg_router_migrations_total``); the Event is
the story of one failure.

:class:`Incidents` is pure (the relay's outcomes go in, Event drafts come out once an engine's streams have had
:data:`WINDOW_SECONDS` to be settled); :class:`EventPoster` is the thin task that posts them with the official
``kubernetes`` client, on the model found by name (``--model-name``) in the router's namespace. Without discovery
through the API (a static file) or without a model name, nothing is posted: the log says it once per migration.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from disagg_connector import contract
from disagg_connector.contract.health import RouterEventReason
from disagg_connector.router.migration import MIGRATED, OUTCOMES, UNCUT

log = logging.getLogger("disagg_router.incidents")

# A failed engine's streams are settled within this (each waits for its continuation, or its end): one Event then.
WINDOW_SECONDS = 5.0

_SAID = {
    MIGRATED: "continued on another pair",
    "complete": "already whole (every token was out)",
    "refused": "cut: the request cannot be continued faithfully",
    "exhausted": "cut: maxMigrations reached",
    "failed": "cut: no pair took the continuation in time",
    "off": "cut: migration is off",
}
assert set(_SAID) == set(OUTCOMES)


@dataclass(frozen=True)
class EventDraft:
    reason: RouterEventReason
    note: str

    @property
    def type(self) -> Literal["Normal", "Warning"]:
        return "Normal" if self.reason == RouterEventReason.STREAMS_MIGRATED else "Warning"


@dataclass
class _Incident:
    revision: str
    first: float
    outcomes: Counter[str] = field(default_factory=Counter)


class Incidents:
    """Streams whose decode failed after the first token, by (failed engine's pod, cause), until reported."""

    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self.window = window
        self._open: dict[tuple[str, str], _Incident] = {}

    def record(self, engine: str, revision: str, cause: str, outcome: str, now: float) -> None:
        incident = self._open.setdefault((engine, cause), _Incident(revision, now))
        incident.outcomes[outcome] += 1

    def due(self, now: float) -> list[EventDraft]:
        """The Events of the incidents whose window has passed (each once), oldest first."""
        ready = sorted((i.first, key) for key, i in self._open.items() if now - i.first >= self.window)
        return [self._draft(key, self._open.pop(key)) for _, key in ready]

    @staticmethod
    def _draft(key: tuple[str, str], incident: _Incident) -> EventDraft:
        (engine, cause), counts = key, incident.outcomes
        total = sum(counts.values())
        cut = total - sum(counts[o] for o in UNCUT)
        what = "; ".join(f"{counts[o]} {_SAID[o]}" for o in OUTCOMES if counts[o])
        note = f"decode pod {engine} (revision {incident.revision}) failed mid-stream ({cause}) with {total} stream(s) on it: {what}"
        return EventDraft(RouterEventReason.STREAMS_CUT if cut else RouterEventReason.STREAMS_MIGRATED, note)


def event_body(draft: EventDraft, model: dict[str, Any], instance: str, when: datetime.datetime) -> dict[str, Any]:
    """A core/v1 Event on the model (``kubectl describe dm`` lists it), as the router reports it."""
    meta = model["metadata"]
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
            "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
        },  # fmt: skip
        "reason": draft.reason.value,
        "message": draft.note,
        "type": draft.type,
        "source": {"component": "disagg-router", "host": instance},
        "reportingComponent": "disagg.dev/router",
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class EventPoster:
    """Every second, posts the due incidents' Events on the model (the API calls in a thread: the client is
    synchronous). A failed post is logged and dropped: an Event is a report, never worth holding a stream for."""

    def __init__(self, incidents: Incidents, namespace: str, model: str, api_client: Callable[[], Any], clock: Callable[[], float]) -> None:
        self.incidents, self.namespace, self.model = incidents, namespace, model
        self._api_client, self.clock = api_client, clock
        self._task: asyncio.Task[None] | None = None
        self._instance = os.environ.get("HOSTNAME", "disagg-router")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            await self._post_due(float("inf"))  # what is open at shutdown is reported now

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(1.0)  # a ticker: incidents settle over WINDOW_SECONDS, a second late is nothing
            await self._post_due(self.clock())

    async def _post_due(self, now: float) -> None:
        drafts = self.incidents.due(now)  # on the loop, where the relay records
        if drafts:
            await asyncio.to_thread(self._post, drafts)

    def _post(self, drafts: list[EventDraft]) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        api = self._api_client()
        try:
            model = client.CustomObjectsApi(api).get_namespaced_custom_object(
                contract.API_GROUP, contract.API_VERSION, self.namespace, contract.PLURAL, self.model
            )  # fmt: skip
            core = client.CoreV1Api(api)
            for draft in drafts:
                body = event_body(draft, model, self._instance, datetime.datetime.now(datetime.timezone.utc))
                core.create_namespaced_event(self.namespace, body)
        except (ApiException, OSError) as error:
            log.warning("could not record %d Event(s) on %s/%s: %s", len(drafts), self.namespace, self.model, error)
