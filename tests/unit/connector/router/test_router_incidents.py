"""The Events a router records on its model when a decode fails mid-stream: one per failed engine and cause."""

from __future__ import annotations

import datetime

from disagg_connector.contract.health import RouterEventReason
from disagg_connector.router.incidents import Incidents, event_body


def test_a_failed_engines_streams_make_one_event_once_settled():
    incidents = Incidents(window=5.0)
    for t in (0.0, 0.1, 0.2):
        incidents.record("m-decode-0", "r1", "decode_stream_broken", "migrated", t)
    incidents.record("m-decode-0", "r1", "decode_stream_broken", "complete", 0.3)
    assert incidents.due(4.9) == []  # its streams are still being settled
    [draft] = incidents.due(5.0)
    assert draft.reason == RouterEventReason.STREAMS_MIGRATED and draft.type == "Normal"
    assert draft.note == (
        "decode pod m-decode-0 (revision r1) failed mid-stream (decode_stream_broken) with 4 stream(s) on it: "
        "3 continued on another pair; 1 already whole (every token was out)"
    )
    assert incidents.due(100.0) == []  # reported once


def test_any_cut_stream_makes_the_event_a_warning_that_says_why():
    incidents = Incidents(window=5.0)
    incidents.record("m-decode-1", "r2", "decode_stall", "migrated", 0.0)
    incidents.record("m-decode-1", "r2", "decode_stall", "failed", 1.0)
    incidents.record("m-decode-1", "r2", "decode_stall", "refused", 1.0)
    incidents.record("m-decode-2", "r2", "decode_stream_broken", "migrated", 3.0)  # another engine: its own Event
    [first] = incidents.due(6.0)
    assert first.reason == RouterEventReason.STREAMS_CUT and first.type == "Warning"
    assert "1 continued on another pair; 1 cut: the request cannot be continued faithfully; 1 cut: no pair took" in first.note
    [second] = incidents.due(8.0)
    assert "m-decode-2" in second.note and second.reason == RouterEventReason.STREAMS_MIGRATED


def test_the_event_is_about_the_model_kubectl_describe_shows():
    incidents = Incidents(window=0.0)
    incidents.record("m-decode-0", "r1", "decode_stream_broken", "migrated", 0.0)
    [draft] = incidents.due(0.0)
    model = {"metadata": {"name": "m", "namespace": "ns", "uid": "u-1"}}
    body = event_body(draft, model, "m-router-abc", datetime.datetime(2026, 12, 3, 21, 0, tzinfo=datetime.timezone.utc))
    assert body["involvedObject"] == {"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedModel", "name": "m", "namespace": "ns", "uid": "u-1"}
    assert (body["reason"], body["type"], body["metadata"]["namespace"]) == ("StreamsMigrated", "Normal", "ns")
    assert body["reportingInstance"] == "m-router-abc" and body["lastTimestamp"] == "2026-12-03T21:00:00Z"
