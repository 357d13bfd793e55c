"""The router end to end: discovery of a DisaggregatedModel's kwok pods through the real API server,
requests to simulated vLLM engines that listen on those pods' own (loopback) IPs, scaling under load.

- The operator (session fixture, its own ServiceAccount) reconciles a model of 2 prefill + 2 decode
  replicas (examples/minimal.yaml) until Ready.
- For every Ready P/D pod, a simulated engine (bench/disagg_bench/vllm_sim) listens on the pod's IP at the ports of
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
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from disagg_connector import contract
from disagg_bench.vllm_sim.pods import LocalRouter, PodEngine, PodEngines, router_kubeconfig, start_router

from tests.fixtures.models import REPO, load_example, merge
from tests.fixtures.e2e.waiting import condition
from tests.fixtures.e2e.traffic import BackgroundClient, Result, check_legs, send, wait_for

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
MINIMAL = load_example(REPO / "examples" / "minimal.yaml")


# --- small helpers ----------------------------------------------------------------------------------


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


# --- assertions on where legs went --------------------------------------------------------------------


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
