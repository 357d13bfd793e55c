"""Ranks hosted in a child process and driven over a pipe (tests and tools).

``spawn_actor()`` starts a process (multiprocessing *spawn*) that hosts any number of producer or
consumer endpoints by name and answers commands; :class:`ActorHandle` sends them with a timeout,
so a test never hangs on a dead child.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import traceback
from typing import Any


class ActorError(RuntimeError):
    pass


def _serve(conn: Any) -> None:
    from .consumer import KVConsumer
    from .layout import KVLayout
    from .memory import KVMemory, pattern
    from .producer import KVProducer

    eps: dict[str, Any] = {}
    pending: dict[str, list] = {}
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "exit":
                for ep in eps.values():
                    ep.close()
                conn.send(("ok", None))
                break
            if cmd == "die":
                os._exit(3)
            if cmd == "create":
                name, spec = args
                layout = KVLayout.from_dict(spec["layout"])
                mem = KVMemory(layout, spec.get("device", "cpu"))
                if spec["role"] == "prefill":
                    ep = KVProducer(spec["engine_id"], mem, spec.get("backend", "UCX"), lease_s=spec.get("lease_s", 30.0), coalesce_descs=spec.get("coalesce", True))
                else:
                    ep = KVConsumer(spec["engine_id"], mem, spec.get("backend", "UCX"), prep=spec.get("prep", "inline"), coalesce_descs=spec.get("coalesce", True), reg_send=spec.get("reg_send", "background"))
                eps[name] = ep
                pending[name] = []
                res: Any = ep.info_blob()
            elif cmd == "add_peer":
                name, blob = args
                eps[name].add_peer(blob)
                res = None
            elif cmd == "fill":
                name, blocks, ntok, seed = args
                ep = eps[name]
                ep.memory.write_tokens(blocks, ntok, pattern(ep.layout, ntok, seed))
                res = None
            elif cmd == "check":
                name, blocks, ntok, seed = args
                ep = eps[name]
                got = ep.memory.read_tokens(blocks, ntok)
                res = bool((got == pattern(ep.layout, ntok, seed)).all())
            elif cmd == "zero":
                eps[args].memory.tensor()[:] = 0
                res = None
            elif cmd == "call":
                name, method, a, kw = args
                res = getattr(eps[name], method)(*a, **kw)
            elif cmd == "wait":
                name, n, timeout_s = args
                ep = eps[name]
                import time

                end = time.monotonic() + timeout_s
                got = pending[name]
                while len(got) < n and time.monotonic() < end:
                    got.extend(ep.poll())
                    time.sleep(0.001)
                res = [dataclasses.asdict(r) for r in got[:n]]
                del got[:n]
            else:
                raise ActorError(f"unknown command {cmd}")
            conn.send(("ok", res))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class ActorHandle:
    def __init__(self, proc: Any, conn: Any) -> None:
        self.proc = proc
        self.conn = conn

    def ask(self, cmd: str, *args: Any, timeout_s: float = 60.0) -> Any:
        self.conn.send((cmd, args if len(args) != 1 else args[0]))
        if not self.conn.poll(timeout_s):
            raise ActorError(f"actor did not answer {cmd!r} within {timeout_s} s")
        status, res = self.conn.recv()
        if status != "ok":
            raise ActorError(res)
        return res

    def create(self, name: str, **spec: Any) -> bytes:
        return self.ask("create", name, spec)

    def call(self, name: str, method: str, *a: Any, **kw: Any) -> Any:
        return self.ask("call", name, method, a, kw)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.ask("exit", timeout_s=10)
            except Exception:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def spawn_actor() -> ActorHandle:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    child.close()
    return ActorHandle(proc, parent)
