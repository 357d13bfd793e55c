"""The router's ``GET /health`` document: its typed model, its parser, and what it says about KV transfer.

Pure (no aiohttp, no I/O): the router builds the document from these types, and the operator parses it
with :func:`parse_health` on its resync to decide a ``KVTransferHealthy`` condition per revision
(:meth:`RevisionHealth.verdict`). The shape, in JSON (``docs/router.md`` documents every field)::

    {"status": "ok" | "draining", "synced": true, "defaultMode": "Push", "windowSeconds": 60,
     "backends": [{"pod": "m-prefill-abc-0", "backend": "m-prefill-abc-0", "role": "prefill",
                   "revision": "abc", "mode": "Push", "inflight": 0, "draining": false, "ejected": false}],
     "revisions": {"abc": {"mode": "Push", "modeConflict": null, "prefill": 1, "decode": 1, "readyPairs": 1,
                           "weight": 1.0, "requests": 10, "succeeded": 9, "failures": {"kv_wait_timeout": 1},
                           "local": 0, "recent": {"requests": 3, "succeeded": 3, "failures": {}},
                           "lastSuccessAgeSeconds": 0.4, "heldOut": {"prefill": 0, "decode": 0}}}}

``heldOut`` (optional when parsing: routers before it omit it, read as zeros) counts per role the backends
of serving pods whose multi-pod engine is incomplete (not every pod of its group serves), so not usable.
Counts are cumulative since the router started, except ``recent`` (the last ``windowSeconds``). A
*request* here is one dispatch of both legs to a pair of this revision (a retry on another pair counts
again, there); ``local`` counts prompts below the disaggregation threshold served by a decode engine alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Mapping

TransferMode = Literal["Push", "Pull"]
TRANSFER_MODES: tuple[TransferMode, ...] = ("Push", "Pull")

# --- failure causes: one vocabulary for /health, /metrics and the logs -----------------------------
# Category of a cause: what it says about KV transfer.
TRANSFER = "transfer"  # the transfer between the pair failed (decode failed before its first token)
DEADLINE = "deadline"  # a leg or the wait for the KV passed the router's deadline
PROTOCOL = "protocol"  # the engines speak another connector than the router assumed
ENGINE = "engine"  # an engine is unreachable, unavailable or broke mid-stream
CLIENT = "client"  # the client went away, or an engine rejected the request (4xx, passed through)
CAUSES: dict[str, str] = {
    "prefill_connection": ENGINE,  # connection refused/reset/closed on the prefill leg
    "prefill_unavailable": ENGINE,  # the prefill engine answered 503
    "prefill_error": ENGINE,  # any other 5xx or an unreadable answer from the prefill engine
    "prefill_timeout": DEADLINE,  # the prefill leg passed its deadline
    "prefill_rejected": CLIENT,  # the prefill engine answered 4xx (passed through to the client)
    "decode_connection": ENGINE,
    "decode_unavailable": ENGINE,
    # The decode engine answered 5xx, or an error event, before its first token: in a disaggregated
    # request that is the KV load (vLLM answers a failed load with 500 "Internal server error").
    "decode_failed": TRANSFER,
    "kv_wait_timeout": DEADLINE,  # the decode leg's first token (i.e. the KV) did not come in time
    "decode_timeout": DEADLINE,  # a non-streaming decode leg did not answer within --request-timeout-seconds
    "decode_rejected": CLIENT,
    "decode_stream_broken": ENGINE,  # the decode stream broke after its first token (error event sent)
    "decode_stall": DEADLINE,  # the decode stream went silent longer than the deadline mid-body
    "protocol_mismatch": PROTOCOL,  # prefill answered with another transfer_mode than the revision's
    "client_disconnect": CLIENT,
}


def category(cause: str) -> str:
    return CAUSES.get(cause, ENGINE)


class KVReason(StrEnum):
    """A revision's verdict on KV transfer (:meth:`RevisionHealth.verdict`): the operator's KVTransferHealthy
    reason. Declared here, where the verdict is made; the operator's vocabulary takes them from this enum."""

    TRANSFERS_SUCCEEDING = "TransfersSucceeding"
    TRANSFERS_FAILING = "TransfersFailing"
    DEADLINES_HIT = "DeadlinesHit"
    PROTOCOL_MISMATCH = "ProtocolMismatch"
    NO_TRANSFER_COMPLETED = "NoTransferCompleted"
    NO_TRAFFIC_YET = "NoTrafficYet"


