"""The I/O of a local run: start the planned engines and routers, wait until they serve, stop them.

Each process runs in its own session (process group), so stopping it also stops the workers vLLM forks
(EngineCore, one per rank); it is stopped by its own pid, SIGTERM first, SIGKILL after a grace period.
Logs go to one file per process in the run's work directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import aiohttp

from .plan import LocalPlan

HEALTH_PATH = "/health"
# Engine log lines worth keeping with the results: backend choices, KV cache size, NIXL, failures.
KEY_LOG_PATTERNS = (
    r"Using .*(backend|attention)",
    r"FlashAttention|FLASH_ATTN",
    r"Model Runner|model runner",
    r"GPU KV cache size|Maximum concurrency|for KV Cache",
    r"NIXL|Nixl|nixl",
    r"[Hh]andshake",
    r"data.parallel|DP Coordinator|data_parallel",
    r"UCX|ucx",
    r"KV Transfer metrics",
    r"Releasing expired|Potentially invalid|registration .* timed out",
    r"Starting vLLM|vLLM API server version|Loading weights took|Model loading took",
    r"\bERROR\b|Traceback|EngineCore failed|Error:",
)


class StartupFailed(RuntimeError):
    pass


def key_log_lines(text: str, limit: int = 80, patterns: Sequence[str] = KEY_LOG_PATTERNS) -> list[str]:
    """The lines of a log that match one of `patterns`, each distinct message once, at most `limit`."""
    rx = re.compile("|".join(f"(?:{p})" for p in patterns))
    seen: set[str] = set()
    out: list[str] = []
    for line in text.splitlines():
        if not rx.search(line):
            continue
        # drop the timestamp/pid prefix for de-duplication
        message = re.sub(r"^.*?\]\s*", "", line)
        if message in seen:
            continue
        seen.add(message)
        out.append(line.strip()[:400])
        if len(out) >= limit:
            break
    return out


@dataclass
class Process:
    name: str
    argv: tuple[str, ...]
    log_path: Path
    popen: subprocess.Popen[bytes]

    @classmethod
    def start(cls, name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path) -> "Process":
        log_path = log_dir / f"{name}.log"
        log = open(log_path, "ab")
        try:
            popen = subprocess.Popen(
                list(argv), env=dict(env), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
        with open(log_dir / "pids", "a") as pids:  # for whoever must clean up after a killed harness
            pids.write(f"{popen.pid} {name}\n")
        return cls(name, tuple(argv), log_path, popen)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 30.0) -> int | None:
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.popen.wait(10)
        else:
            self._signal(signal.SIGKILL)  # workers it left behind in its group
        return self.popen.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)  # its own session: the group id is its pid
        except ProcessLookupError:
            pass

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


async def wait_healthy(procs: Sequence[tuple[Process, str]], timeout: float) -> dict[str, float]:
    """Wait until every (process, base URL) answers 200 on /health; seconds each took. A process that
    exits, or the timeout, raises StartupFailed with the end of its log."""
    t0 = time.monotonic()
    took: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while len(took) < len(procs):
            for proc, url in procs:
                if proc.name in took:
                    continue
                if not proc.alive():
                    raise StartupFailed(f"{proc.name} exited with {proc.popen.returncode} before it was healthy:\n{proc.log_tail()}")
                try:
                    async with session.get(url + HEALTH_PATH) as resp:
                        if resp.status == 200:
                            took[proc.name] = time.monotonic() - t0
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    pass
            if time.monotonic() - t0 > timeout:
                waiting = [p.name for p, _ in procs if p.name not in took]
                tails = "\n".join(f"--- {p.name}:\n{p.log_tail(15)}" for p, _ in procs if p.name in waiting)
                raise StartupFailed(f"not healthy after {timeout:.0f} s: {', '.join(waiting)}\n{tails}")
            await asyncio.sleep(0.5)
    return took


@dataclass
class Running:
    plan: LocalPlan
    engines: list[Process]
    routers: list[Process]
    startup_seconds: dict[str, float]

    def key_log_lines(self) -> dict[str, list[str]]:
        return {p.name: key_log_lines(p.log_text()) for p in self.engines}


def write_static_endpoints(plan: LocalPlan) -> None:
    """Atomically, so a router polling the file never reads half of it."""
    path = Path(plan.static_endpoints_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan.static_endpoints(), indent=1))
    os.replace(tmp, path)


@contextmanager
def started(plan: LocalPlan, log_dir: Path, startup_timeout: float, base_env: Mapping[str, str] | None = None) -> Iterator[Running]:
    """Engines (all at once) and routers of `plan`, healthy; everything stopped on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if base_env is None else base_env)
    engines: list[Process] = []
    routers: list[Process] = []
    try:
        for e in plan.engines:
            engines.append(Process.start(f"{e.label}-{plan.transfer_mode.lower()}", e.argv, {**env, **e.env}, log_dir))
        write_static_endpoints(plan)
        for r in plan.routers:
            routers.append(Process.start(f"router-{r.mode}" + (f"-r{r.replica}" if r.replica else ""), r.argv, env, log_dir))
        took = asyncio.run(wait_healthy(
            [*zip(engines, [e.url for e in plan.engines]), *zip(routers, [r.url for r in plan.routers])], startup_timeout
        ))
        yield Running(plan, engines, routers, took)
    finally:
        for proc in routers + engines:
            proc.stop()
