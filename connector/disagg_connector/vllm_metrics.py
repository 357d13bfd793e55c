"""The series of vLLM's own ``/metrics`` that this project reads, and one way to read them.

vLLM 0.26.0 and 0.33.0 export them from ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``), labelled
``model_name`` and ``engine`` (the engine core's global DP rank: one label set per rank the API server fronts).
The engine's preStop hook (:mod:`disagg_connector.drain`) and the router's load reads
(:mod:`disagg_connector.router.load`) both read them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterator, Mapping

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"  # requests in the batch
WAITING = "vllm:num_requests_waiting"  # queued, and waiting for a remote KV (vLLM's skipped_waiting queue)
# WAITING split by a label ``reason``: "capacity" (queued for the scheduler: no room in the batch or the KV cache)
# and "deferred" (held back by a transient constraint: WAITING_FOR_REMOTE_KVS, a LoRA budget); their sum is WAITING.
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
WAITING_FOR_CAPACITY = "capacity"
KV_USAGE = "vllm:kv_cache_usage_perc"  # blocks referenced by requests (prefix-cached free blocks do not count)
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens looked up in the prefix cache
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # of those, found cached
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # labels block_size, num_gpu_blocks (the KV cache's size)


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float

    @property
    def engine(self) -> str:
        """The engine core (DP rank) the sample is about; an engine without the label is rank 0."""
        return self.labels.get("engine", "0")


def read_samples(text: str | bytes, names: Collection[str], only_their_lines: bool = False) -> Iterator[Sample]:
    """The samples of the series ``names`` in ``/metrics`` ``text``, with prometheus_client's parser.

    ``only_their_lines`` parses only the lines that start with one of ``names`` (a vLLM page is mostly
    histograms, tens of kB; the router reads one per engine every second). Otherwise the whole text is parsed,
    and text that is not Prometheus text format raises (ValueError, mostly).
    """
    if isinstance(text, bytes):
        text = text.decode()
    if only_their_lines:
        text = "\n".join(line for line in text.splitlines() if line.startswith(tuple(names))) + "\n"
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                yield Sample(s.name, s.labels, float(s.value))
