"""The router end to end: discovery of a DisaggregatedModel's kwok pods through the real API server,
requests to simulated vLLM engines that listen on those pods' own (loopback) IPs, scaling under load.

- The operator (session fixture, its own ServiceAccount) reconciles a model of 2 prefill + 2 decode
  replicas (examples/minimal.yaml) until Ready.
- For every Ready P/D pod, a simulated engine (tests/vllm_sim) listens on the pod's IP at the ports of
  its annotations (HTTP 8000, NIXL side channel 5600) with ``--engine-id`` = ``contract.engine_id(pod
  name, pod UID)`` and tp/pp/dp from its annotations: exactly the identity a real vLLM pod gets from the
  Downward API. A pod watch starts engines for pods that appear later and notes pods that go away.
- The router runs as a local process with the args the operator rendered into the router Deployment
  (only ``--port`` replaced, ``--host`` and ``--kubeconfig`` added), authenticated with a token of the
  router's own ServiceAccount: the rendered Role and RoleBinding are what lets it list and watch pods.
- Requests (completions and chat, streamed and not) succeed and both legs of each reach engines of the
  model: the simulators' own event logs show the request id on a prefill and a decode engine, and the
  decode leg names the prefill engine's NIXL identity (push) or carries the prefill's params (pull).
- Scaling (prefill 2 -> 3, decode 2 -> 3, then both -> 1) while a background client keeps sending
  requests: the router's /health table follows, and no request fails.

On kwok a pod is Ready the moment it is bound (no readiness probe runs), before its simulated engine
listens; a real engine pod turns Ready only after vLLM answers its probe. The router copes with a
backend that refuses connections (ejects it and retries another pair with a fresh id) as long as one
attempt's retry has somewhere else to go, so the test adds one pod of one role at a time.

Waits are event-based with generous deadlines; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg_connector import contract
from disagg_bench.vllm_sim.pods import LocalRouter, PodEngine, PodEngines, router_kubeconfig, start_router

from tests.conftest import REPO, load_example, merge
from tests.fixtures.e2e import waiting
from tests.fixtures.e2e.waiting import DEADLINE, condition

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
MINIMAL = load_example(REPO / "examples" / "minimal.yaml")


# --- small helpers ----------------------------------------------------------------------------------
def wait_for(what: str, check: Callable[[], Any], timeout: float = DEADLINE, interval: float = 0.2) -> Any:
    """Also polls HTTP endpoints of the router and the simulators, which may not listen yet."""
    return waiting.wait_for(what, check, timeout, interval, retry_on=(ApiException, OSError, ValueError))


def model_manifest(name: str, mode: str) -> dict[str, Any]:
    obj = copy.deepcopy(MINIMAL)
    obj["metadata"] = {"name": name}
    merge(obj["spec"], {"kvTransfer": {"mode": mode}, "prefill": {"replicas": 2}, "decode": {"replicas": 2},
                        # every request disaggregated (the test's prompts are short), so both legs show
                        "router": {"disaggregationThresholdTokens": 0}})  # fmt: skip
    return obj


def wait_model_ready(custom: client.CustomObjectsApi, ns: str, name: str) -> dict[str, Any]:
    """Ready and rolled out: Ready alone says the model serves (a ready pair), which it does before every pod
    of a role is ready; the test wants them all (Progressing=Complete)."""
    def ready() -> dict[str, Any] | None:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        status = obj.get("status") or {}
        current = status.get("observedGeneration") == obj["metadata"]["generation"]
        done = condition(obj, "Ready").get("status") == "True" and condition(obj, "Progressing").get("reason") == "Complete"
        return obj if current and done else None

    return wait_for(f"{ns}/{name} Ready and rolled out", ready)


def router_token_kubeconfig(cluster: Any, namespace: str, model: str, path: Path) -> Path:
    """A kubeconfig with nothing but a token of the router's own ServiceAccount (rendered by the operator)."""
    token = cluster.kubectl("create", "token", contract.router_name(model), "-n", namespace, "--duration=1h").stdout.strip()
    return router_kubeconfig(cluster.kubeconfig, token, namespace, path)


def wait_serving(engines: PodEngines, prefill: int, decode: int) -> list[PodEngine]:
    return wait_for(f"{prefill} prefill + {decode} decode engines listening", lambda: engines.serving(prefill, decode))


def wait_table(router: LocalRouter, expected: dict[str, tuple[int, int]]) -> None:
    wait_for(f"router table {expected}", lambda: router.table() == expected)


# --- clients ------------------------------------------------------------------------------------------
@dataclass
class Result:
    xid: str | None
    status: int
    ok: bool
    detail: str
    started: float
    finished: float


def _payload(served: str, i: int, stream: bool) -> tuple[str, dict[str, Any]]:
    words = " ".join(["word"] * (8 + i % 24))
    if i % 3 == 2:
        return "/v1/chat/completions", {"model": served, "messages": [{"role": "user", "content": words}], "max_tokens": 4, "stream": stream}
    return "/v1/completions", {"model": served, "prompt": words, "max_tokens": 4, "stream": stream}


