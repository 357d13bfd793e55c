"""hack/gen/dashboard_png.py draws the dashboards' main panels from the committed dashboard JSON: the panels
it renders are the ones MAIN names, each exactly one panel of the dashboard, and every query it sends is one of
that panel's targets made concrete (none typed into the script), so the PNG cannot drift from the dashboard."""

from __future__ import annotations

import copy
import re

import pytest

from hack.gen import dashboard_png as png
from hack.gen import dashboards
from disagg_bench.vllm_sim.harness import MODEL

VALUES = png.variables(MODEL)


@pytest.mark.parametrize("name", sorted(png.MAIN))
def test_the_rendered_panels_are_the_main_panels_of_the_dashboard_with_its_own_queries(name: str) -> None:
    board = dashboards.load(name)
    rendered = png.main_panels(board, png.MAIN[name], VALUES)
    assert [(p.kind, p.title) for p in rendered] == list(png.MAIN[name])
    assert len(set(png.MAIN[name])) == len(png.MAIN[name])
    for panel in rendered:
        [source] = [p for p in dashboards.panels(board) if (p["type"], p["title"]) == (panel.kind, panel.title)]
        # every target of the panel, in its order, each the JSON's expr with the variables replaced
        assert [t.expr for t in panel.targets] == [dashboards.concrete(t["expr"], VALUES) for t in source["targets"]]
        assert [t.legend for t in panel.targets] == [t.get("legendFormat", "") for t in source["targets"]]
        assert panel.unit == source["fieldConfig"]["defaults"]["unit"]
        for t in panel.targets:
            assert "$" not in t.expr, t.expr  # no variable left for Prometheus to choke on
            assert f"[{png.RATE_INTERVAL}]" in t.expr or "rate(" not in t.expr


def test_every_query_sent_comes_from_the_dashboard_json() -> None:
    """The set of queries the script sends is a subset of the dashboard's own, made concrete."""
    for name, wanted in png.MAIN.items():
        board = dashboards.load(name)
        from_json = {dashboards.concrete(expr, VALUES) for _, expr in dashboards.queries(board)}
        sent = {t.expr for p in png.main_panels(board, wanted, VALUES) for t in p.targets}
        assert sent and sent <= from_json, sent - from_json


def test_the_main_panels_cover_the_brief() -> None:
    """TTFT split, TPOT, E2E, request rate, failures by cause, ready pairs, the prefix hit rate, in-flight."""
    titles = {title for _, title in png.MAIN["disagg-model.json"]}
    for needed in ("TTFT split (mean)", "Time per output token", "End-to-end latency", "Requests by status",
                   "Failures by cause", "Ready pairs", "Expected prefix hit ratio", "Requests in flight"):  # fmt: skip
        assert needed in titles


def test_a_changed_dashboard_is_a_clear_error() -> None:
    board = copy.deepcopy(dashboards.load("disagg-model.json"))
    for panel in dashboards.panels(board):
        if panel["title"] == "Failures by cause":
            panel["title"] = "Failures"
    with pytest.raises(ValueError, match=re.escape("0 timeseries panels titled 'Failures by cause'")):
        png.main_panels(board, png.MAIN["disagg-model.json"], VALUES)


def test_a_changed_query_is_what_gets_sent() -> None:
    """The script reads the expr at run time: a query edited in the JSON is the one it sends."""
    board = copy.deepcopy(dashboards.load("disagg-model.json"))
    [target] = [p for p in dashboards.panels(board) if p["title"] == "Retries"][0]["targets"]
    target["expr"] = 'sum(rate(disagg_router_retries_total{namespace="$namespace"}[$__rate_interval]))'
    [retries] = [p for p in png.main_panels(board, png.MAIN["disagg-model.json"], VALUES) if p.title == "Retries"]
    assert [t.expr for t in retries.targets] == ['sum(rate(disagg_router_retries_total{namespace="inference"}[10s]))']


def test_legends_follow_grafanas_legend_format() -> None:
    assert png.legend("{{revision}} {{mode}} {{code}}", {"revision": "r1", "mode": "push", "code": "200"}) == "r1 push 200"
    assert png.legend("prefill leg {{ mode }}", {"mode": "pull"}) == "prefill leg pull"
    assert png.legend("{{role}} {{backend}}", {"role": "decode"}) == "decode"  # a missing label: empty, as Grafana
    assert png.legend("", {"a": "b"}) == "value"


def test_the_scrape_attaches_the_labels_the_dashboard_selects_on() -> None:
    """The router's target carries the namespace and a pod of <model>-router, as a PodMonitor's scrape does: the
    dashboard's router selector matches it."""
    [job] = png.scrape_config(8000)["scrape_configs"]
    [static] = job["static_configs"]
    assert static["targets"] == ["127.0.0.1:8000"]
    assert static["labels"]["namespace"] == VALUES["$namespace"]
    pods = dashboards.concrete(dashboards.ROUTER_PODS, VALUES)
    assert re.fullmatch(pods, static["labels"]["pod"])


def test_the_drawing_writes_a_small_png(tmp_path) -> None:
    board = dashboards.load("disagg-model.json")
    panels = png.main_panels(board, png.MAIN["disagg-model.json"], VALUES)
    data = [[("r1", [0.0, 2.0, 4.0], [0.1, 0.2, 0.15])] if i % 3 else [] for i in range(len(panels))]
    out = tmp_path / "board.png"
    png.draw("title", panels, data, 4.0, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size < 300_000
