"""Drift detection: equal means no request; a hand edit or a changed manifest means apply."""

from __future__ import annotations

import copy

from disagg_operator.drift import HASH_ANNOTATION, contains, needs_apply, stamped

DESIRED = stamped({
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "d", "namespace": "n", "labels": {"a": "b"}},
    "spec": {"replicas": 2, "template": {"spec": {"containers": [{
        "name": "c", "env": [{"name": "X", "value": ""}],
        "resources": {"limits": {"memory": "1.5Gi", "cpu": "8"}},
    }]}}},
})  # fmt: skip


def live_copy() -> dict:
    live = copy.deepcopy(DESIRED)
    live["metadata"]["uid"] = "u"  # server-added fields are ignored
    live["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "X"}]  # omitempty
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"memory": "1536Mi", "cpu": "8"}
    live["spec"]["progressDeadlineSeconds"] = 600
    return live


def test_normalised_live_object_needs_nothing() -> None:
    assert not needs_apply(DESIRED, live_copy())


def test_hand_edit_of_owned_field_is_drift() -> None:
    live = live_copy()
    live["spec"]["replicas"] = 5
    assert needs_apply(DESIRED, live)


def test_changed_manifest_is_applied_even_when_fields_still_match() -> None:
    live = live_copy()
    live["metadata"]["annotations"][HASH_ANNOTATION] = "older"
    assert needs_apply(DESIRED, live)
    assert needs_apply(DESIRED, None)


def test_lists_compare_element_by_element() -> None:
    assert not contains([1, 2], [1, 2, 3])
    assert contains([{"a": 1}], [{"a": 1, "b": 2}])
