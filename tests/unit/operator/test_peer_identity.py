"""The operator's identity among kopf peers: kopf's own where it can make one, the uid where the container's
user has no name (the image's 65532 has no /etc/passwd entry, and getpass.getuser() raises)."""

from __future__ import annotations

import getpass

import pytest

from disagg_operator.cli import peer_identity


def _no_user_name() -> str:
    raise OSError("No username set in the environment")  # what Python 3.13's getuser raises for uid 65532


def test_pod_id_is_kopfs_own() -> None:
    assert peer_identity({"POD_ID": "disagg-operator-6c95-rzbkj"}, 65532, "node", 1) is None


def test_a_user_without_a_name_is_known_by_its_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(getpass, "getuser", _no_user_name)
    assert peer_identity({}, 65532, "disagg-operator-6c95-rzbkj", 7) == "uid65532@disagg-operator-6c95-rzbkj/7"


def test_a_named_user_is_kopfs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(getpass, "getuser", lambda: "ops")
    assert peer_identity({}, 1000, "laptop", 7) is None
