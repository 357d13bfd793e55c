"""The test bed's port picks: a port handed out is not handed out again, here or in another run, until its owner
has had time to bind it; a port something holds is never handed out."""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
from typing import Iterator

import pytest

from tests.fixtures.models import REPO
from disagg_bench import ports


@pytest.fixture
def ledger(tmp_path, monkeypatch, spare) -> Iterator[list[int]]:
    """A ledger of its own (reservations under tmp_path, nothing held); yields a list the picks' candidate bases
    are drawn from, in order (random.randrange replaced by it). After `spare`, which uses the real one."""
    monkeypatch.setattr(ports, "RESERVATIONS", tmp_path / "reservations")
    monkeypatch.setattr(ports, "_held", collections.OrderedDict())
    candidates: list[int] = []
    monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: candidates.pop(0))
    yield candidates
    for fd in ports._held.values():
        ports.os.close(fd)


@pytest.fixture
def spare() -> int:
    """The first of 16 ports nothing binds now (picked by the real ledger, released at once)."""
    base = ports.free_port_block(16)
    for port in range(base, base + 16):
        ports._release(port)
    return base


def test_a_block_handed_out_is_not_handed_out_again_before_it_is_bound(ledger, spare):
    ledger += [spare, spare + 2, spare + 3, spare + 8]
    assert ports.free_port_block(4) == spare  # reserved, not bound yet: the pods start after every pick
    assert ports.free_port() == spare + 8  # spare + 2 and + 3 lie inside the block
    assert set(ports._held) == {spare, spare + 1, spare + 2, spare + 3, spare + 8}


def test_a_port_another_process_reserved_is_skipped_until_that_process_exits(ledger, spare):
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from disagg_bench import ports; "
         f"ports.RESERVATIONS = Path({str(ports.RESERVATIONS)!r}); "
         f"assert ports._reserve({spare}); print('held', flush=True); sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert other.stdout is not None and other.stdout.readline() == "held\n"
        ledger += [spare, spare + 5]
        assert ports.free_port() == spare + 5
    finally:
        other.communicate("")
    ledger.append(spare)
    assert ports.free_port() == spare  # the kernel dropped the other run's lock with it


def test_a_port_something_listens_on_is_skipped(ledger, spare):
    with socket.socket() as s:
        s.bind((ports.HOST, spare + 1))
        s.listen()
        ledger += [spare, spare + 1, spare + 4]
        assert ports.free_port_block(2) == spare + 4  # spare..spare+1 holds a bound port
        assert spare not in ports._held  # the half of a block that was reserved is let go


def test_a_process_lets_its_oldest_reservations_go(ledger, spare, monkeypatch):
    monkeypatch.setattr(ports, "HOLD", 2)
    ledger += [spare, spare + 1, spare + 2, spare]
    assert [ports.free_port() for _ in range(3)] == [spare, spare + 1, spare + 2]
    assert list(ports._held) == [spare + 1, spare + 2]
    assert ports.free_port() == spare
