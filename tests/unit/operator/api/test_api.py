"""The API models: defaults, and every refusal names the field and says what to change."""

from __future__ import annotations

import pytest

from disagg_operator.api.validation import SpecError, parse
from disagg_operator.resolve import backend, transfer_mode

from tests.conftest import dm

EFA = {"efa": {"count": 2}, "resources": {"requests": {"memory": "64Gi"}}}
CPU = {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}


def problems(obj: dict) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as raised:
        parse(obj)
    return [(p.path, p.message) for p in raised.value.problems]


def test_defaults_are_sensible() -> None:
    spec = parse(dm()).spec
    assert spec.engine.block_size == 128
    assert spec.kv_transfer.mode == "Auto" and spec.kv_transfer.side_channel_port == 5600
    assert spec.kv_transfer.lease_seconds > spec.router.request_deadline_seconds
    assert spec.prefill.replicas == 1 and spec.decode.accelerator.count == 1
    assert spec.network.network_policy.enabled
    assert spec.network.placement.zone == "Required" and spec.network.placement.spine == "Preferred"
    assert not spec.network.efa.privileged
    assert (spec.router.prefill_policy, spec.router.decode_policy) == ("PrefixAndLoad", "LeastLoaded")
    assert spec.engine.enable_prefix_caching and spec.publishes_kv_events


