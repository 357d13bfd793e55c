"""disagg-drain, the engines' preStop: the decision on real vLLM /metrics text, the loop, and the program
against a local HTTP server.

The fixtures are vLLM's own output: ``vllm.v1.metrics.loggers.PrometheusStatLogger`` of vLLM 0.26.0 and
0.33.0 (the CPU environments hack/setup.sh builds), constructed with a stand-in VllmConfig (served model
name, two engines: DP 2), fed ``SchedulerStats(0 running, 0 waiting, 0 skipped waiting, usage 0.0)`` for
each engine through ``record(..., engine_idx=i)``, rendered with ``prometheus_client.generate_latest()``;
kept: the three gauges the drain reads and their neighbours a name match could confuse
(``vllm:num_requests_waiting_by_reason``), a counter and a histogram. Other states are the same text with
sample values changed, as ``record`` changes them: running -> ``num_requests_running``; WAITING and
WAITING_FOR_REMOTE_KVS (0.26.0 ``skipped_waiting``, 0.33.0 ``kv_holding_waiting``) -> ``num_requests_waiting``
(= capacity + deferred); ``BlockPool.get_usage`` -> ``kv_cache_usage_perc``. With ``--api-server-count``
> 1 vLLM serves the same families through prometheus_client's multiprocess collector (no ``_created``).
"""

from __future__ import annotations

import re
import socket
import threading
import urllib.error
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from disagg_connector import contract, drain
from disagg_connector.drain import Unreachable, Verdict, decide
from tests.fixtures.releases import RELEASES, VLLM_0_33_0_IDLE, with_values

REPO = Path(__file__).resolve().parents[3]

# vLLM 0.26.0 and 0.33.0 render these families identically but for the _created timestamps.

def without(text: str, name: str) -> str:
    """``text`` without the family ``name`` (its HELP, TYPE and samples)."""
    return "".join(line for line in text.splitlines(keepends=True) if not re.match(rf"^(# (HELP|TYPE) )?{re.escape(name)}[ {{]", line))


# --- the decision ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("release", RELEASES)
def test_an_idle_engine_is_idle(release: str) -> None:
    verdict = decide(RELEASES[release])
    assert verdict == Verdict(True, ()) and verdict.describe() == "nothing running or waiting, KV cache free"


@pytest.mark.parametrize("release", RELEASES)
def test_running_requests_are_summed_over_engines(release: str) -> None:
    text = with_values(RELEASES[release], {(drain.RUNNING, "0"): 1.0, (drain.RUNNING, "1"): 2.0, (drain.KV_USAGE, "1"): 0.25})
    verdict = decide(text)
    assert not verdict.idle and verdict.kinds == ("running", "kv"), verdict
    assert verdict.describe() == "3 running, KV blocks in use (usage 0.25)"


@pytest.mark.parametrize("release", RELEASES)
def test_a_decode_waiting_for_its_remote_kv_is_busy(release: str) -> None:
    """WAITING_FOR_REMOTE_KVS: vLLM counts it in num_requests_waiting (reason "deferred"), and its blocks are
    allocated; either keeps the engine busy."""
    text = with_values(RELEASES[release], {(drain.WAITING, "1"): 1.0, ("vllm:num_requests_waiting_by_reason", "1", 'reason="deferred"'): 1.0})
    assert decide(text).kinds == ("waiting",)


@pytest.mark.parametrize("release", RELEASES)
def test_a_prefill_holding_kv_for_its_decode_is_busy(release: str) -> None:
    """Pull: the request finished on P (nothing running or waiting) but its blocks stay referenced until
    D reads them or the lease expires: vLLM counts them as used."""
    verdict = decide(with_values(RELEASES[release], {(drain.KV_USAGE, "0"): 0.0009765625}))
    assert not verdict.idle and verdict.kinds == ("kv",) and "0.000977" in verdict.describe()


@pytest.mark.parametrize("release", RELEASES)
def test_only_the_exact_gauges_count(release: str) -> None:
    """vllm:num_requests_waiting_by_reason and the counters and histograms around are not the gauges."""
    text = with_values(RELEASES[release], {("vllm:num_requests_waiting_by_reason", "0", 'reason="capacity"'): 4.0, ("vllm:prefix_cache_queries_total", "0"): 9.0,
                                           ("vllm:request_params_n_count", "1"): 3.0})  # fmt: skip
    assert decide(text).idle


@pytest.mark.parametrize("release", RELEASES)
def test_what_it_cannot_read_counts_as_busy(release: str) -> None:
    verdict = decide(without(RELEASES[release], drain.KV_USAGE))
    assert not verdict.idle and verdict.kinds == (f"missing:{drain.KV_USAGE}",)
    nan = decide(with_values(RELEASES[release], {(drain.RUNNING, "1"): float("nan")}))
    assert not nan.idle and nan.kinds == (f"nan:{drain.RUNNING}",)
    assert decide("").kinds == tuple(f"missing:{name}" for name in drain.GAUGES), "--disable-log-stats: no gauges"
    assert decide("<html><body>502 Bad Gateway</body></html>").kinds == ("unreadable",)


