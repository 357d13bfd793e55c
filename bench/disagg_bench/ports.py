"""Loopback ports for the processes a test starts: picked here, bound a moment later by the process itself.

Between the pick and the bind, nothing else may be handed the same port:
- not a client socket: the ports lie below Linux's default ephemeral range (32768-60999), so no outgoing
  connection is given one (a port from bind(0) was, under CI load: "address already in use");
- not another pick of this process: a test picks several ports before it starts anything (a side-channel base for
  two pods, then each pod's HTTP port: CI once gave a pod's HTTP port inside the block its peer bound next);
- not a pick of another test run on the same machine (CI beside a second copy of itself).
So every pick is reserved with an flock on a file per port in a directory every run shares. The kernel drops the
lock when the process exits. A process keeps its newest reservations (`HOLD`) and lets older ones go: by then
their owner has bound them, and a bound port fails the bind probe of every later pick anyway.
"""

from __future__ import annotations

import collections
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

HOST = "127.0.0.1"
RANGE = (21000, 32768)
RESERVATIONS = Path(tempfile.gettempdir()) / "disagg-test-ports"
HOLD = 512

_held: collections.OrderedDict[int, int] = collections.OrderedDict()  # port -> fd holding its lock, oldest first


def _reserve(port: int) -> bool:
    if port in _held:
        return False
    RESERVATIONS.mkdir(mode=0o777, exist_ok=True)
    fd = os.open(RESERVATIONS / str(port), os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _held[port] = fd
    return True


def _release(port: int) -> None:
    os.close(_held.pop(port))


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port_block(n: int) -> int:
    """The first of n consecutive ports, reserved for this process and free now (a harness that numbers its ports
    from a base: a side channel per rank, localrun's port base)."""
    for _ in range(500):
        base = random.randrange(RANGE[0], RANGE[1] - n)
        taken: list[int] = []
        for port in range(base, base + n):
            if not _reserve(port):
                break
            taken.append(port)
            if not _binds(port):
                break
        else:
            while len(_held) > HOLD:
                _release(next(iter(_held)))
            return base
        for port in taken:
            _release(port)
    raise RuntimeError(f"no {n} consecutive free ports in {RANGE} (reservations in {RESERVATIONS})")


def free_port() -> int:
    """One port, as free_port_block(1)."""
    return free_port_block(1)


def free_ports(n: int) -> list[int]:
    """n distinct ports, each as free_port() (each pick is reserved, so they differ)."""
    return [free_port() for _ in range(n)]