# (case id, spec patch, expected field path, a phrase of the message)
INVALID = [
    ("tp-not-dividing", {"prefill": {"parallelism": {"tensor": 3}, "accelerator": {"count": 3}},
                         "decode": {"parallelism": {"tensor": 2}, "accelerator": {"count": 2}}},
     "spec.decode.parallelism.tensor", "divide each other"),
    ("push-bidirectional", {"kvTransfer": {"mode": "Push", "bidirectional": True}},
     "spec.kvTransfer.mode", "bidirectional"),
    ("push-decode-pp", {"kvTransfer": {"mode": "Push"},
                        "decode": {"parallelism": {"pipeline": 2}, "accelerator": {"count": 2}}},
     "spec.kvTransfer.mode", "pipeline"),
    ("push-decode-cp", {"kvTransfer": {"mode": "Push"}, "decode": {"parallelism": {"context": 2}}},
     "spec.kvTransfer.mode", "context parallel"),
    ("push-sleep", {"kvTransfer": {"mode": "Push"}, "engine": {"enableSleepMode": True}},
     "spec.kvTransfer.mode", "sleep mode"),
    ("ucx-over-efa", {"kvTransfer": {"backend": "UCX"}, "prefill": EFA, "decode": EFA},
     "spec.kvTransfer.backend", "TCP speed"),
    ("efa-one-side", {"prefill": EFA}, "spec.decode.efa.count", "both roles"),
    ("autoscaling-without-metrics", {"decode": {"autoscaling": {"maxReplicas": 3, "metrics": []}}},
     "spec.decode.autoscaling.metrics", "at least 1 item"),
    ("autoscaling-min-max", {"decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2, "metrics": [CPU]}}},
     "spec.decode.autoscaling.minReplicas", "must not exceed"),
    ("negative-replicas", {"prefill": {"replicas": -1}}, "spec.prefill.replicas", "greater than or equal to 0"),
    ("decode-no-accelerator", {"decode": {"accelerator": {"count": 0}}},
     "spec.decode.accelerator.count", "greater than or equal to 1"),
    ("gpu-count-mismatch", {"prefill": {"parallelism": {"tensor": 4}, "accelerator": {"count": 8}},
                            "decode": {"parallelism": {"tensor": 4}, "accelerator": {"count": 4}}},
     "spec.prefill.accelerator.count", "at most parallelism.tensor x pipeline x data"),
    ("gpus-not-whole-ranks", {"decode": {"parallelism": {"tensor": 4, "data": 2}, "accelerator": {"count": 6}}},
     "spec.decode.accelerator.count", "multiple of parallelism.tensor x pipeline"),
    ("ranks-not-whole-pods", {"decode": {"parallelism": {"data": 3, "expert": True}, "accelerator": {"count": 2}}},
     "spec.decode.parallelism.data", "multiple of the ranks one pod runs"),
    ("dense-engine-over-pods", {"decode": {"parallelism": {"data": 16}, "accelerator": {"count": 8}}},
     "spec.decode.parallelism.expert", "raise replicas instead"),
    ("mixed-accelerators", {"decode": {"accelerator": {"type": "neuron"}}},
     "spec.decode.accelerator.type", "same accelerator type"),
    ("lease-below-deadline", {"kvTransfer": {"leaseSeconds": 30}, "router": {"requestDeadlineSeconds": 60}},
     "spec.kvTransfer.leaseSeconds", "must exceed"),
    ("side-channel-on-http", {"kvTransfer": {"sideChannelPort": 7999},
                              "decode": {"parallelism": {"data": 2}, "accelerator": {"count": 2}}},
     "spec.kvTransfer.sideChannelPort", "overlap"),
    ("hugepages-without-memory", {"prefill": {"efa": {"count": 1}}, "decode": {"efa": {"count": 1}}},
     "spec.network.efa.hugepages", "cpu or memory request"),
    ("managed-flag", {"engine": {"extraArgs": ["--kv-transfer-config={}"]}},
     "spec.engine.extraArgs", "flags the operator manages"),
    ("managed-flag-dotted", {"decode": {"extraArgs": ["--kv-transfer-config.kv_role", "kv_both"]}},
     "spec.decode.extraArgs", "flags the operator manages"),
    ("managed-env", {"prefill": {"env": [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "0.0.0.0"}]}},
     "spec.prefill.env", "variables the operator manages"),
    ("prefill-context", {"prefill": {"parallelism": {"context": 2}}},
     "spec.prefill.parallelism.context", "decode only"),
    ("unknown-field", {"kvTransfer": {"leaseSecond": 10}}, "spec.kvTransfer.leaseSecond", "unknown field"),
    ("wrong-type", {"prefill": {"replicas": "two"}}, "spec.prefill.replicas", "integer"),
    ("bad-mode", {"kvTransfer": {"mode": "Sideways"}}, "spec.kvTransfer.mode", "'Auto', 'Push' or 'Pull'"),
    ("bad-block-size", {"engine": {"blockSize": 100}}, "spec.engine.blockSize", "128"),
    ("bad-quantity", {"prefill": {"resources": {"requests": {"memory": "lots"}}}},
     "spec.prefill.resources.requests.memory", "not a Kubernetes quantity"),
    ("bad-source", {"model": {"source": {"uri": "ftp://x/y"}}}, "spec.model.source.uri", "pattern"),
    ("port-out-of-range", {"kvTransfer": {"sideChannelPort": 80}}, "spec.kvTransfer.sideChannelPort", "1024"),
    ("vllm-version-without-image", {"engine": {"vllmVersion": "0.26.0"}},
     "spec.engine.vllmVersion", "default engine image runs vLLM 0.33.0 on nvidia"),
    ("vllm-version-unknown", {"engine": {"vllmVersion": "0.30.0", "image": "vllm/vllm-openai:v0.30.0"}},
     "spec.engine.vllmVersion", "'0.33.0'"),
    ("push-pipelined-prefill-on-0.24", {"kvTransfer": {"mode": "Push"},
                                        "engine": {"vllmVersion": "0.24.0", "image": "example.com/vllm:0.24.0"},
                                        "prefill": {"parallelism": {"pipeline": 2}, "accelerator": {"count": 2}}},
     "spec.kvTransfer.mode", "pipelined prefill from 0.26.0 on"),
    # Mistakes the API server would only refuse child by child, or vLLM would silently obey.
    ("toleration-exists-with-value", {"prefill": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
     "spec.prefill.tolerations[0].value", "operator Exists matches any value"),
    ("toleration-equal-without-key", {"decode": {"tolerations": [{"operator": "Equal", "value": "v"}]}},
     "spec.decode.tolerations[0].operator", "without a key must use operator Exists"),
    ("toleration-seconds-not-noexecute", {"decode": {"tolerations": [{"key": "k", "operator": "Exists",
                                                                      "effect": "NoSchedule", "tolerationSeconds": 30}]}},
     "spec.decode.tolerations[0].tolerationSeconds", "only to effect NoExecute"),
    ("node-selector-bad-key", {"prefill": {"nodeSelector": {"bad key!": "x"}}},
     "spec.prefill.nodeSelector", "Kubernetes label keys"),
    ("router-node-selector-bad-key", {"router": {"nodeSelector": {"-zone": "a"}}},
     "spec.router.nodeSelector", "Kubernetes label keys"),
    ("service-annotation-bad-key", {"router": {"service": {"annotations": {"lb type": "nlb"}}}},
     "spec.router.service.annotations", "Kubernetes label keys"),
    ("node-selector-bad-value", {"decode": {"nodeSelector": {"zone": "us east"}}},
     "spec.decode.nodeSelector.zone", "pattern"),
    ("memory-limit-below-request", {"decode": {"resources": {"requests": {"memory": "64Gi"}, "limits": {"memory": "1Gi"}}}},
     "spec.decode.resources.limits", "must not be below"),
    ("cpu-limit-below-request", {"prefill": {"resources": {"requests": {"cpu": 8}, "limits": {"cpu": "500m"}}}},
     "spec.prefill.resources.limits", "must not be below"),
    ("gpu-in-resources", {"decode": {"resources": {"requests": {"nvidia.com/gpu": 4}}}},
     "spec.decode.resources.requests", "accelerator.count"),
    ("efa-in-resources", {"prefill": {"resources": {"limits": {"vpc.amazonaws.com/efa": 16}}}},
     "spec.prefill.resources.requests", "efa.count"),
    ("hugepages-in-resources", {"prefill": {"resources": {"requests": {"hugepages-2Mi": "1Gi", "memory": "8Gi"}}}},
     "spec.prefill.resources.requests", "spec.network.efa.hugepages"),
    ("managed-flag-underscores", {"engine": {"extraArgs": ["--kv_transfer_config={\"kv_role\":\"kv_both\"}"]}},
     "spec.engine.extraArgs", "flags the operator manages"),
    ("managed-flag-underscore-tp", {"prefill": {"extraArgs": ["--tensor_parallel_size=2"]}},
     "spec.prefill.extraArgs", "flags the operator manages"),
    ("managed-flag-abbreviated", {"decode": {"extraArgs": ["--tensor-parallel", "2"]}},
     "spec.decode.extraArgs", "abbreviation"),
    ("managed-flag-short", {"decode": {"extraArgs": ["-tp=2"]}}, "spec.decode.extraArgs", "flags the operator manages"),
    ("config-file-flag", {"engine": {"extraArgs": ["--config", "file.yaml"]}}, "spec.engine.extraArgs", "--config"),
    ("priority-class-not-a-name", {"prefill": {"priorityClassName": "Gold_Class"}}, "spec.prefill.priorityClassName", "pattern"),
    ("scheduler-not-a-name", {"decode": {"schedulerName": "my scheduler"}}, "spec.decode.schedulerName", "pattern"),
    ("image-with-space", {"engine": {"image": "vllm/vllm-openai: v0.33.0"}}, "spec.engine.image", "pattern"),
]


@pytest.mark.parametrize(("patch", "path", "phrase"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_spec_names_field_and_fix(patch: dict, path: str, phrase: str) -> None:
    found = problems(dm(patch))
    assert any(p == path and phrase in m for p, m in found), found


@pytest.mark.parametrize("name", ["qwen3.5-small", "3b-chat", "llama-3.1-70b"])
def test_model_name_must_be_a_service_name(name: str) -> None:
    obj = dm()
    obj["metadata"]["name"] = name
    found = problems(obj)
    assert any(p == "metadata.name" and "qwen3-5-small, not qwen3.5-small" in m for p, m in found), found


def test_missing_model_is_reported() -> None:
    obj = dm()
    del obj["spec"]["model"]
    assert ("spec.model", "required field is missing") in problems(obj)


def test_every_problem_is_reported_at_once() -> None:
    found = problems(dm({"kvTransfer": {"mode": "Push", "bidirectional": True, "backend": "UCX"},
                         "prefill": EFA, "decode": EFA}))
    paths = {p for p, _ in found}
    assert {"spec.kvTransfer.mode", "spec.kvTransfer.backend"} <= paths


VALID_EDGES = [
    ("tp-8-to-2", {"prefill": {"parallelism": {"tensor": 8}, "accelerator": {"count": 8}},
                   "decode": {"parallelism": {"tensor": 2}, "accelerator": {"count": 2}}}),
    ("zero-replicas", {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "router": {"replicas": 0}}),
    ("autoscaling-min-equals-max", {"decode": {"autoscaling": {"minReplicas": 3, "maxReplicas": 3, "metrics": [CPU]}}}),
    ("pull-with-decode-pp", {"kvTransfer": {"mode": "Pull"},
                             "decode": {"parallelism": {"pipeline": 2}, "accelerator": {"count": 2}}}),
    ("efa-without-hugepages", {"prefill": {"efa": {"count": 1}}, "decode": {"efa": {"count": 1}},
                               "network": {"efa": {"hugepages": "0"}}}),
    ("int-quantities", {"prefill": {"resources": {"requests": {"cpu": 8, "memory": "1.5Gi"}}}}),
    ("vllm-version-with-image", {"engine": {"vllmVersion": "0.26.0", "image": "vllm/vllm-openai:v0.26.0"}}),
    ("vllm-version-of-default-image", {"engine": {"vllmVersion": "0.33.0"}}),
    ("push-pipelined-prefill-on-0.26", {"kvTransfer": {"mode": "Push"},
                                        "engine": {"vllmVersion": "0.26.0", "image": "vllm/vllm-openai:v0.26.0"},
                                        "prefill": {"parallelism": {"pipeline": 2}, "accelerator": {"count": 2}}}),
    ("unrelated-extra-args", {"engine": {"extraArgs": ["--max-num-seqs", "256", "--model-loader-extra-config", "{}"]}}),
    ("unmanaged-underscore-flags", {"engine": {"extraArgs": ["--max_num_seqs=256", "--kv-cache-memory-bytes", "30G",
                                                             "--model-impl", "vllm", "-O3"]}}),
    ("labels-and-tolerations", {"prefill": {"nodeSelector": {"topology.kubernetes.io/zone": "us-east-1a",
                                                             "node.kubernetes.io/instance-type": "p5en.48xlarge"},
                                            "tolerations": [{"operator": "Exists"},
                                                            {"key": "k", "operator": "Exists", "effect": "NoExecute",
                                                             "tolerationSeconds": 30}]},
                                "router": {"service": {"annotations": {
                                    "service.beta.kubernetes.io/aws-load-balancer-type": "nlb"}}}}),
    ("limits-at-requests", {"decode": {"resources": {"requests": {"cpu": "500m", "memory": "64Gi"},
                                                     "limits": {"cpu": "0.5", "memory": "65536Mi"}}}}),
    ("decode-spans-two-pods", {"decode": {"parallelism": {"data": 16, "expert": True}, "accelerator": {"count": 8}}}),
    ("tp2-ranks-over-two-pods", {"prefill": {"parallelism": {"tensor": 2, "data": 4, "expert": True}, "accelerator": {"count": 4}},
                                 "decode": {"parallelism": {"tensor": 2, "data": 4, "expert": True}, "accelerator": {"count": 4}}}),
    ("neuron-any-count", {"prefill": {"accelerator": {"type": "neuron", "count": 16}, "parallelism": {"tensor": 64}},
                          "decode": {"accelerator": {"type": "neuron", "count": 16}, "parallelism": {"tensor": 64}}}),
]


@pytest.mark.parametrize("patch", [c[1] for c in VALID_EDGES], ids=[c[0] for c in VALID_EDGES])
def test_valid_edge_cases_are_accepted(patch: dict) -> None:
    parse(dm(patch))


@pytest.mark.parametrize(
    ("patch", "mode", "reason"),
    [
        ({}, "Push", "Auto chose push"),
        ({"kvTransfer": {"bidirectional": True}}, "Pull", "bidirectional"),
        ({"decode": {"parallelism": {"pipeline": 2}, "accelerator": {"count": 2}}}, "Pull", "pipeline"),
        ({"decode": {"parallelism": {"context": 2}}}, "Pull", "context parallel"),
        ({"engine": {"enableSleepMode": True}}, "Pull", "sleep mode"),
        ({"kvTransfer": {"mode": "Pull"}}, "Pull", "Pull requested"),
        ({"kvTransfer": {"mode": "Push"}}, "Push", "Push requested"),
        ({"engine": {"vllmVersion": "0.24.0", "image": "example.com/vllm:0.24.0"},
          "prefill": {"parallelism": {"pipeline": 2}, "accelerator": {"count": 2}}}, "Pull", "vLLM 0.24.0"),
    ],
)
def test_mode_selection(patch: dict, mode: str, reason: str) -> None:
    chosen, why = transfer_mode(parse(dm(patch)).spec)
    assert chosen == mode and reason in why


def test_backend_auto_follows_efa() -> None:
    assert backend(parse(dm()).spec)[0] == "UCX"
    assert backend(parse(dm({"prefill": EFA, "decode": EFA})).spec)[0] == "LIBFABRIC"
