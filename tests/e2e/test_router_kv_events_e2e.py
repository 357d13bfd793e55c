"""The router follows its prefill engines' KV cache events on the local cluster, through a rollout (issue 19).

A 2P2D model with ``spec.router.prefillPolicy: PrefixAndLoad`` (prefix caching on): the operator renders vLLM's
``--kv-events-config`` (PUB ``tcp://*:5700``, replay ``tcp://*:5800``), ``sha256_cbor`` block hashes, the
model's PYTHONHASHSEED and the pod annotations naming them. Simulated engines run on the pods' IPs with exactly
those flags and that environment (bench/disagg_bench/vllm_sim/pods.py), so they publish vLLM's events at the rendered ports
with vLLM's hashes; the router runs on its router pod's IP with its rendered arguments and finds the endpoints
in the pods' annotations.

1. The router follows every prefill pod's events: each one's ``routing.kvBlocks`` on /health turns from null
   (not followed, or its first replay not over) to a count.
2. Exact routing on the KV events: another client warms each prefill engine directly with a token-id prompt of
   its own; the router, which never saw those prompts, indexes their blocks from the events and sends a request
   that starts with one engine's prefix to that engine (its legs land there; picks counted as cache hits).
3. A rollout (an image change: a new revision) under a background client: no request fails, both legs of every
   request stay within one revision and the new revision takes the traffic, the router follows the new
   revision's prefill pods (their kvBlocks appear, and a prefix warmed on one of them draws its request) and
   drops the old ones as they leave: gone from /health, and the KV index
   (``disagg_router_kv_index_blocks``) holds no block but those of the pods it lists.

A test of its own:

4. Reachability by the rendered NetworkPolicy. This cluster runs no CNI, so nothing enforces NetworkPolicies;
   cyclonus (the evaluator SIG Network's policy-assistant grew out of, built by hack/cluster.sh from its Go
   module) reads the model's policies back from the API server and judges traffic between the model's real
   pods (their labels, IPs and the ports of their annotations): the router pod reaches a prefill pod's KV event
   and replay ports; a decode pod (which does reach the NIXL side channel), another pod of the namespace and a
   pod of another namespace with the router's very labels do not.

Nothing asserts on timing: every wait is on a condition, with a generous deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kubernetes import client

from disagg_connector import contract
from disagg_bench.vllm_sim import harness as h
from disagg_bench.vllm_sim.pods import LocalRouter, PodEngine, PodEngines, assert_idle_when_deleted, assert_no_kv_trouble

from tests.fixtures.e2e.models import PRODUCTION_DRAIN_TIMEOUT, model_manifest
from tests.fixtures.e2e.serving import Serving
from tests.fixtures.e2e.cluster import built
from tests.fixtures.e2e.models import get_model, rolled_out
from tests.fixtures.e2e.traffic import check_legs, wait_for
from tests.fixtures.e2e.waiting import condition

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
BLOCK = 16  # spec.engine.blockSize: short token-id prompts span several blocks
WARM_BLOCKS = 12


def kv_model(name: str) -> dict[str, Any]:
    return model_manifest(name, {
        "engine": {"blockSize": BLOCK},
        "prefill": {"replicas": 2}, "decode": {"replicas": 2},
        # Every request disaggregated; retries because kwok makes a pod Ready (with a freed IP) before its
        # simulated engine listens. The router answers the operator's drain questions: production bounds.
        "router": {"prefillPolicy": "PrefixAndLoad", "disaggregationThresholdTokens": 0, "maxRetries": 3,
                   "requestDeadlineSeconds": 60},
        "kvTransfer": {"leaseSeconds": 120}, **PRODUCTION_DRAIN_TIMEOUT,
    })  # fmt: skip


def prefill_backends(router: LocalRouter) -> dict[str, dict[str, Any]]:
    """pod -> the router's /health entry of that prefill backend."""
    return {b["pod"]: b for b in router.health()["backends"] if b["role"] == "prefill"}


def kv_blocks(router: LocalRouter) -> dict[str, int | None]:
    """pod -> routing.kvBlocks of every prefill backend the router lists."""
    return {pod: b["routing"]["kvBlocks"] for pod, b in prefill_backends(router).items()}


