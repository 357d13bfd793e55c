"""KV cache events on the engines (issue 19): where the router's prefill policy reads them, every engine publishes
vLLM's KV events at the contract's ports and hashes blocks reproducibly, and each pod says so in its annotations.

The rendered lines are judged by both vLLM releases' own code (the cached CPU environments): the parser reads the
events config and hash algorithm we mean, vLLM's own `offset_endpoint_port` puts each rank where
`contract.identities_from_pod` says, and the block-hash seed we render makes vLLM's first block hash the same in
every process.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import cbor2
import pytest

from disagg_bench.localrun.kube_env import expand
from disagg_connector import contract
from disagg_operator.api.models import Parallelism
from disagg_operator.api.validation import SpecError, parse
from disagg_operator.render import render
from disagg_operator.render.router import router_args

from tests.fixtures.models import dm
from tests.fixtures.vllm_cli import CHECKED_VERSIONS, vllm_python
from tests.fixtures.render import pod_argv
from tests.fixtures.render import by_kind, engine_container, pod_template

POD_UID = "6a1f2a9e-5b1e-4c55-9b53-0c6a3c1e7d42"
EVENTS_OFF = {
    "least-outstanding": {"router": {"prefillPolicy": "LeastOutstanding"}},
    "no-prefix-caching": {"engine": {"enablePrefixCaching": False}},
}
# Wide EP: decode DP16 over two 8-GPU pods (LWS), prefill DP8 on one pod.
SPANNING = {"decode": {"parallelism": {"data": 16, "expert": True}, "accelerator": {"count": 8}},
            "prefill": {"parallelism": {"data": 8, "expert": True}, "accelerator": {"count": 8}}}  # fmt: skip
KV_ANNOTATIONS = (contract.ANNOTATION_KV_EVENTS_PORT, contract.ANNOTATION_KV_EVENTS_REPLAY_PORT,
                  contract.ANNOTATION_KV_HASH_SEED, contract.ANNOTATION_KV_BLOCK_SIZE)  # fmt: skip


def engine_workload(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (workload,) = [o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet")
                   and o["metadata"]["labels"].get(contract.LABEL_ROLE) == role]  # fmt: skip
    return workload


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


# --- ports ---------------------------------------------------------------------------------------------------


def test_the_api_bounds_data_parallel_where_the_contract_says() -> None:
    (bound,) = [m.le for m in Parallelism.model_fields["data"].metadata if hasattr(m, "le")]
    assert bound == contract.MAX_DATA_PARALLEL_SIZE


@pytest.mark.parametrize("ranks", range(1, contract.MAX_DATA_PARALLEL_SIZE + 1))
def test_event_ports_never_meet_nixl_http_or_the_dp_handshake(ranks: int) -> None:
    """For every DP size the API admits, with the default side channel, each port one engine pod listens on is
    its own: NIXL's side channel, the events publisher and replay socket per rank, HTTP, the DP handshake."""
    def ports(base: int) -> list[int]:
        return [contract.kv_events_port(base, r) for r in range(ranks)]

    taken = [contract.HTTP_PORT, contract.DATA_PARALLEL_RPC_PORT,
             *(contract.side_channel_port(contract.NIXL_SIDE_CHANNEL_PORT, r) for r in range(ranks)),
             *ports(contract.KV_EVENTS_PORT), *ports(contract.KV_EVENTS_REPLAY_PORT)]  # fmt: skip
    assert len(set(taken)) == len(taken)
    assert all(1024 <= p <= 65535 for p in taken)


def test_a_side_channel_moved_onto_the_event_ports_is_refused_only_where_events_are_published() -> None:
    two_ranks = {"decode": {"parallelism": {"data": 2}, "accelerator": {"count": 2}}}
    for port in (contract.KV_EVENTS_PORT - 1, contract.KV_EVENTS_PORT + 1, contract.KV_EVENTS_REPLAY_PORT):
        with pytest.raises(SpecError, match="overlap the KV event ports") as refused:
            parse(dm({**two_ranks, "kvTransfer": {"sideChannelPort": port}}))
        assert "spec.kvTransfer.sideChannelPort" in str(refused.value)
        parse(dm({**two_ranks, **EVENTS_OFF["least-outstanding"], "kvTransfer": {"sideChannelPort": port}}))
    # just clear of both ends of the publisher's ranks [5700, 5702)
    for port in (contract.KV_EVENTS_PORT - 2, contract.KV_EVENTS_PORT + 2):
        parse(dm({**two_ranks, "kvTransfer": {"sideChannelPort": port}}))