class RouterEventReason(StrEnum):
    """Reasons of the Events a router records on its model (``router/incidents.py``). Declared here, where they are
    made; the operator's vocabulary takes them into its Event reasons, with their meaning."""

    STREAMS_MIGRATED = "StreamsMigrated"
    STREAMS_CUT = "StreamsCut"


# --- the document -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcomes:
    requests: int = 0
    succeeded: int = 0
    failures: Mapping[str, int] = field(default_factory=dict)

    def failed_by(self, cat: str) -> int:
        return sum(n for cause, n in self.failures.items() if category(cause) == cat)

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "succeeded": self.succeeded, "failures": dict(self.failures)}


@dataclass(frozen=True)
class BackendRouting:
    """What the router's policies see of one backend (docs/router.md, Policies)."""

    load: float  # requests ahead of a new one: the engine's running + waiting at the last read + this router's legs since
    read_age_seconds: float | None  # of the last read of the engine's /metrics (None: never read)
    expected_hit_ratio: float | None = None  # prefill: of the prompt tokens sent, those the policy expected cached
    reported_hit_ratio: float | None = None  # prefill: vLLM's own prefix cache hits / queries since the engine started
    prefix_chunks: int = 0  # prefill: prompt chunks the prefix index believes the backend holds
    kv_blocks: int | None = None  # prefill: KV blocks its KV events say it holds (None: its events are not followed)
    # The engine's own scheduler gauges at the last fresh read of its /metrics (None: no fresh read), for the
    # operator's autoscaler: requests waiting for room (vLLM's reason "capacity"; not those waiting on their remote
    # KV, which a decode asked with its prefill does until the KV lands), the share of its KV cache in use and that
    # cache's size in tokens.
    waiting: float | None = None
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "load": self.load, "readAgeSeconds": self.read_age_seconds, "expectedHitRatio": self.expected_hit_ratio,
            "reportedHitRatio": self.reported_hit_ratio, "prefixChunks": self.prefix_chunks, "kvBlocks": self.kv_blocks,
            "waiting": self.waiting, "kvUsage": self.kv_usage, "kvCapacityTokens": self.kv_capacity_tokens,
        }  # fmt: skip


@dataclass(frozen=True)
class BackendHealth:
    """One schedulable target: a decode pod, or one data-parallel rank of a prefill pod (``backend``)."""

    pod: str
    backend: str
    role: Literal["prefill", "decode"]
    revision: str
    mode: TransferMode | None
    inflight: int
    draining: bool
    ejected: bool
    routing: BackendRouting | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {
            "pod": self.pod, "backend": self.backend, "role": self.role, "revision": self.revision, "mode": self.mode,
            "inflight": self.inflight, "draining": self.draining, "ejected": self.ejected,
        }  # fmt: skip
        if self.routing is not None:
            doc["routing"] = self.routing.to_json()
        return doc


@dataclass(frozen=True)
class Verdict:
    """What the numbers say about KV transfer in one revision. ``healthy`` None: nothing to judge yet."""

    healthy: bool | None
    reason: KVReason
    message: str


