"""Start simulated engines and routers as separate processes on loopback (tests and benchmarks).

Every process gets free ports picked at launch, logs to a file, and is stopped by its own pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from disagg_connector import contract
from disagg_bench.ports import free_port, free_port_block, free_ports  # noqa: F401 - the harness's port picks

REPO = Path(__file__).resolve().parents[3]
HOST = "127.0.0.1"
MODEL = "sim-model"


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_json(url: str) -> Any:
    status, body = http_get(url)
    assert status == 200, (url, status, body[:200])
    return json.loads(body)


def wait_until(pred: Any, timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll pred() until it returns a truthy value (event-based waits; generous deadlines, no timing asserts)."""
    end = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < end:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - e.g. connection refused while starting
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else ""))


class Proc:
    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name, self.argv, self.log_dir = name, argv, log_dir
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "bench"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def relaunch(self, suffix: str) -> Proc:
        """The same command again (same ports, same identity), logging to a new file."""
        return Proc(f"{self.name}-{suffix}", self.argv, self.log_dir)


@dataclass
class Sim:
    proc: Proc
    role: str
    mode: str
    name: str
    uid: str
    revision: str
    port: int
    side_port: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    engine_id_override: str | None = None
    dp_start: int = 0  # the first global rank this "pod" serves
    dp_local: int | None = None  # how many (None: all dp, the one-pod engine)
    group: tuple[str, int, int] | None = None  # (LWS name, group index, worker index) of a pod of a multi-pod engine

    @property
    def engine_id(self) -> str:
        return self.engine_id_override or contract.engine_id(self.name, self.uid)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def static_entry(self, **overrides: Any) -> dict[str, Any]:
        e: dict[str, Any] = {
            "role": self.role,
            "revision": self.revision,
            "name": self.name,
            "uid": self.uid,
            "host": HOST,
            "http_port": self.port,
            "side_channel_port": self.side_port,
            "tp_size": self.tp,
            "pp_size": self.pp,
            "dp_size": self.dp,
        }
        if self.dp_local is not None:
            e["dp_size_local"] = self.dp_local
        if self.group is not None:
            e["lws"], e["group_index"], e["worker_index"] = self.group
        e.update(overrides)
        return e

    def stats(self) -> dict[str, Any]:
        return get_json(self.url + "/sim/stats")

    def counter(self, name: str) -> int:
        return int(self.stats()["counters"].get(name, 0))

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        evs = get_json(self.url + "/sim/events")["events"]
        return [e for e in evs if kind is None or e["kind"] == kind]

    def body(self, xid: str) -> bytes | None:
        status, data = http_get(f"{self.url}/sim/body/{xid}")
        return data if status == 200 else None

    def ready(self) -> bool:
        return http_get(self.url + "/health", timeout=2)[0] == 200

    def control(self, **faults: Any) -> dict[str, Any]:
        """POST /sim/control: die="why", fail_transfers=bool, unavailable=bool."""
        req = urllib.request.Request(self.url + "/sim/control", json.dumps(faults).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def restart(self) -> None:
        """After it exited: the same engine again (a container restart keeps the pod's ports and identity)."""
        assert not self.proc.alive(), "stop it (or let it die) first"
        self.proc.stop()
        self.proc = self.proc.relaunch(f"r{uuid.uuid4().hex[:4]}")

    def listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex((HOST, self.port)) == 0


FAST = {"prefill_us_per_token": 100.0, "tpot_ms": 2.0, "step_ms": 2.0, "registration_rtt_ms": 0.5}


def launch_sim(
    log_dir: Path,
    role: str,
    mode: str = "push",
    revision: str = "r1",
    name: str | None = None,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    lease_seconds: float = 30.0,
    compat_hash: str | None = None,
    engine_id: str | None = None,
    group: tuple[str, int, int] | None = None,
    dp_local: int | None = None,
    side_port: int | None = None,
    group_leader: Sim | None = None,
    extra: Iterable[str] = (),
    **timing: float,
) -> Sim:
    """Start a simulated engine (does not wait: see wait_ready).

    One pod of an engine that spans pods: ``group`` = (LWS name, group index, worker index) and ``dp_local``
    ranks per pod; it serves ranks [worker index x dp_local, + dp_local) of ``dp``. Its pods share the
    side-channel base (``side_port``: a free_port_block(dp) for all of them), each listening on base + its ranks.
    ``group_leader``: a worker pod's leader; then the pods fail together (``sim.Engine.group_watch``).
    """
    name = name or f"{revision}-{role}-{uuid.uuid4().hex[:6]}"
    uid = str(uuid.uuid4())
    if side_port is not None:
        port, side = free_port(), side_port
    else:
        port, side = free_ports(2) if dp == 1 else (free_port(), free_port_block(dp))
    dp_start = group[2] * dp_local if group is not None and dp_local else 0
    eid = engine_id or contract.engine_id(name, uid)
    argv = [
        sys.executable, "-m", "disagg_bench.vllm_sim", "--role", role, "--mode", mode, "--host", HOST, "--port", str(port),
        "--side-channel-port", str(side), "--engine-id", eid, "--served-model-name", MODEL, "--tp-size", str(tp),
        "--pp-size", str(pp), "--dp-size", str(dp), "--lease-seconds", str(lease_seconds),
        "--compat-hash", compat_hash or f"hash-{revision}", "--record-bodies",
    ]
    if dp_local is not None:
        argv += ["--dp-start-rank", str(dp_start), "--dp-size-local", str(dp_local)]
    if group_leader is not None:
        argv += ["--group-leader", group_leader.url, "--group-leader-engine-id", group_leader.engine_id]
    for k, v in {**FAST, **timing}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    argv += list(extra)
    proc = Proc(name, argv, log_dir)
    return Sim(proc, role, mode, name, uid, revision, port, side, tp, pp, dp, engine_id, dp_start, dp_local, group)


def wait_ready(*things: Any, timeout: float = 60.0) -> None:
    for t in things:
        wait_until(lambda: (t.proc.alive() or _died(t)) and t.ready(), timeout, what=f"{t.proc.name} ready")


def _died(t: Any) -> bool:
    raise RuntimeError(f"{t.proc.name} exited with {t.proc.popen.returncode}:\n{t.proc.log_text()[-3000:]}")


def write_static(path: Path, entries: list[dict[str, Any]]) -> None:
    """Atomic replace, so the router never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"endpoints": entries}, indent=1))
    os.replace(tmp, path)


@dataclass
class Router:
    proc: Proc
    port: int
    static_path: Path
    mode: str
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def ready(self) -> bool:
        return http_get(self.url + "/health", timeout=2)[0] == 200

    def health(self) -> dict[str, Any]:
        return json.loads(http_get(self.url + "/health")[1])

    def metrics(self) -> str:
        return http_get(self.url + "/metrics")[1].decode()

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one sample of /metrics (None: no such sample)."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.metrics()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return None

    def serving(self) -> set[str]:
        """Revisions with at least one ready pair, per /health."""
        return {name for name, r in self.health()["revisions"].items() if r["readyPairs"]}

    def wait_table(self, serving: set[str], timeout: float = 30.0) -> None:
        """Wait until exactly these revisions have ready pairs in the router's table."""
        wait_until(lambda: self.serving() == serving, timeout, what=f"router table {serving}")

    def backend(self, pod: str) -> dict[str, Any]:
        [b] = [b for b in self.health()["backends"] if b["pod"] == pod]
        return b


def launch_router(
    log_dir: Path,
    static_path: Path,
    mode: str = "push",
    *,
    leg_timeout: float | None = None,
    max_retries: int = 1,
    grace: float = 20.0,
    extra: Iterable[str] = (),
    name: str = "router",
) -> Router:
    """A router on the static file (its leg deadline: the router's default unless given)."""
    port = free_port()
    # push-sequential is a benchmark's dispatcher, not a mode of the production router.
    program = "disagg_bench.localrun.baseline_router" if mode == "push-sequential" else "disagg_connector.router"
    argv = [
        sys.executable, "-m", program, "--served-model-name", MODEL, "--mode", mode,
        "--static-endpoints", str(static_path), "--host", HOST, "--port", str(port),
        "--max-retries", str(max_retries), "--shutdown-grace-seconds", str(grace), *extra,
    ]
    if leg_timeout is not None:
        argv += ["--leg-timeout-seconds", str(leg_timeout)]
    return Router(Proc(name, argv, log_dir), port, static_path, mode, argv)


# --- client helpers (async; tests wrap them in asyncio.run) -----------------------------------------------
@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def xid(self) -> str | None:
        return self.headers.get("x-request-id")


async def post(url: str, body: Any, *, timeout: float = 120.0, raw: bytes | None = None) -> Reply:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        kw: dict[str, Any] = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw is not None else {"json": body}
        async with s.post(url, **kw) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read())