# --- the loop, with a fake clock --------------------------------------------------------------------------
class Script:
    """A fetch that answers from a list (text, or an exception to raise), and a clock that sleep() moves."""

    def __init__(self, answers: list[Any]):
        self.answers = list(answers)
        self.now = 100.0
        self.fetches = 0
        self.sleeps: list[float] = []
        self.lines: list[str] = []

    def fetch(self, url: str, timeout: float) -> str:
        assert url == "http://10.0.0.1:8000/metrics" and 0 < timeout <= drain.FETCH_TIMEOUT_SECONDS
        self.fetches += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds

    def run(self, deadline: float) -> str:
        return drain.drain("http://10.0.0.1:8000/metrics", deadline, fetch=self.fetch, clock=lambda: self.now,
                           sleep=self.sleep, out=self.lines.append)  # fmt: skip


IDLE = VLLM_0_33_0_IDLE
RUNNING = with_values(IDLE, {(drain.RUNNING, "0"): 1.0})
HELD = with_values(IDLE, {(drain.KV_USAGE, "0"): 0.01})


def test_idle_twice_in_a_row_ends_it() -> None:
    s = Script([IDLE])
    assert s.run(60) == "idle"
    assert s.fetches == 2 and s.sleeps == [drain.INTERVAL_SECONDS]
    assert len(s.lines) == 2 and s.lines[-1].startswith("disagg-drain: idle after 1s")


def test_busy_until_the_stream_ends_and_the_kv_is_read() -> None:
    """A stream running, then finished with its KV still held, a blip of idle, a new waiting request, then
    idle: one line per change of state, and only two idle reads in a row end it."""
    s = Script([RUNNING, RUNNING, HELD, IDLE, RUNNING, RUNNING, IDLE, IDLE])
    assert s.run(60) == "idle"
    assert s.fetches == 8
    assert [line.split(": ", 1)[1].split(" at ")[0] for line in s.lines] == ["busy", "busy", "idle", "busy", "idle", "idle after 7s (nothing running or waiting, KV cache free): exit for SIGTERM"]
    assert "1 running" in s.lines[0] and "KV blocks in use" in s.lines[1]


def test_it_gives_up_at_the_deadline_and_says_what_was_in_flight() -> None:
    s = Script([HELD])
    assert s.run(5.5) == "deadline"
    assert sum(s.sleeps) == pytest.approx(5.5) and s.fetches == 7
    assert len(s.lines) == 2
    assert s.lines[-1] == "disagg-drain: deadline of 5.5s passed, still in flight: KV blocks in use (usage 0.01)"


def test_a_zero_deadline_reads_once() -> None:
    s = Script([RUNNING])
    assert s.run(0) == "deadline" and s.fetches == 1 and not s.sleeps


def test_an_engine_that_does_not_listen_has_nothing_in_flight() -> None:
    s = Script([Unreachable("[Errno 111] Connection refused")])
    assert s.run(60) == "unreachable" and s.fetches == 1 and not s.sleeps
    assert s.lines == ["disagg-drain: the engine does not listen at http://10.0.0.1:8000/metrics ([Errno 111] Connection refused): nothing in flight"]


def test_an_engine_that_answers_nothing_may_be_busy() -> None:
    """A timeout or an HTTP error is not "idle": the engine may be stuck with requests; keep watching."""
    s = Script([TimeoutError("timed out"), OSError("HTTP Error 500"), IDLE, IDLE])
    assert s.run(60) == "idle" and s.fetches == 4
    assert "unreadable (TimeoutError: timed out)" in s.lines[0]


# --- a pod of an engine group waits for the whole group --------------------------------------------------------
OWN, LEADER_URL = "http://127.0.0.1:8000/metrics", "http://m-decode-abc-0.m-decode-abc.ns:8000/metrics"
WORKER_2_URL = "http://m-decode-abc-0-2.m-decode-abc.ns:8000/metrics"
GROUP_ENV = {contract.LWS_LEADER_ADDRESS_ENV: "m-decode-abc-0.m-decode-abc.ns", contract.LWS_GROUP_SIZE_ENV: "3",
             contract.LWS_WORKER_INDEX_ENV: "1"}  # fmt: skip