@dataclass(frozen=True)
class RevisionHealth:
    mode: TransferMode | None  # None when its pods disagree (see mode_conflict): it takes no traffic
    mode_conflict: str | None
    prefill: int  # usable backends per role (ready, not draining, not ejected)
    decode: int
    ready_pairs: int
    weight: float  # its share of new disaggregated requests
    totals: Outcomes
    local: int
    recent: Outcomes
    last_success_age_seconds: float | None
    # backends of serving pods held out because their multi-pod engine is incomplete, per role
    held_out_prefill: int = 0
    held_out_decode: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "modeConflict": self.mode_conflict, "prefill": self.prefill, "decode": self.decode,
            "readyPairs": self.ready_pairs, "weight": self.weight, **self.totals.to_json(), "local": self.local,
            "recent": self.recent.to_json(), "lastSuccessAgeSeconds": self.last_success_age_seconds,
            "heldOut": {"prefill": self.held_out_prefill, "decode": self.held_out_decode},
        }  # fmt: skip

    def verdict(self, revision: str, window_seconds: float) -> Verdict:
        """Judged on the recent window: a cause category that outweighs the successes there wins
        (protocol first: it never heals by itself); otherwise any success, recent or not, is healthy."""
        r = self.recent
        where = f"revision {revision}"
        if self.mode_conflict:
            return Verdict(False, KVReason.PROTOCOL_MISMATCH, f"{where}: {self.mode_conflict}")
        for cat, reason, what in (
            (PROTOCOL, KVReason.PROTOCOL_MISMATCH, "prefill answered in another transfer mode than its pods announce"),
            (TRANSFER, KVReason.TRANSFERS_FAILING, "decode engines failed to receive the KV cache"),
            (DEADLINE, KVReason.DEADLINES_HIT, "legs or the wait for the KV cache passed the router's deadline"),
        ):
            failed = r.failed_by(cat)
            if failed and failed >= r.succeeded:
                detail = ", ".join(f"{c} {n}" for c, n in sorted(r.failures.items()) if category(c) == cat)
                return Verdict(False, reason, f"{where}: {what} ({detail}; {r.succeeded} succeeded in the last {window_seconds:g}s)")
        if r.succeeded:
            return Verdict(True, KVReason.TRANSFERS_SUCCEEDING, f"{where}: {r.succeeded} of {r.requests} requests succeeded in the last {window_seconds:g}s")
        if self.totals.succeeded:
            age = self.last_success_age_seconds
            return Verdict(True, KVReason.TRANSFERS_SUCCEEDING, f"{where}: last success {age:.0f}s ago" if age is not None else where)
        if self.totals.requests:
            causes = ", ".join(f"{c} {n}" for c, n in sorted(self.totals.failures.items())) or "none finished"
            return Verdict(None, KVReason.NO_TRANSFER_COMPLETED, f"{where}: {self.totals.requests} requests, none got as far as a KV transfer ({causes})")
        return Verdict(None, KVReason.NO_TRAFFIC_YET, f"{where}: no disaggregated request has been served yet")


@dataclass(frozen=True)
class RouterHealth:
    status: Literal["ok", "draining"]
    synced: bool
    default_mode: TransferMode
    window_seconds: float
    backends: tuple[BackendHealth, ...]
    revisions: Mapping[str, RevisionHealth]

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "synced": self.synced,
            "defaultMode": self.default_mode,
            "windowSeconds": self.window_seconds,
            "backends": [b.to_json() for b in self.backends],
            "revisions": {name: r.to_json() for name, r in self.revisions.items()},
        }

    def verdicts(self) -> dict[str, Verdict]:
        return {name: r.verdict(name, self.window_seconds) for name, r in self.revisions.items()}


# --- parsing (the operator's side) ------------------------------------------------------------------
class HealthDocumentError(ValueError):
    """The document is not a router /health summary; the message names the field."""


