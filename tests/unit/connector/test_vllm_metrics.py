"""Reading vLLM's /metrics (disagg_connector.vllm_metrics): the router parses only the lines of the series it reads
and finds what prometheus_client finds in the whole page (vLLM's own pages, the simulator's, and label values with
every character the text format escapes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from disagg_connector.router.load import _READ
from disagg_connector.vllm_metrics import CACHE_CONFIG_INFO, RUNNING, WAITING, Sample, read_samples
from tests.fixtures.releases import RELEASES
from disagg_bench.vllm_sim.sim import CACHE_CONFIG_INFO as VLLM_0_33_0_CACHE_CONFIG

ROUTER_READS = (*_READ, CACHE_CONFIG_INFO)


def by_prometheus_client(text: str, names: tuple[str, ...]) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name in names]


def by_line(text: str, names: tuple[str, ...]) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value) for s in read_samples(text, names, only_their_lines=True)]


def simulator_page() -> str:
    """What the simulator's registry renders: vLLM 0.33.0's ``cache_config_info`` line, ~40 labels."""
    registry = CollectorRegistry()
    Gauge(RUNNING, "running", ["engine", "model_name"], registry=registry).labels("0", "m").set(3)
    info = Gauge(CACHE_CONFIG_INFO, "cache config", ["engine", *VLLM_0_33_0_CACHE_CONFIG], registry=registry)
    info.labels("0", *VLLM_0_33_0_CACHE_CONFIG.values()).set(1)
    return generate_latest(registry).decode()


@pytest.mark.parametrize("release", RELEASES)
def test_the_routers_lines_read_as_the_whole_page_does(release: str) -> None:
    text = RELEASES[release]
    assert by_line(text, ROUTER_READS) == by_prometheus_client(text, ROUTER_READS) != []
    assert by_line(text.encode(), ROUTER_READS) == by_line(text, ROUTER_READS)


def test_the_simulators_cache_config_info_is_read() -> None:
    text = simulator_page()
    [(name, labels, value)] = by_line(text, (CACHE_CONFIG_INFO,))
    assert (name, value) == (CACHE_CONFIG_INFO, 1.0) and len(labels) > 30
    assert by_line(text, ROUTER_READS) == by_prometheus_client(text, ROUTER_READS)


def test_a_longer_name_that_starts_with_a_read_one_is_not_read() -> None:
    text = f'{WAITING}_by_reason{{engine="0",reason="deferred"}} 4.0\n{WAITING}{{engine="0"}} 1.0\n'
    assert list(read_samples(text, (WAITING,), only_their_lines=True)) == [Sample(WAITING, {"engine": "0"}, 1.0)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(st.sampled_from('ab "\\\n{}=,#\t é'), max_size=12), min_size=1, max_size=4), st.floats(allow_nan=False))
def test_any_label_values_prometheus_client_writes_are_read_back(values: list[str], value: float) -> None:
    registry = CollectorRegistry()
    names = [f"l{i}" for i in range(len(values))]
    Gauge(RUNNING, "running", names, registry=registry).labels(*values).set(value)
    text = generate_latest(registry).decode()
    assert by_line(text, (RUNNING,)) == by_prometheus_client(text, (RUNNING,)) == [(RUNNING, dict(zip(names, values)), value)]