# --- API -----------------------------------------------------------------------------------------------------


def test_policies_default_and_render_as_router_flags() -> None:
    router = parse(dm()).spec.router
    assert (router.prefill_policy, router.decode_policy) == ("PrefixAndLoad", "LeastLoaded")
    for prefill, decode, flags in [
        ("PrefixAndLoad", "LeastLoaded", ("prefix-and-load", "least-loaded")),
        ("LeastOutstanding", "LeastOutstanding", ("least-outstanding", "least-outstanding")),
    ]:
        args = router_args(parse(dm({"router": {"prefillPolicy": prefill, "decodePolicy": decode}})))
        assert (flag(args, "--prefill-policy"), flag(args, "--decode-policy")) == flags


@pytest.mark.parametrize(("patch", "path"), [
    ({"router": {"prefillPolicy": "LeastLoaded"}}, "spec.router.prefillPolicy"),
    ({"router": {"decodePolicy": "PrefixAndLoad"}}, "spec.router.decodePolicy"),
    ({"router": {"decodeSelection": "LeastOutstanding"}}, "spec.router.decodeSelection"),  # the field it replaced
    ({"engine": {"extraArgs": ["--kv-events-config={}"]}}, "spec.engine.extraArgs"),
    ({"decode": {"extraArgs": ["--prefix_caching_hash_algo", "sha256"]}}, "spec.decode.extraArgs"),
    ({"prefill": {"env": [{"name": "PYTHONHASHSEED", "value": "0"}]}}, "spec.prefill.env"),
])  # fmt: skip
def test_what_the_policies_and_events_refuse(patch: dict[str, Any], path: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse(dm(patch))
    assert path in str(refused.value)


def test_the_hash_seed_is_a_pythonhashseed_and_the_models_own() -> None:
    seeds = {name: contract.kv_hash_seed(name) for name in ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "")}
    assert all(0 <= int(s) <= 4294967295 and s == str(int(s)) for s in seeds.values())
    assert len(set(seeds.values())) == len(seeds)
    assert contract.kv_hash_seed("Qwen/Qwen3-8B") == seeds["Qwen/Qwen3-8B"]


# --- rendering -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", contract.ENGINE_ROLES)
def test_events_on_every_engine_flags_env_ports_and_annotations(role: str) -> None:
    model = parse(dm({"engine": {"blockSize": 64}, "decode": {"parallelism": {"data": 2}, "accelerator": {"count": 2}}}))
    workload = engine_workload(render(model).objects, role)
    container = pod_template(workload)["spec"]["containers"][0]
    argv = container["command"] + container["args"]
    assert json.loads(flag(argv, "--kv-events-config") or "{}") == {
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": contract.KV_EVENTS_TOPIC,
        "endpoint": f"tcp://*:{contract.KV_EVENTS_PORT}", "replay_endpoint": f"tcp://*:{contract.KV_EVENTS_REPLAY_PORT}",
    }  # fmt: skip
    assert flag(argv, "--prefix-caching-hash-algo") == "sha256_cbor"
    seed = contract.kv_hash_seed(model.spec.model.name)
    assert env_of(container)["PYTHONHASHSEED"] == seed
    annotations = pod_template(workload)["metadata"]["annotations"]
    assert {k: annotations[k] for k in KV_ANNOTATIONS} == {
        contract.ANNOTATION_KV_EVENTS_PORT: "5700", contract.ANNOTATION_KV_EVENTS_REPLAY_PORT: "5800",
        contract.ANNOTATION_KV_HASH_SEED: seed, contract.ANNOTATION_KV_BLOCK_SIZE: "64",
    }  # fmt: skip
    ranks = model.spec.decode.parallelism.data if role == "decode" else 1
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for name, base in (("kv-events", 5700), ("kv-replay", 5800)):
        assert [named[name if r == 0 else f"{name}-dp{r}"] for r in range(ranks)] == [base + r for r in range(ranks)]
    assert all(len(name) <= 15 for name in named)  # an IANA_SVC_NAME