def _get(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, optional: bool = False) -> Any:
    if key not in obj or obj[key] is None:
        if optional:
            return None
        raise HealthDocumentError(f"{where}.{key}: missing")
    value = obj[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise HealthDocumentError(f"{where}.{key}: expected {kind}, got a boolean")
    if not isinstance(value, kind):
        raise HealthDocumentError(f"{where}.{key}: expected {kind}, got {type(value).__name__}")
    return value


def _mode(value: Any, where: str) -> TransferMode | None:
    if value is None:
        return None
    if value not in TRANSFER_MODES:
        raise HealthDocumentError(f"{where}: expected one of {TRANSFER_MODES}, got {value!r}")
    return value  # type: ignore[no-any-return]


def _outcomes(obj: Any, where: str) -> Outcomes:
    if not isinstance(obj, Mapping):
        raise HealthDocumentError(f"{where}: expected an object")
    failures = _get(obj, "failures", dict, where)
    for cause, n in failures.items():
        if not isinstance(n, int) or isinstance(n, bool):
            raise HealthDocumentError(f"{where}.failures.{cause}: expected an integer")
    return Outcomes(_get(obj, "requests", int, where), _get(obj, "succeeded", int, where), dict(failures))


def _ratio(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    value = _get(obj, key, (int, float), where, optional=True)
    return float(value) if value is not None else None


def _routing(obj: Mapping[str, Any] | None, where: str) -> BackendRouting | None:
    if obj is None:
        return None
    return BackendRouting(
        load=float(_get(obj, "load", (int, float), where)),
        read_age_seconds=_ratio(obj, "readAgeSeconds", where),
        expected_hit_ratio=_ratio(obj, "expectedHitRatio", where),
        reported_hit_ratio=_ratio(obj, "reportedHitRatio", where),
        prefix_chunks=_get(obj, "prefixChunks", int, where, optional=True) or 0,
        kv_blocks=_get(obj, "kvBlocks", int, where, optional=True),
        waiting=_ratio(obj, "waiting", where),
        kv_usage=_ratio(obj, "kvUsage", where),
        kv_capacity_tokens=_get(obj, "kvCapacityTokens", int, where, optional=True),
    )


def parse_health(doc: Any) -> RouterHealth:
    """The router's /health JSON (already decoded) -> :class:`RouterHealth`; HealthDocumentError if malformed."""
    if not isinstance(doc, Mapping):
        raise HealthDocumentError("health: expected a JSON object")
    status = _get(doc, "status", str, "health")
    if status not in ("ok", "draining"):
        raise HealthDocumentError(f"health.status: expected 'ok' or 'draining', got {status!r}")
    backends = []
    for i, b in enumerate(_get(doc, "backends", list, "health")):
        where = f"health.backends[{i}]"
        if not isinstance(b, Mapping):
            raise HealthDocumentError(f"{where}: expected an object")
        role = _get(b, "role", str, where)
        if role not in ("prefill", "decode"):
            raise HealthDocumentError(f"{where}.role: expected 'prefill' or 'decode', got {role!r}")
        backends.append(
            BackendHealth(
                pod=_get(b, "pod", str, where),
                backend=_get(b, "backend", str, where),
                role=role,
                revision=_get(b, "revision", str, where),
                mode=_mode(b.get("mode"), f"{where}.mode"),
                inflight=_get(b, "inflight", int, where),
                draining=_get(b, "draining", bool, where),
                ejected=_get(b, "ejected", bool, where),
                routing=_routing(_get(b, "routing", dict, where, optional=True), f"{where}.routing"),
            )
        )
    revisions = {}
    for name, r in _get(doc, "revisions", dict, "health").items():
        where = f"health.revisions.{name}"
        if not isinstance(r, Mapping):
            raise HealthDocumentError(f"{where}: expected an object")
        age = _get(r, "lastSuccessAgeSeconds", (int, float), where, optional=True)
        held = _get(r, "heldOut", dict, where, optional=True) or {}
        revisions[str(name)] = RevisionHealth(
            mode=_mode(r.get("mode"), f"{where}.mode"),
            mode_conflict=_get(r, "modeConflict", str, where, optional=True),
            prefill=_get(r, "prefill", int, where),
            decode=_get(r, "decode", int, where),
            ready_pairs=_get(r, "readyPairs", int, where),
            weight=float(_get(r, "weight", (int, float), where)),
            totals=_outcomes(r, where),
            local=_get(r, "local", int, where),
            recent=_outcomes(_get(r, "recent", dict, where), f"{where}.recent"),
            last_success_age_seconds=float(age) if age is not None else None,
            held_out_prefill=_get(held, "prefill", int, f"{where}.heldOut", optional=True) or 0,
            held_out_decode=_get(held, "decode", int, f"{where}.heldOut", optional=True) or 0,
        )
    return RouterHealth(
        status=status,
        synced=_get(doc, "synced", bool, "health"),
        default_mode=_mode(_get(doc, "defaultMode", str, "health"), "health.defaultMode") or "Push",
        window_seconds=float(_get(doc, "windowSeconds", (int, float), "health")),
        backends=tuple(backends),
        revisions=revisions,
    )