def completion(model: str = MODEL, prompt_words: int = 8, max_tokens: int = 4, stream: bool = False, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": " ".join(["word"] * prompt_words), "max_tokens": max_tokens, "stream": stream, **kw}


def chat(model: str = MODEL, words: int = 8, max_tokens: int = 4, stream: bool = False, **kw: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": " ".join(["word"] * words)}]
    return {"model": model, "messages": msgs, "max_tokens": max_tokens, "stream": stream, **kw}


def stop_all(*things: Any) -> None:
    for t in things:
        if t is not None:
            t.proc.stop()


# `vllm serve` replaced by the simulator, reading the same command line (bench/disagg_bench/vllm_sim/as_vllm.py)
AS_VLLM = (sys.executable, "-m", "disagg_bench.vllm_sim.as_vllm")


def localrun_bench(model: Path, out: Path, gpus: int, *options: str, vllm: str = " ".join(AS_VLLM),
                   profile: str | None = "fast", port_base: int | None = None, timeout: float | None = None,
                   ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`disagg-localrun bench` of MODEL on GPUS local "GPUs" (engines placed by localrun), with the simulator
    (timed by PROFILE) in place of vLLM and dummy weights, writing to OUT; OPTIONS are the sweep's."""
    cmd = [
        sys.executable, "-m", "disagg_bench.localrun", "bench", "-f", str(model), "--gpus", ",".join(map(str, range(gpus))),
        "--vllm", vllm, *(("--env", f"DISAGG_SIM_PROFILE={profile}") if profile else ()),
        "--port-base", str(port_base if port_base is not None else free_port_block(64)), "--load-format", "dummy",
        "--out", str(out), *options,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench")])}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