async def send(session: Any, base: str, served: str, i: int, stream: bool) -> Result:
    """One request through the router; ok means HTTP 200 and a complete answer (a stream ends in [DONE]
    and carries no error event)."""
    path, body = _payload(served, i, stream)
    started = time.monotonic()
    try:
        async with session.post(base + path, json=body) as r:
            data = await r.read()
            xid = r.headers.get("X-Request-Id")
            status = r.status
    except Exception as e:  # noqa: BLE001 - a transport failure is a failed request
        return Result(None, 0, False, f"{type(e).__name__}: {e}", started, time.monotonic())
    text = data.decode(errors="replace")
    if status != 200:
        ok = False
    elif stream:
        events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
        ok = bool(events) and events[-1] == "[DONE]" and not any('"error"' in e for e in events[:-1]) and len(events) > 1
    else:
        try:
            doc = json.loads(text)
            ok = bool(doc.get("choices")) and "error" not in doc
        except ValueError:
            ok = False
    return Result(xid, status, ok, text[:300], started, time.monotonic())


def run_batch(base: str, served: str, n: int, *, concurrency: int, first: int = 0) -> list[Result]:
    import aiohttp

    async def main() -> list[Result]:
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:

            async def one(i: int) -> Result:
                async with sem:
                    return await send(session, base, served, i, stream=i % 2 == 1)

            return await asyncio.gather(*(one(first + i) for i in range(n)))

    return asyncio.run(main())


