"""One test session per local cluster: a second session on the same state dir waits for the first to end, instead
of sharing its control plane (two operators reconciling every model; the first to end stopping it under the other).
A cluster of another state dir (DISAGG_STATE, as a side cluster has) does not wait."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

from tests.fixtures.e2e.cluster import CLUSTER_SH, one_session_per_cluster


def _enter_in_a_thread(state: Path) -> tuple[threading.Event, threading.Event, threading.Thread]:
    """A second session on `state`, in a thread: set `entered` once it holds the cluster; it ends on `leave`."""
    entered, leave = threading.Event(), threading.Event()

    def session() -> None:
        with one_session_per_cluster(state):
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=session, daemon=True)
    thread.start()
    return entered, leave, thread


def test_a_second_session_on_one_cluster_waits_for_the_first_to_end(tmp_path):
    state = tmp_path / "cluster"
    with one_session_per_cluster(state):
        entered, leave, thread = _enter_in_a_thread(state)
        assert not entered.wait(0.5)  # held by the first session all along
    assert entered.wait(10)  # the first ended: the second goes on
    leave.set()
    thread.join(10)


def test_a_cluster_of_another_state_dir_does_not_wait(tmp_path):
    with one_session_per_cluster(tmp_path / "cluster"):
        entered, leave, thread = _enter_in_a_thread(tmp_path / "side")
        assert entered.wait(10)
        leave.set()
        thread.join(10)


def test_cluster_sh_env_names_the_state_dir_it_was_given(tmp_path):
    env = subprocess.run(["bash", str(CLUSTER_SH), "env"], env={**os.environ, "DISAGG_STATE": str(tmp_path / "side")},
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    assert f"export DISAGG_STATE={tmp_path / 'side'}\n" in env