def metric(router: LocalRouter, line_prefix: str) -> float:
    """One sample of the router's /metrics (0 when the series does not exist yet)."""
    text = h.http_get(router.url + "/metrics")[1].decode()
    found = re.search(rf"^{re.escape(line_prefix)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


CACHE_HIT_PICKS = 'disagg_router_picks_total{policy="prefix-and-load",reason="cache_hit",role="prefill"}'


def follows_exactly(router: LocalRouter, pods: set[str]) -> bool:
    """The router lists exactly these prefill pods, has caught up with each one's events, and its KV index
    holds no block but theirs (the index's size is the sum of what it says each of them holds)."""
    blocks = kv_blocks(router)
    if set(blocks) != pods or any(v is None for v in blocks.values()):
        return False
    return metric(router, "disagg_router_kv_index_blocks") == sum(v for v in blocks.values() if v is not None)


def tokens(start: int, n: int) -> list[int]:
    """Token ids start..start+n-1 (the model's vocabulary has about 151k: keep them below)."""
    return list(range(start, start + n))


def warm_and_route(router: LocalRouter, served: str, engines: list[PodEngine], first_token: int) -> None:
    """Warm each prefill engine directly (not through the router) with a token-id prompt of its own, wait until
    the router's index holds those blocks, then send through the router, per engine, a prompt that starts with
    that engine's prefix: each lands on the engine holding it, counted as a cache hit."""
    warm = {e.pod: tokens(first_token + 10_000 * i, WARM_BLOCKS * BLOCK) for i, e in enumerate(engines)}
    for e in engines:
        before = kv_blocks(router)[e.pod] or 0
        reply = asyncio.run(h.post(e.url + "/v1/completions", {"model": served, "prompt": warm[e.pod], "max_tokens": 1}))
        assert reply.status == 200, reply.body[:300]
        wait_for(f"{e.pod}'s warmed blocks in the router's index", lambda e=e, before=before: (kv_blocks(router)[e.pod] or 0) >= before + WARM_BLOCKS)
    for turn, e in enumerate(engines):
        hits = metric(router, CACHE_HIT_PICKS)
        body = {"model": served, "prompt": warm[e.pod] + tokens(120_000 + 100 * turn, 3 * BLOCK), "max_tokens": 2}
        reply = asyncio.run(h.post(router.url + "/v1/completions", body))
        assert reply.status == 200, reply.body[:300]
        xid = reply.headers["x-request-id"]
        took = [other.pod for other in engines if xid in other.legs()]
        assert took == [e.pod], (xid, took, e.pod)
        assert metric(router, CACHE_HIT_PICKS) == hits + 1, "the pick was a cache hit"


def test_router_follows_kv_events_through_a_rollout(operator, cluster, api_client, namespace, tmp_path: Path) -> None:
    custom = client.CustomObjectsApi(api_client)
    name = "kvev"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, kv_model(name))
    ready = wait_for("2P2D Ready", lambda: (o := get_model(custom, namespace, name)) and condition(o, "Ready").get("status") == "True"
                     and o["status"]["prefill"]["readyReplicas"] == 2 and o["status"]["decode"]["readyReplicas"] == 2 and o, 180)  # fmt: skip
    first = ready["status"]["revision"]
    served = ready["spec"]["model"]["name"]

    with Serving(cluster, namespace, name, served, tmp_path, listening=(2, 2)) as harness:
        engines: PodEngines = harness.engines
        router = harness.router
        old_prefill = engines.live("prefill")
        assert all(e.publishes_kv_events for e in old_prefill), "the pods were rendered with --kv-events-config"
        wait_for("router table 2P2D", lambda: router.table() == {first: (2, 2)})

        # --- 1. the router follows every prefill pod's events ---------------------------------------------
        wait_for("the router following both prefill pods' KV events", lambda: follows_exactly(router, {e.pod for e in old_prefill}))

        # --- 2. a prefix another client cached draws the request to its engine -------------------------------
        warm_and_route(router, served, old_prefill, first_token=1000)
        assert metric(router, "disagg_router_kv_index_blocks") >= 2 * WARM_BLOCKS

        # --- 3. a rollout under traffic ----------------------------------------------------------------------
        background = harness.start_client(workers=2)
        wait_for("traffic", lambda: len(background.results) >= 6)
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                              {"spec": {"engine": {"image": "registry.example/vllm-runtime:0.33.0-next"}}})  # fmt: skip
        second = wait_for("rollout complete", lambda: rolled_out(custom, namespace, name, first), 600)["status"]["revision"]
        new_prefill = wait_for("the new revision's prefill engines listening",
                               lambda: (live := engines.serving(2, 2)) and [e for e in live if e.role == "prefill"])  # fmt: skip
        assert {e.revision for e in new_prefill} == {second}
        wait_for("router table: the new revision only", lambda: router.table() == {second: (2, 2)})
        retired = [e for e in engines.all() if e.revision == first]
        wait_for("the old engines stopped as their pods went", lambda: all(e.stopped_at is not None for e in retired))
        old_gone = time.monotonic()
        background.wait_past(old_gone, "the old revision's pods gone")
        results = harness.stop_client()

        failed = [r for r in results if not r.ok]
        assert not failed and len(results) >= 10, (len(failed), len(results), failed[:3])
        check_legs(results, engines.all(), "push")  # both legs of every request within one revision
        legs = {e.pod: (e.revision, e.legs()) for e in engines.all() if e.role == "prefill"}
        revision_of = {r.xid: rev for r in results for rev, got in legs.values() if r.xid in got}
        by_revision = Counter(revision_of.values())
        assert set(by_revision) == {first, second}, by_revision  # the old revision served, then the new one
        last = [r.xid for r in results if r.started > old_gone]
        assert last and {revision_of[x] for x in last} == {second}, "once the old pods left, the new revision took it all"

        # The index followed the pods in and out: only the new prefill pods, each caught up; none of the old.
        wait_for("the router following the new prefill pods alone", lambda: follows_exactly(router, {e.pod for e in new_prefill}))
        listed = {b["pod"] for b in router.health()["backends"]}
        assert not listed & {e.pod for e in old_prefill}, listed
        print(f"\nrequests by revision {dict(by_revision)} ({len(last)} after the old pods left); "
              f"KV blocks indexed per new prefill pod {kv_blocks(router)}")
        warm_and_route(router, served, new_prefill, first_token=30_000)

        assert_idle_when_deleted(retired)
        assert_no_kv_trouble(engines.all())


