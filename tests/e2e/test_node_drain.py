"""Day 2 never cuts a response: `kubectl drain` of the node under a decode that is streaming (issue 16).

A model of 1 prefill and 2 decode pods, each on a fake p5en node of its own (8 GPUs per pod), plus a spare
node for the evicted decode's replacement. Simulated engines listen on the pods' IPs (bench/disagg_bench/vllm_sim/pods.py)
and export vLLM's scheduler gauges on /metrics; the router runs with the rendered arguments on its pod's IP;
a background client keeps sending short requests through it.

One streaming completion lasts ~30 s: far longer than the router's request deadline (5 s, which bounds a
leg until its first byte and the silence between chunks, not a stream) and shorter than the pods' grace
period (spec.engine.terminationGracePeriodSeconds: 120). While it streams, the node of the decode serving it
is drained. The eviction (the rendered PodDisruptionBudget lets one decode go) gives the pod its
deletionTimestamp; the router sends it nothing new; the pod's preStop, the rendered `disagg-drain`, waits
on the engine's /metrics until it is idle; kwok, standing in for the kubelet, removes the pod only then
(hack/kwok/stages.yaml, pod-delete-after-pre-stop). So:

- the stream ends with every token and [DONE], and no request of the client fails;
- the pod was terminating while the stream still ran, and went only after the stream's last token, with its
  engine idle (the hook said so; the engine held nothing when it stopped);
- the drain finished, well before the grace period ran out, and the replacement decode serves.

Waits are on conditions; nothing sleeps to synchronise.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client

from disagg_connector import contract
from disagg_bench.vllm_sim.harness import FAST

from tests.fixtures.models import REPO
from tests.fixtures.e2e.models import model_manifest
from tests.fixtures.e2e.serving import Serving
from tests.fixtures.e2e.traffic import wait_for
from tests.fixtures.e2e.waiting import PodWatch, condition

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
POOL = f"{contract.API_GROUP}/drain-pool"
GRACE_SECONDS = 120
DEADLINE_SECONDS = 5  # the router's leg deadline: the stream lasts six times as long
TPOT_MS = 50.0
STREAM_TOKENS = 600  # 30 s at 50 ms per token
TOKENS_BEFORE_DRAIN = 20


@pytest.fixture
def pool(cluster: Any, namespace: str) -> Iterator[list[str]]:
    """4 fake p5en nodes for this test only (prefill, 2 decode, a spare), pod IPs in loopback /24s of their own."""
    core = client.CoreV1Api(cluster.api_client())
    template = next(n for n in yaml.safe_load_all((REPO / "hack/nodes/p5en.yaml").read_text()) if n)
    offset = 10 * (sum(namespace.encode()) % 20)
    names = []
    for i in range(4):
        node = copy.deepcopy(template)
        name = f"drain-{namespace}-{i}"
        cidr = f"127.211.{i + offset}.0/24"
        node["metadata"]["name"] = name
        node["metadata"]["labels"].update({"kubernetes.io/hostname": name, POOL: namespace})
        node["spec"]["podCIDR"], node["spec"]["podCIDRs"] = cidr, [cidr]
        for address in node["status"].get("addresses", []):
            address["address"] = name if address["type"] == "Hostname" else cidr.rsplit(".", 1)[0] + ".254"
        core.create_node(node)
        names.append(name)
    yield names
    for name in names:
        core.delete_node(name)


def drain_model(name: str, pool_label: str) -> dict[str, Any]:
    role = {"parallelism": {"tensor": 8}, "accelerator": {"count": 8}, "nodeSelector": {POOL: pool_label}}
    return model_manifest(name, {
        "engine": {"terminationGracePeriodSeconds": GRACE_SECONDS},
        # Retries: kwok makes the replacement pod Ready the moment it is bound, before its engine listens.
        "router": {"replicas": 1, "requestDeadlineSeconds": DEADLINE_SECONDS, "disaggregationThresholdTokens": 0, "maxRetries": 3},
        "kvTransfer": {"leaseSeconds": 30},
        "prefill": {**copy.deepcopy(role), "replicas": 1}, "decode": {**copy.deepcopy(role), "replicas": 2},
        "network": {"placement": {"zone": "None", "spine": "None"}},
    })  # fmt: skip


@dataclass
class PodTimes:
    """Monotonic times a watch saw each pod of the model start terminating and go."""

    terminating: dict[str, float] = field(default_factory=dict)
    deletion_timestamp: dict[str, datetime] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)
    deleted_wall: dict[str, float] = field(default_factory=dict)


class Terminations(PodWatch):
    """Watches every pod of the model (not only engines) into PodTimes."""

    def __init__(self, api_client: Any, namespace: str, model: str):
        self.times = PodTimes()
        super().__init__(api_client, namespace, f"{contract.LABEL_MODEL}={contract.model_label_value(model)}")

    def changed(self, kind: str, pod: Any, now: float) -> None:
        name = pod.metadata.name
        if pod.metadata.deletion_timestamp:
            self.times.terminating.setdefault(name, now)
            self.times.deletion_timestamp.setdefault(name, pod.metadata.deletion_timestamp)
        if kind == "DELETED":
            self.times.deleted.setdefault(name, now)
            self.times.deleted_wall.setdefault(name, time.time())


class LongStream:
    """One streaming completion through the router, read in a thread; counts tokens as they come."""

    def __init__(self, url: str, served: str, tokens: int):
        self.url, self.served, self.tokens = url, served, tokens
        self.status: int | None = None
        self.xid: str | None = None
        self.events: list[str] = []
        self.error: str | None = None
        self.ended: float | None = None
        self._thread = threading.Thread(target=self._run, name="long-stream", daemon=True)

    def _run(self) -> None:
        body = {"model": self.served, "prompt": " ".join(["drain"] * 64), "max_tokens": self.tokens, "stream": True}
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=GRACE_SECONDS) as r:
                self.status, self.xid = r.status, r.headers.get("X-Request-Id")
                buffer = b""
                while chunk := r.read1(65536):
                    buffer += chunk
                    *complete, buffer = buffer.split(b"\n\n")
                    self.events += [e.decode()[len("data: "):] for e in complete if e.startswith(b"data: ")]
        except Exception as e:  # noqa: BLE001 - asserted on
            self.error = f"{type(e).__name__}: {e}"
        self.ended = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the stream did not end: {len(self.events)} events"

    def token_events(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in list(self.events) if e != "[DONE]"]


def test_a_node_drain_waits_for_the_stream_on_its_decode(operator, cluster, api_client, namespace, pool, tmp_path: Path) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    name = "drain"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, drain_model(name, namespace))
    obj = wait_for("1P2D Ready", lambda: (o := custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
                   and condition(o, "Ready").get("status") == "True" and o["status"]["decode"]["readyReplicas"] == 2 and o, 180)  # fmt: skip
    revision, served = obj["status"]["revision"], obj["spec"]["model"]["name"]
    decode_pods = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=decode").items
    (container,) = decode_pods[0].spec.containers
    assert container.lifecycle.pre_stop._exec.command == [
        contract.DRAIN_COMMAND, "--port", str(contract.HTTP_PORT), "--deadline-seconds", str(GRACE_SECONDS - 15)]  # fmt: skip
    assert len({p.spec.node_name for p in decode_pods}) == 2, "one decode per node"

    with (
        Serving(cluster, namespace, name, served, tmp_path, listening=(1, 2), timing={**FAST, "tpot_ms": TPOT_MS}) as harness,
        Terminations(cluster.api_client(), namespace, name) as pods,
    ):
        engines, router = harness.engines, harness.router
        wait_for("router table 1P2D", lambda: router.table() == {revision: (1, 2)}, 60)
        background = harness.start_client(workers=2)
        wait_for("traffic", lambda: len(background.results) >= 4)

        stream = LongStream(router.url, served, STREAM_TOKENS)
        stream.start()
        wait_for(f"{TOKENS_BEFORE_DRAIN} tokens of the long stream", lambda: len(stream.token_events()) >= TOKENS_BEFORE_DRAIN or stream.error, 60)
        assert stream.error is None and stream.status == 200 and stream.xid, (stream.error, stream.status)
        (serving,) = wait_for("the decode engine of the stream", lambda: [e for e in engines.live("decode") if stream.xid in e.legs()])
        node = core.read_namespaced_pod(serving.pod, namespace).spec.node_name
        assert node in pool

        # --- drain its node while it streams ----------------------------------------------------------------
        started = time.monotonic()
        result: list[subprocess.CompletedProcess[str]] = []
        drainer = threading.Thread(target=lambda: result.append(cluster.kubectl(
            "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", f"--timeout={GRACE_SECONDS + 30}s", check=False)))  # fmt: skip
        drainer.start()
        wait_for(f"{serving.pod} terminating", lambda: serving.pod in pods.times.terminating, 60)
        assert stream.ended is None and len(stream.token_events()) < STREAM_TOKENS, "the pod started terminating mid-stream"

        stream.join(GRACE_SECONDS)
        drainer.join(GRACE_SECONDS + 60)
        assert not drainer.is_alive(), "kubectl drain did not return"
        (drained,) = result
        assert drained.returncode == 0, (drained.stdout, drained.stderr)
        assert f"node/{node} drained" in drained.stdout, drained.stdout

        # --- the stream: every token, [DONE], no error --------------------------------------------------------
        assert stream.error is None, stream.error
        tokens = stream.token_events()
        assert stream.events[-1] == "[DONE]" and len(tokens) == STREAM_TOKENS, (len(tokens), stream.events[-3:])
        assert not any("error" in t for t in tokens)
        assert "".join(t["choices"][0]["text"] for t in tokens) == "".join(f" tok{i}" for i in range(STREAM_TOKENS))
        assert tokens[-1]["choices"][0]["finish_reason"] == "length"

        # --- the pod went after the stream's last token, with its engine idle -------------------------------
        wait_for(f"{serving.pod} gone", lambda: serving.pod in pods.times.deleted, 30)
        terminating, gone = pods.times.terminating[serving.pod], pods.times.deleted[serving.pod]
        assert started < terminating < stream.ended < gone, (started, terminating, stream.ended, gone)
        hook = engines.pre_stop(serving.pod)
        assert hook is not None and hook.returncode == 0 and hook.finished is not None, hook
        print(f"preStop of {serving.pod} ({hook.finished - hook.started:.1f} s):\n{hook.output}")
        assert hook.argv[1:] == ["--port", str(contract.HTTP_PORT), "--deadline-seconds", str(GRACE_SECONDS - 15), "--host", serving.ip]
        assert hook.finished < gone and "idle after" in hook.output and "deadline" not in hook.output, hook.output
        assert hook.stats_at_start is not None and stream.xid in hook.stats_at_start["in_flight"], hook.stats_at_start
        assert re.search(r"busy at 0s: \d+ running", hook.output), hook.output  # it found the stream, and waited for it
        assert serving.stopped_at is not None and serving.stopped_at > hook.finished, "the engine ran until its pod was gone"
        final = serving.stats()
        assert final["active"] == 0 and final["in_flight"] == [] and final["waiting_for_kv"] == 0, final
        (finished,) = [e for e in serving.events() if e["kind"] == "finished" and e["xid"] == stream.xid]
        assert finished["tokens"] == STREAM_TOKENS and hook.finished > finished["t"], "the hook returned after the stream's last token"
        # the grace period did not end it: kwok removed the pod when the hook returned
        grace_end = pods.times.deletion_timestamp[serving.pod].timestamp()
        assert pods.times.deleted_wall[serving.pod] < grace_end - 30, (pods.times.deleted_wall[serving.pod], grace_end)

        # --- nothing else failed; the replacement serves ----------------------------------------------------
        wait_for("the replacement decode listening", lambda: engines.serving(1, 2), 120)
        wait_for("router table 1P2D again", lambda: router.table() == {revision: (1, 2)}, 60)
        background.wait_past(time.monotonic(), "the replacement")
        results = harness.stop_client()
        failed = [r for r in results if not r.ok]
        assert not failed and len(results) >= 10, (len(failed), len(results), failed[:3])
        engines.check()