@pytest.mark.parametrize("case", sorted(EVENTS_OFF))
def test_no_events_without_the_prefix_policy_or_prefix_caching(case: str) -> None:
    objects = render(parse(dm(EVENTS_OFF[case]))).objects
    for role in contract.ENGINE_ROLES:
        workload = engine_workload(objects, role)
        container = pod_template(workload)["spec"]["containers"][0]
        argv = container["command"] + container["args"]
        assert "--kv-events-config" not in argv and "--prefix-caching-hash-algo" not in argv
        assert "PYTHONHASHSEED" not in env_of(container)
        assert not set(KV_ANNOTATIONS) & set(pod_template(workload)["metadata"]["annotations"])
        assert not [p for p in container["ports"] if p["name"].startswith("kv-")]
    (policy,) = by_kind(objects, "NetworkPolicy")
    (router_rule,) = [r for r in policy["spec"]["ingress"] if '"router"' in json.dumps(r["from"])]
    assert router_rule["ports"] == [{"protocol": "TCP", "port": 8000}]  # no event port for the router


def test_events_change_the_revision_and_the_policies_alone_do_not_touch_engines() -> None:
    """Turning events on rolls the engines (a new pod template); the decode policy is the router's only."""
    on, off = (render(parse(dm(p))).revision for p in ({}, EVENTS_OFF["least-outstanding"]))
    assert on != off
    assert render(parse(dm({"router": {"decodePolicy": "LeastOutstanding"}}))).revision == on