# --- 4. reachability by the rendered NetworkPolicy ------------------------------------------------------------
def peer(pod_labels: dict[str, str], namespace: str, namespace_labels: dict[str, str], ip: str) -> dict[str, Any]:
    """A pod as cyclonus's traffic query names one (matcher.TrafficPeer)."""
    return {"Internal": {"PodLabels": pod_labels, "NamespaceLabels": namespace_labels, "Namespace": namespace}, "IP": ip}


def allowed_by_policies(kubeconfig: str, namespace: str, traffic: list[dict[str, Any]], tmp_path: Path) -> list[bool]:
    """cyclonus's verdict on each traffic, under the NetworkPolicies it reads from the namespace on the API
    server (its ``query-traffic`` mode prints one ``Is allowed?`` footer per traffic, in order)."""
    path = tmp_path / "traffic.json"
    path.write_text(json.dumps(traffic))
    run = subprocess.run([str(built("cyclonus")), "analyze", "--mode", "query-traffic", "--namespace", namespace,
                          "--traffic-path", str(path)],
                         capture_output=True, text=True, env={**os.environ, "KUBECONFIG": kubeconfig}, timeout=120)  # fmt: skip
    assert run.returncode == 0 and "unable to read" not in run.stderr, (run.returncode, run.stderr[-2000:])
    verdicts = re.findall(r"^\|\s*IS ALLOWED\?\s*\|\s*(TRUE|FALSE)\s*\|", run.stdout, re.M)
    assert len(verdicts) == len(traffic), run.stdout[-3000:]
    return [v == "TRUE" for v in verdicts]


def test_only_the_router_reaches_the_kv_event_ports_by_the_rendered_policy(operator, cluster, api_client, namespace, tmp_path: Path) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    networking = client.NetworkingV1Api(api_client)
    name = "kvnp"
    manifest = kv_model(name)
    manifest["spec"]["prefill"]["replicas"] = manifest["spec"]["decode"]["replicas"] = 1
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    wait_for("1P1D Ready", lambda: (o := get_model(custom, namespace, name)) and condition(o, "Ready").get("status") == "True")
    networking.read_namespaced_network_policy(contract.engines_network_policy_name(name), namespace)  # rendered and applied

    def one(role: str) -> Any:
        (pod,) = [p for p in core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_MODEL}={contract.model_label_value(name)},"
                                                                                  f"{contract.LABEL_ROLE}={role}").items
                  if p.metadata.deletion_timestamp is None]  # fmt: skip
        return pod

    router, prefill, decode = one("router"), one("prefill"), one("decode")
    ns_labels = core.read_namespace(namespace).metadata.labels or {}
    other_ns = "elsewhere"

    def of(pod: Any) -> dict[str, Any]:
        return peer(pod.metadata.labels, namespace, ns_labels, pod.status.pod_ip)

    annotations = prefill.metadata.annotations
    ports = {"kv-events": int(annotations[contract.ANNOTATION_KV_EVENTS_PORT]),
             "kv-replay": int(annotations[contract.ANNOTATION_KV_EVENTS_REPLAY_PORT])}  # fmt: skip
    assert ports == {"kv-events": contract.KV_EVENTS_PORT, "kv-replay": contract.KV_EVENTS_REPLAY_PORT}
    sources = {
        "router": (of(router), True),
        "decode": (of(decode), False),
        "another pod of the namespace": (peer({"app": "client"}, namespace, ns_labels, "127.0.0.77"), False),
        "the router's labels in another namespace": (
            peer(router.metadata.labels, other_ns, {"kubernetes.io/metadata.name": other_ns}, "127.0.0.78"), False),
    }  # fmt: skip
    cases = [(who, port_name, port, expected) for who, (_, expected) in sources.items() for port_name, port in ports.items()]
    # A control: the decode pod is one the policy names (it reaches the prefill's NIXL side channel).
    side_channel = int(annotations[contract.ANNOTATION_SIDE_CHANNEL_PORT])
    cases.append(("decode", "nixl-side-channel", side_channel, True))
    traffic = [{"Source": sources[who][0], "Destination": of(prefill), "Protocol": "TCP", "ResolvedPort": port,
                "ResolvedPortName": port_name} for who, port_name, port, _ in cases]  # fmt: skip

    verdicts = allowed_by_policies(cluster.kubeconfig, namespace, traffic, tmp_path)
    got = {(who, port_name): v for (who, port_name, _, _), v in zip(cases, verdicts)}
    assert got == {(who, port_name): expected for who, port_name, _, expected in cases}, got
