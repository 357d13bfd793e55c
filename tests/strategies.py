"""Hypothesis strategies for DisaggregatedModel manifests: always valid, plus one mutation per rule that breaks it."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# Flags that vLLM 0.33.0 accepts and the operator does not manage.
SAFE_EXTRA_ARGS = [
    ["--max-num-seqs", "128"],
    ["--max-num-batched-tokens", "16384"],
    ["--enforce-eager"],
    ["--disable-log-stats"],
    ["--seed", "0"],
    [],
]

names = st.from_regex(r"[a-z]([a-z0-9-]{0,120}[a-z0-9])?", fullmatch=True)


@st.composite
def roles(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(prefill, decode, extra spec) with tensor sizes that divide each other and matching devices."""
    accelerator = draw(st.sampled_from(["nvidia", "neuron"]))
    efa = draw(st.sampled_from([0, 1, 4, 16]))
    out = []
    for role in ("prefill", "decode"):
        tensor = draw(st.sampled_from([1, 2, 4, 8]))
        pipeline = draw(st.sampled_from([1, 2])) if role == "prefill" else draw(st.sampled_from([1, 1, 2]))
        data = draw(st.sampled_from([1, 1, 2]))
        context = 1 if role == "prefill" else draw(st.sampled_from([1, 1, 1, 2]))
        count = tensor * pipeline * data if accelerator == "nvidia" else draw(st.sampled_from([1, 8, 16]))
        spec: dict[str, Any] = {
            "replicas": draw(st.integers(0, 4)),
            "parallelism": {"tensor": tensor, "pipeline": pipeline, "data": data, "context": context,
                            "expert": draw(st.booleans())},
            "accelerator": {"type": accelerator, "count": count},
            "efa": {"count": efa},
            "resources": {"requests": {"cpu": draw(st.sampled_from([4, "500m", "16"])), "memory": "64Gi"}},
            "extraArgs": draw(st.sampled_from(SAFE_EXTRA_ARGS)),
        }
        if draw(st.booleans()):
            spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": draw(st.integers(1, 8)), "metrics": [
                {"type": "Pods", "pods": {"metric": {"name": "vllm:num_requests_waiting"},
                                          "target": {"type": "AverageValue", "averageValue": "4"}}}]}
        if draw(st.booleans()):
            spec["env"] = [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]
        out.append(spec)
    # Keep tensor sizes dividing each other (the smaller divides the larger: powers of two).
    return out[0], out[1], {"efa": efa}


@st.composite
def models(draw: st.DrawFn) -> dict[str, Any]:
    prefill, decode, info = draw(roles())
    # A release other than the default image's comes with an image of that release.
    vllm_version = draw(st.sampled_from([None, "0.24.0", "0.26.0", "0.33.0"]))
    neuron = prefill["accelerator"]["type"] == "neuron"
    effective_version = vllm_version or ("0.24.0" if neuron else "0.33.0")
    needs_pull = (
        decode["parallelism"]["pipeline"] > 1 or decode["parallelism"]["context"] > 1
        or (effective_version == "0.24.0" and prefill["parallelism"]["pipeline"] > 1)
    )
    bidirectional = draw(st.booleans())
    mode = draw(st.sampled_from(["Auto", "Pull"] if needs_pull or bidirectional else ["Auto", "Push", "Pull"]))
    backend = draw(st.sampled_from(["Auto", "LIBFABRIC"] if info["efa"] else ["Auto", "UCX"]))
    deadline = draw(st.integers(1, 300))
    source = draw(
        st.sampled_from(
            [None, {"uri": "hf://Qwen/Qwen3-8B", "secretRef": {"name": "hf"}}, {"uri": "pvc://cache/qwen"},
             {"uri": "s3://bucket/qwen", "secretRef": {"name": "aws"}}]
        )
    )
    model: dict[str, Any] = {
        "name": "Qwen/Qwen3-8B",
        "dtype": draw(st.sampled_from(["auto", "bfloat16", "float16"])),
        "kvCacheDtype": draw(st.sampled_from(["auto", "fp8"])),
    }
    if source:
        model["source"] = source
    if draw(st.booleans()):
        model["maxModelLen"] = draw(st.integers(1024, 131072))
    if draw(st.booleans()):
        model["servedModelName"] = "served"
    engine: dict[str, Any] = {
        "blockSize": draw(st.sampled_from([16, 32, 64, 128, 256])),
        "enablePrefixCaching": draw(st.booleans()),
        "enableSleepMode": draw(st.booleans()) if mode != "Push" else False,
    }
    if vllm_version:
        engine["vllmVersion"] = vllm_version
        engine["image"] = f"registry.example.com/vllm:{vllm_version}"
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedModel",
        "metadata": {"name": draw(names), "namespace": draw(st.sampled_from(["default", "ml"])), "uid": "u-1"},
        "spec": {
            "model": model,
            "engine": engine,
            "kvTransfer": {
                "mode": mode,
                "backend": backend,
                "bidirectional": bidirectional and mode != "Push",
                "leaseSeconds": deadline + draw(st.integers(5, 600)),
                "sideChannelPort": draw(st.sampled_from([5600, 9000, 20000])),
            },
            "prefill": prefill,
            "decode": decode,
            "router": {"requestDeadlineSeconds": deadline, "replicas": draw(st.integers(0, 3))},
            "network": {
                "networkPolicy": {"enabled": draw(st.booleans())},
                "placement": {"separateHosts": draw(st.booleans()), "zone": draw(st.sampled_from(["Required", "Preferred", "None"]))},
                "efa": {"privileged": draw(st.booleans())},
            },
        },
    }