@pytest.mark.parametrize("backend", ["LIBFABRIC", "UCX"])
def test_only_the_router_reaches_the_event_ports(backend: str) -> None:
    efa = {"efa": {"count": 1}, "resources": {"requests": {"memory": "8Gi"}}} if backend == "LIBFABRIC" else {}
    model = parse(dm({"kvTransfer": {"backend": backend},
                      "network": {"networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]}},
                      "prefill": {"parallelism": {"data": 4}, "accelerator": {"count": 4}, **efa},
                      "decode": {"parallelism": {"data": 2}, "accelerator": {"count": 2}, **efa}}))  # fmt: skip
    (policy,) = by_kind(render(model).objects, "NetworkPolicy")
    events = [{"protocol": "TCP", "port": 5700, "endPort": 5703}, {"protocol": "TCP", "port": 5800, "endPort": 5803}]
    by_source = {json.dumps(rule["from"], sort_keys=True): rule.get("ports") for rule in policy["spec"]["ingress"]}
    router_source = [r for r in by_source if '"router"' in r]
    assert len(router_source) == 1
    assert by_source[router_source[0]] == [{"protocol": "TCP", "port": 8000}, *events]
    for source, ports in by_source.items():
        if source in router_source:
            continue
        if '"prefill"' in source:  # the engines among themselves: NIXL (UCX: every port but the router's)
            expected = [{"protocol": "TCP", "port": 5600, "endPort": 5603}] if backend == "LIBFABRIC" else [
                {"protocol": "TCP", "port": 1, "endPort": 5699}, {"protocol": "TCP", "port": 5704, "endPort": 5799},
                {"protocol": "TCP", "port": 5804, "endPort": 7999}, {"protocol": "TCP", "port": 8001, "endPort": 65535}]  # fmt: skip
            assert ports == expected
        else:  # the metrics scrapers: vLLM's HTTP port only
            assert ports == [{"protocol": "TCP", "port": 8000}]


# --- what the router reads back ------------------------------------------------------------------------------


def test_a_one_pod_engine_publishes_at_the_contract_ports() -> None:
    model = parse(dm())
    workload = engine_workload(render(model).objects, "prefill")
    annotations = pod_template(workload)["metadata"]["annotations"]
    (identity,) = contract.identities_from_pod("p", "u", "10.0.0.7", annotations)
    assert (identity.kv_events_endpoint, identity.kv_events_replay_endpoint) == ("tcp://10.0.0.7:5700", "tcp://10.0.0.7:5800")
    assert (identity.kv_hash_seed, identity.kv_block_size) == (contract.kv_hash_seed(model.spec.model.name), 128)
    (v6,) = contract.identities_from_pod("p", "u", "fd00::7", annotations)
    assert (v6.kv_events_endpoint, v6.kv_events_replay_endpoint) == ("tcp://[fd00::7]:5700", "tcp://[fd00::7]:5800")


def test_a_pod_serving_ranks_from_its_start_rank_publishes_at_their_global_offsets() -> None:
    workload = engine_workload(render(parse(dm(SPANNING))).objects, "decode")
    annotations = pod_template(workload)["metadata"]["annotations"]
    for index in (0, 1):  # the start rank from the LWS worker index, then from an explicit annotation
        for labels, extra in (({contract.LWS_WORKER_INDEX_LABEL: str(index)}, {}),
                              ({}, {contract.ANNOTATION_DP_START_RANK: str(8 * index)})):  # fmt: skip
            ids = contract.identities_from_pod("p", "u", "10.0.0.8", {**annotations, **extra}, labels)
            assert [i.kv_events_endpoint for i in ids] == [f"tcp://10.0.0.8:{5700 + r}" for r in range(8 * index, 8 * index + 8)]
            assert [i.kv_events_replay_endpoint for i in ids] == [f"tcp://10.0.0.8:{5800 + r}" for r in range(8 * index, 8 * index + 8)]


def test_a_pod_without_event_annotations_has_no_event_identity() -> None:
    workload = engine_workload(render(parse(dm(EVENTS_OFF["least-outstanding"]))).objects, "decode")
    (identity,) = contract.identities_from_pod("p", "u", "10.0.0.9", pod_template(workload)["metadata"]["annotations"])
    assert (identity.kv_events_endpoint, identity.kv_events_replay_endpoint, identity.kv_hash_seed, identity.kv_block_size) == (
        None, None, None, None)  # fmt: skip


# --- vLLM's own code -----------------------------------------------------------------------------------------

# Run with a cached vLLM environment's python: parse each line as `vllm serve` does, then ask vLLM's own code where
# each rank publishes (offset_endpoint_port, given the rank vLLM's parser derives for the pod) and what its first
# block hash is under the rendered PYTHONHASHSEED, and without it.
VLLM_PROBE = r'''
import json, os, sys
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["HF_HUB_OFFLINE"] = "0"
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform
vllm.platforms._current_platform = CpuPlatform()
from vllm.distributed.kv_events import ZmqEventPublisher
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

def none_hash(algo, seed):
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    kv_cache_utils.init_none_hash(get_hash_fn_by_name(algo))
    return bytes(kv_cache_utils.NONE_HASH).hex()

results = []
for item in json.load(sys.stdin):
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(item["argv"][1:])
    engine = AsyncEngineArgs.from_cli_args(args)
    config = engine.kv_events_config
    start = engine.data_parallel_start_rank or 0
    local = engine.data_parallel_size_local or engine.data_parallel_size
    ranks = range(start, start + local) if engine.data_parallel_size > 1 else range(1)
    algo = engine.prefix_caching_hash_algo
    results.append({
        "id": item["id"],
        "events": None if config is None else {
            "enabled": config.enable_kv_cache_events, "publisher": config.publisher, "topic": config.topic,
            "endpoints": [ZmqEventPublisher.offset_endpoint_port(config.endpoint, r) for r in ranks],
            "replay_endpoints": [ZmqEventPublisher.offset_endpoint_port(config.replay_endpoint, r) for r in ranks],
        },
        "hash_algo": algo,
        "none_hash": [none_hash(algo, item["seed"]) for _ in range(2)] if item["seed"] is not None else None,
        "none_hash_unseeded": [none_hash(algo, None) for _ in range(2)],
    })
out.write(json.dumps(results))
out.flush()
'''


def probe(items: list[dict[str, Any]], version: str) -> dict[str, dict[str, Any]]:
    proc = subprocess.run([vllm_python(version), "-c", VLLM_PROBE], input=json.dumps(items), capture_output=True,
                          text=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"), timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["id"]: r for r in json.loads(proc.stdout)}


def rendered_lines() -> list[dict[str, Any]]:
    """Lines as the containers receive them: events on (one-pod prefill, both pods of an LWS decode), events off."""
    items = []
    for case, patch in (("on", SPANNING), *EVENTS_OFF.items()):
        model = parse(dm(patch))
        objects = render(model).objects
        for role in contract.ENGINE_ROLES:
            workload = engine_workload(objects, role)
            container = engine_container(objects, role)
            seed = env_of(container).get("PYTHONHASHSEED")
            annotations = pod_template(workload)["metadata"]["annotations"]
            if workload["kind"] == "LeaderWorkerSet":
                with tempfile.TemporaryDirectory() as tmp:
                    for index in (0, 1):
                        items.append({"id": f"{case}/{role}-{index}", "argv": pod_argv(container, index, Path(tmp)), "seed": seed,
                                      "annotations": annotations, "labels": {contract.LWS_WORKER_INDEX_LABEL: str(index)}})  # fmt: skip
                continue
            env = {contract.ENV_POD_NAME: "p", contract.ENV_POD_UID: POD_UID, contract.ENV_POD_IP: "10.1.2.3"}
            argv = [expand(a, env) for a in container["command"] + container["args"]]
            items.append({"id": f"{case}/{role}", "argv": argv, "seed": seed, "annotations": annotations, "labels": {}})
    return items


@pytest.mark.vllm
@pytest.mark.parametrize("version", CHECKED_VERSIONS)
def test_vllm_publishes_where_the_contract_says_and_hashes_alike_in_every_process(version: str) -> None:
    items = rendered_lines()
    results = probe([{k: i[k] for k in ("id", "argv", "seed")} for i in items], version)
    assert {i["id"] for i in items} == {"on/prefill", "on/decode-0", "on/decode-1", *(f"{c}/{r}" for c in EVENTS_OFF for r in contract.ENGINE_ROLES)}
    for item in items:
        result = results[item["id"]]
        ids = contract.identities_from_pod("p", "u", "10.1.2.3", item["annotations"], item["labels"])
        if not item["id"].startswith("on/"):
            assert result["events"] is None and result["hash_algo"] == "sha256", item["id"]  # vLLM's defaults
            assert ids[0].kv_events_endpoint is None and item["seed"] is None
            continue
        events = result["events"]
        assert (events["enabled"], events["publisher"], events["topic"]) == (True, "zmq", contract.KV_EVENTS_TOPIC)
        # vLLM binds tcp://*:<port + global rank>; the router connects to the pod's IP at the same port
        assert [e.replace("*", "10.1.2.3") for e in events["endpoints"]] == [i.kv_events_endpoint for i in ids], item["id"]
        assert [e.replace("*", "10.1.2.3") for e in events["replay_endpoints"]] == [i.kv_events_replay_endpoint for i in ids]
        assert result["hash_algo"] == contract.KV_HASH_ALGO == "sha256_cbor"
        # NONE_HASH is sha256(CBOR(PYTHONHASHSEED)): the same in every process, and computable outside vLLM
        first, again = result["none_hash"]
        assert first == again == hashlib.sha256(cbor2.dumps(ids[0].kv_hash_seed, canonical=True)).hexdigest()
    # Without PYTHONHASHSEED 0.26.0 draws NONE_HASH at random per process (0.33.0 has a fixed default for sha256)
    unseeded = results["on/prefill"]["none_hash_unseeded"]
    assert (unseeded[0] != unseeded[1]) == (version == "0.26.0")