class BackgroundClient:
    """Workers that each send one request after another (alternating streaming and not) until stopped."""

    def __init__(self, base: str, served: str, workers: int = 2):
        self.base, self.served, self.workers = base, served, workers
        self.results: list[Result] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="bg-client", daemon=True)
        self.last_done: list[float] = [0.0] * workers  # per worker: start time of its last finished request

    async def _main(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:

            async def worker(w: int) -> None:
                i = w
                while not self._stop.is_set():
                    r = await send(session, self.base, self.served, 1000 + i, stream=(i // self.workers) % 2 == 1)
                    with self.lock:
                        self.results.append(r)
                        self.last_done[w] = r.started
                    i += self.workers

            await asyncio.gather(*(worker(w) for w in range(self.workers)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[Result]:
        self._stop.set()
        self._thread.join(timeout=200)
        assert not self._thread.is_alive(), "background client did not finish"
        return list(self.results)

    def failures(self) -> list[Result]:
        with self.lock:
            return [r for r in self.results if not r.ok]

    def wait_past(self, mark: float, what: str) -> None:
        """Wait until every worker finished a request it started after `mark`: every request in flight at
        `mark` is over by then (each worker has one request at a time)."""

        def past() -> bool:
            with self.lock:
                return all(t > mark for t in self.last_done)

        assert self._thread.is_alive()
        wait_for(f"client requests started after {what}", past)


# --- assertions on where legs went --------------------------------------------------------------------
def check_legs(results: list[Result], engines: list[PodEngine], mode: str) -> dict[str, tuple[int, int]]:
    """Both legs of every request reached engines of this model, with the right NIXL identity.

    Returns engine id -> (legs, completed legs) for a look at the spread."""
    legs = {e.engine_id: e.legs() for e in engines}
    by_id = {e.engine_id: e for e in engines}
    for r in results:
        assert r.xid, r
        prefill = [eid for eid, got in legs.items() if r.xid in got and by_id[eid].role == "prefill"]
        decode = [eid for eid, got in legs.items() if r.xid in got and by_id[eid].role == "decode"]
        assert len(prefill) == 1 and len(decode) == 1, (r.xid, prefill, decode)
        p_leg, d_leg = legs[prefill[0]][r.xid], legs[decode[0]][r.xid]
        assert p_leg["kv_transfer_params"]["do_remote_decode"] is True, p_leg
        params = d_leg["kv_transfer_params"]
        assert params["do_remote_prefill"] is True, d_leg
        p_engine = by_id[prefill[0]]
        # the identity the router read from the pod (name, UID, IP, annotations) is the engine's own
        assert params["remote_engine_id"] == p_engine.engine_id, (params, p_engine)
        assert params["remote_host"] == p_engine.ip and params["remote_port"] == contract.NIXL_SIDE_CHANNEL_PORT, params
        assert by_id[decode[0]].revision == p_engine.revision
        if mode == "pull":
            assert params.get("transfer_mode") == "pull" and params.get("remote_block_ids") is not None, params
    counters = {e.engine_id: e.counters() for e in engines}
    n = len(results)
    p_count = sum(c.get("prefills", 0) for eid, c in counters.items() if by_id[eid].role == "prefill")
    d_done = sum(c.get("completed", 0) for eid, c in counters.items() if by_id[eid].role == "decode")
    assert p_count >= n and d_done >= n, (n, counters)
    if mode == "push":
        assert sum(c.get("kv_received", 0) for eid, c in counters.items() if by_id[eid].role == "decode") >= n, counters
    else:
        assert sum(c.get("reads", 0) for eid, c in counters.items() if by_id[eid].role == "prefill") >= n, counters
    for eid, c in counters.items():
        assert not c.get("kv_wrong") and not c.get("handshake_failures") and not c.get("engine_dead"), (eid, c)
    return {eid: (len(got), counters[eid].get("completed", 0)) for eid, got in legs.items()}


# --- the test -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["Push", "Pull"])
def test_router_discovers_kwok_pods_serves_and_follows_scaling(
    operator, cluster, api_client, namespace, tmp_path: Path, mode: str
) -> None:
    custom, apps = client.CustomObjectsApi(api_client), client.AppsV1Api(api_client)
    name = f"rt-{mode.lower()}"
    sim_mode = mode.lower()
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, model_manifest(name, mode))
    obj = wait_model_ready(custom, namespace, name)
    status = obj["status"]
    assert status["transferMode"] == mode
    assert status["prefill"]["readyReplicas"] == 2 and status["decode"]["readyReplicas"] == 2
    revision = status["revision"]

    router_deploy = apps.read_namespaced_deployment(contract.router_name(name), namespace)
    args = list(router_deploy.spec.template.spec.containers[0].args)
    served = args[args.index("--served-model-name") + 1]
    assert "--mode" not in args, "the router follows each revision's own transfer-mode annotation"
    assert args[args.index("--selector") + 1] == f"{contract.LABEL_MODEL}={contract.model_label_value(name)}"

    engines = PodEngines(cluster.api_client(), namespace, name, served, tmp_path, stop_gone=True)
    router: LocalRouter | None = None
    background: BackgroundClient | None = None
    try:
        engines.start()
        first = wait_serving(engines, 2, 2)
        # On the router pod's own IP and port: the operator asks it what is in flight before a pod leaves.
        (router_pod,) = client.CoreV1Api(api_client).list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_ROLE}=router").items
        router = start_router(apps, namespace, name, router_token_kubeconfig(cluster, namespace, name, tmp_path / "router.kubeconfig"),
                              tmp_path, host=router_pod.status.pod_ip, port=contract.ROUTER_PORT)  # fmt: skip
        wait_for("router synced", lambda: router.health()["synced"])
        wait_table(router, {revision: (2, 2)})

        # --- requests: sequential then concurrent, completions and chat, streamed and not ------------
        results = run_batch(router.url, served, 12, concurrency=1)
        results += run_batch(router.url, served, 16, concurrency=8, first=12)
        bad = [r for r in results if not r.ok]
        assert not bad, bad[:3]
        spread = check_legs(results, first, sim_mode)
        # Not asserted: how evenly legs spread. Sequential requests all go to one P and one D (the
        # balancer's round-robin tie-break shares one counter between the P and the D choice).
        print(f"\n[{mode}] legs per engine after {len(results)} requests: {spread}")

        # --- scaling under load ------------------------------------------------------------------------
        background = BackgroundClient(router.url, served)
        background.start()
        wait_for("background client running", lambda: len(background.results) >= 4)
        table_seen: list[dict[str, tuple[int, int]]] = [router.table()]

        def scale(prefill: int, decode: int) -> None:
            patch = {"spec": {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}}}
            custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, patch)
            wait_serving(engines, prefill, decode)
            wait_table(router, {revision: (prefill, decode)})
            table_seen.append(router.table())
            background.wait_past(time.monotonic(), f"the table showed {prefill}P/{decode}D")
            assert not background.failures(), background.failures()[:3]

        scale(3, 2)  # one pod at a time: see the module docstring
        scale(3, 3)
        scale(1, 1)
        assert {e.pod for e in engines.retire_gone()}, "scaling down removed pods"  # (stopped as their pods went)
        obj = wait_model_ready(custom, namespace, name)
        assert obj["status"]["revision"] == revision, "scaling is not a new revision"
        wait_for("the rest of the client's requests", lambda: len(background.results) >= 40)
        results = background.stop()
        background = None
        bad = [r for r in results if not r.ok]
        assert not bad, (len(bad), len(results), bad[:3])
        assert table_seen == [{revision: (2, 2)}, {revision: (3, 2)}, {revision: (3, 3)}, {revision: (1, 1)}]
        # every request of the background client also reached engines of the model, on either side of a change
        check_legs(results, engines.all(), sim_mode)
        assert router.proc.alive() and operator.alive()
    finally:
        if background is not None:
            background.stop()
        if router is not None:
            code = router.proc.stop()
            print(f"router exited with {code}; log tail:\n{router.proc.log_text()[-2000:]}")
        engines.stop()