# One mutation per rule: (id, function that breaks the rule in place, expected problem path).
def _set(path: str, value: Any):
    def apply(obj: dict[str, Any]) -> None:
        node = obj["spec"]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return apply


BREAKERS = [
    ("push+bidirectional", [_set("kvTransfer.mode", "Push"), _set("kvTransfer.bidirectional", True)], "spec.kvTransfer.mode"),
    ("ucx+efa", [_set("kvTransfer.backend", "UCX"), _set("prefill.efa.count", 2), _set("decode.efa.count", 2)], "spec.kvTransfer.backend"),
    ("lease<=deadline", [_set("kvTransfer.leaseSeconds", 10), _set("router.requestDeadlineSeconds", 10)], "spec.kvTransfer.leaseSeconds"),
    ("tp-3-vs-2", [_set("prefill.parallelism.tensor", 3), _set("decode.parallelism.tensor", 2)], "spec.decode.parallelism.tensor"),
    ("negative-replicas", [_set("decode.replicas", -3)], "spec.decode.replicas"),
    ("no-accelerator", [_set("decode.accelerator.count", 0)], "spec.decode.accelerator.count"),
    ("managed-flag", [_set("engine.extraArgs", ["--block-size", "16"])], "spec.engine.extraArgs"),
    ("managed-expert-flag", [_set("decode.extraArgs", ["--enable_expert_parallel"])], "spec.decode.extraArgs"),
    ("managed-dp-flag", [_set("prefill.extraArgs", ["-dpr", "8"])], "spec.prefill.extraArgs"),
    ("managed-dp-prefix", [_set("engine.extraArgs", ["--data-parallel-start=8"])], "spec.engine.extraArgs"),
    ("unknown-field", [_set("router.deadline", 5)], "spec.router.deadline"),
    ("vllm-version-without-its-image", [_set("engine.vllmVersion", "0.26.0"), _set("engine.image", None),
                                        _set("prefill.accelerator.type", "nvidia"), _set("decode.accelerator.type", "nvidia")],
     "spec.engine.vllmVersion"),
]


# Mutations that pass admission (a free-form field the CRD cannot describe) but make the API server refuse a
# child: the operator must say so in status (ChildRejected), never crash or half-apply.
CHILD_BREAKERS = [
    ("affinity-without-terms", [_set("decode.affinity", {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}})]),
    ("affinity-empty-topology-key", [_set("prefill.affinity", {"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {"matchLabels": {"a": "b"}}, "topologyKey": ""}]}})]),
    ("affinity-not-a-list", [_set("prefill.affinity", {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"x": 1}}})]),
    ("metrics-peer-garbage", [_set("network.networkPolicy", {"enabled": True, "metricsFrom": [{"podSelector": {"matchLabels": {"bad key!": "x"}}}]})]),
]