class GroupScript(Script):
    """Answers per engine: ``answers`` maps each URL to its list (the last answer repeats)."""

    def __init__(self, answers: dict[str, list[Any]]):
        super().__init__([IDLE])
        self.by_url = {url: list(a) for url, a in answers.items()}
        self.read: list[str] = []

    def fetch(self, url: str, timeout: float) -> str:
        self.read.append(url)
        queue = self.by_url[url]
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def run(self, deadline: float) -> str:
        return drain.drain(OWN, deadline, peers=drain.group_peer_urls(GROUP_ENV, 8000), fetch=self.fetch,
                           clock=lambda: self.now, sleep=self.sleep, out=self.lines.append)  # fmt: skip


def test_a_pod_of_a_group_reads_every_other_pod_at_the_names_lws_gives_them() -> None:
    assert drain.group_peer_urls(GROUP_ENV, 8000) == [LEADER_URL, WORKER_2_URL]
    assert drain.group_peer_urls({**GROUP_ENV, contract.LWS_WORKER_INDEX_ENV: "0"}, 8000) == [
        "http://m-decode-abc-0-1.m-decode-abc.ns:8000/metrics", WORKER_2_URL]
    assert drain.group_peer_urls({}, 8000) == []  # an engine of one pod: no LWS env
    assert drain.group_peer_urls({**GROUP_ENV, contract.LWS_GROUP_SIZE_ENV: "1"}, 8000) == []


def test_an_idle_pod_of_a_group_waits_until_every_pod_of_it_is_idle() -> None:
    """Its own ranks idle, the leader's streaming: SIGTERM here would end the leader's streams too (their
    collectives need this pod's ranks). Only when the whole group is idle twice in a row does it return."""
    s = GroupScript({OWN: [IDLE], LEADER_URL: [RUNNING, RUNNING, HELD, IDLE], WORKER_2_URL: [IDLE]})
    assert s.run(60) == "idle"
    assert s.read[:3] == [OWN, LEADER_URL, WORKER_2_URL] and len(s.read) == 3 * 5
    assert "m-decode-abc-0.m-decode-abc.ns:8000: 1 running" in s.lines[0]
    assert "KV blocks in use" in s.lines[1] and s.lines[-1].startswith("disagg-drain: idle after 4s")


def test_a_group_missing_a_pod_has_nothing_that_can_finish() -> None:
    """A pod of the group that does not listen, or whose name no longer resolves (the pod is gone): the group's
    collectives are already broken, its streams already lost; waiting would only hold the node."""
    s = GroupScript({OWN: [RUNNING], LEADER_URL: [RUNNING], WORKER_2_URL: [Unreachable("the name does not resolve")]})
    assert s.run(60) == "group-broken" and not s.sleeps
    assert s.lines == [f"disagg-drain: a pod of this engine's group does not answer at {WORKER_2_URL} (the name does "
                       f"not resolve): the group's collectives cannot go on without it, nothing in flight can finish"]  # fmt: skip


def test_a_name_that_does_not_resolve_is_unreachable_and_other_dns_failures_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    def resolve(host: str, *args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME if host.startswith("gone") else socket.EAI_AGAIN, f"{host}: no answer")

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with pytest.raises(Unreachable, match="does not resolve"):
        drain.fetch_metrics("http://gone-0.m.ns:8000/metrics", 1)
    with pytest.raises(urllib.error.URLError):  # the DNS server not answering says nothing of the pod: keep watching
        drain.fetch_metrics("http://busy-0.m.ns:8000/metrics", 1)


# --- the program, against a local HTTP server ---------------------------------------------------------------
class Metrics:
    """A /metrics endpoint that serves ``busy`` for its first ``busy_reads`` scrapes, then ``idle``."""

    def __init__(self, busy: str, busy_reads: int, idle: str):
        self.busy, self.busy_reads, self.idle = busy, busy_reads, idle
        self.scrapes = 0
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.paths.append(self.path)
                outer.scrapes += 1
                body = (outer.busy if outer.scrapes <= outer.busy_reads else outer.idle).encode()
                self.send_response(200)
                # what prometheus_client's exposition sends (vLLM mounts make_asgi_app at /metrics)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture
def metrics_server(request: pytest.FixtureRequest) -> Iterator[Metrics]:
    busy, busy_reads = request.param
    server = Metrics(busy, busy_reads, IDLE)
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.mark.parametrize("metrics_server", [(RUNNING, 3)], indirect=True)
def test_the_program_waits_for_the_engine_then_exits_0(metrics_server: Metrics, capsys: pytest.CaptureFixture[str]) -> None:
    code = drain.main(["--port", str(metrics_server.port), "--deadline-seconds", "30", "--interval-seconds", "0.05"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert metrics_server.scrapes == 5 and set(metrics_server.paths) == {"/metrics"}
    assert len(lines) == 3 and "busy at 0s: 1 running" in lines[0] and lines[-1].startswith("disagg-drain: idle after")


@pytest.mark.parametrize("metrics_server", [(HELD, 10**6)], indirect=True)
def test_the_program_gives_up_at_its_deadline(metrics_server: Metrics, capsys: pytest.CaptureFixture[str]) -> None:
    code = drain.main(["--host", "127.0.0.1", "--port", str(metrics_server.port), "--deadline-seconds", "0.3", "--interval-seconds", "0.05"])
    assert code == 0 and metrics_server.scrapes >= 2
    assert capsys.readouterr().out.splitlines()[-1] == "disagg-drain: deadline of 0.3s passed, still in flight: KV blocks in use (usage 0.01)"


def test_an_lws_env_it_cannot_read_still_drains_this_pod_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(contract.LWS_LEADER_ADDRESS_ENV, "no-dots")  # the leader's worker 1 cannot be named
    monkeypatch.setenv(contract.LWS_GROUP_SIZE_ENV, "2")
    monkeypatch.setenv(contract.LWS_WORKER_INDEX_ENV, "0")
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()
    assert drain.main(["--port", str(port), "--deadline-seconds", "600"]) == 0
    first, last = capsys.readouterr().out.splitlines()
    assert "cannot tell this engine's group" in first and "waiting for this pod alone" in first
    assert last.startswith(f"disagg-drain: the engine does not listen at http://127.0.0.1:{port}/metrics")


def test_the_program_exits_at_once_when_nothing_listens(capsys: pytest.CaptureFixture[str]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()  # the port is free: connections are refused
    assert drain.main(["--port", str(port), "--deadline-seconds", "600"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"disagg-drain: the engine does not listen at http://127.0.0.1:{port}/metrics") and line.endswith("nothing in flight")


def test_it_is_the_console_script_the_operator_renders() -> None:
    scripts = tomllib.loads((REPO / "connector" / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[contract.DRAIN_COMMAND] == "disagg_connector.drain:main"
    assert drain.build_parser().prog == contract.DRAIN_COMMAND


# --- the simulator exports what the drain reads -----------------------------------------------------------------
def test_the_simulator_exports_vllms_gauges_and_the_drain_waits_for_a_pull_pair(tmp_path: Path) -> None:
    """bench/disagg_bench/vllm_sim: a pull prefill holds the finished request's KV (busy: KV in use, nothing running),
    until the decode reads it; the decode is busy while it streams. The drain, started on the decode while
    the stream runs, returns only after the stream's last token, and the prefill goes idle once its KV was read."""
    import json
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from disagg_bench.vllm_sim.harness import MODEL, http_get, launch_sim, stop_all, wait_ready

    prefill = launch_sim(tmp_path, "prefill", "pull", lease_seconds=60)
    decode = launch_sim(tmp_path, "decode", "pull", tpot_ms=20.0)
    try:
        wait_ready(prefill, decode)

        def scrape(sim: Any) -> str:
            status, body = http_get(sim.url + "/metrics")
            assert status == 200
            return body.decode()

        for sim in (prefill, decode):
            text = scrape(sim)
            assert decide(text).idle, text
            labels = {(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(text) for s in f.samples
                      if s.name in drain.GAUGES}
            assert labels == {(name, (("engine", "0"), ("model_name", MODEL))) for name in drain.GAUGES}, labels

        def post(url: str, body: dict[str, Any]) -> Any:
            req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
            return urllib.request.urlopen(req, timeout=60)

        prompt = " ".join(["word"] * 300)  # 3 blocks of 128 tokens
        with post(prefill.url, {"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}) as r:
            params = json.loads(r.read())["kv_transfer_params"]
        held = decide(scrape(prefill))
        assert held.kinds == ("kv",) and held.describe() == f"KV blocks in use (usage {3 / 65536:.3g})", held

        tokens = 150  # 3 s at 20 ms per token
        stream = post(decode.url, {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True, "kv_transfer_params": params})
        first = stream.readline()
        assert first.startswith(b"data: "), first
        busy = decide(scrape(decode))
        assert busy.kinds == ("running", "kv") and busy.describe().startswith("1 running"), busy
        assert decide(scrape(prefill)).idle, "the decode has read the prefill's KV: its blocks are free"

        outcome: list[tuple[str, float]] = []
        lines: list[str] = []
        waiter = threading.Thread(target=lambda: outcome.append((drain.drain(decode.url + "/metrics", 60, interval=0.2, out=lines.append), time.monotonic())))
        waiter.start()
        events = [e for e in (first + stream.read()).decode().split("\n\n") if e.startswith("data: ")]
        stream.close()
        waiter.join(60)
        assert events[-1] == "data: [DONE]" and len(events) == tokens + 1
        (finished,) = decode.events("finished")  # the engine's own time.monotonic(): one clock on this machine
        (result, returned), = outcome
        assert result == "idle" and returned > finished["t"], (result, returned - finished["t"], lines)
        assert "busy at 0s: 1 running, KV blocks in use" in lines[0], lines
    finally:
        stop_all(prefill, decode)
