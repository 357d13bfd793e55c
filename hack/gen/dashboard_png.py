"""PNGs of the model dashboard's main panels, from the dashboard's own queries against a real Prometheus.

    python -m hack.gen.dashboard_png [--out docs/dashboards] [--seconds 75]

No Grafana can be installed here (it is in neither the Python nor the Debian registries, and its Go module needs
its JavaScript frontend built), so this draws what Grafana would: two simulated prefill and two simulated decode
engines behind our router (``--prefill-policy prefix-and-load``), the real Prometheus (hack/gen/prometheus.py)
scraping the router every second with the target labels a Kubernetes PodMonitor attaches (``namespace``, a ``pod``
named like a pod of the Deployment ``<model>-router``), traffic for SECONDS (conversations whose turns share
their history, so the prefix cache hits; short prompts that decode serves alone; a spell of failed KV transfers
and one of an engine answering 503), then every main panel's targets, read from the committed dashboard JSON
(hack/gen/dashboards.py ``load``) and made concrete with ``dashboards.concrete``, asked of Prometheus with
``query_range`` and drawn with matplotlib into ``disagg-model.png``.

The operator dashboard is not drawn: its series come from the operator reconciling on a cluster, which this
script does not start.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack.gen import dashboards
from hack.gen.prometheus import PrometheusServer
from disagg_bench.vllm_sim import harness as h

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "dashboards"

NAMESPACE, REVISION = "inference", "r1"
ROUTER_POD = f"{h.MODEL}-router-7c9d5f8b6-x2k9p"  # a pod of the Deployment <model>-router, as ROUTER_PODS expects
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval is 4 x the scrape interval at least: 1 s here, so a short window
STEP = 2  # seconds between the points of query_range

# The main panels drawn, by (type, title): the stat row first, then the time series (titles repeat across types:
# "Ready pairs" is both). tests/unit/chart/test_dashboard_png.py checks each is exactly one panel of the dashboard.
MAIN: dict[str, tuple[tuple[str, str], ...]] = {
    "disagg-model.json": (
        ("stat", "Ready pairs"),
        ("stat", "Requests"),
        ("stat", "Failed answers"),
        ("stat", "Not disaggregated"),
        ("timeseries", "TTFT split (mean)"),
        ("timeseries", "TTFT split (p95)"),
        ("timeseries", "Time per output token"),
        ("timeseries", "End-to-end latency"),
        ("timeseries", "Requests by status"),
        ("timeseries", "Failures by cause"),
        ("timeseries", "Retries"),
        ("timeseries", "Requests in flight"),
        ("timeseries", "Ready pairs"),
        ("timeseries", "Picks by reason"),
        ("timeseries", "Expected prefix hit ratio"),
        ("timeseries", "Load per backend"),
    ),
    # drawn by tests/e2e/test_alerts_e2e.py's day-2 test (--dashboard-png-dir): its series need the operator
    # reconciling on a cluster
    "disagg-operator.json": (
        ("timeseries", "Reconciles by result"),
        ("timeseries", "Reconcile errors"),
        ("timeseries", "Errors by reason"),
        ("timeseries", "Reconcile latency"),
        ("timeseries", "Active workers"),
        ("timeseries", "Work queue"),
        ("timeseries", "Children applied"),
        ("timeseries", "Children deleted"),
        ("timeseries", "Models by phase"),
    ),
}


# --- what is drawn: decided from the dashboard JSON alone -----------------------------------------------
@dataclass(frozen=True)
class Target:
    expr: str  # concrete PromQL: the panel's expr with the variables replaced
    legend: str  # Grafana's legendFormat ("{{mode}} ...")


@dataclass(frozen=True)
class Panel:
    kind: str  # "stat" or "timeseries"
    title: str
    unit: str
    stacked: bool
    targets: tuple[Target, ...]


def variables(model: str, namespace: str = NAMESPACE, revision: str = REVISION) -> dict[str, str]:
    """Grafana's template variables as this run's Prometheus needs them."""
    return {"${datasource}": "prometheus", "$__rate_interval": RATE_INTERVAL, "$namespace": namespace,
            "$model": model, "$revision": revision}  # fmt: skip


def main_panels(board: dict[str, Any], wanted: tuple[tuple[str, str], ...], values: dict[str, str]) -> list[Panel]:
    """The panels of WANTED, in that order, with every target of each made concrete; a (type, title) that is not
    exactly one panel of BOARD is a ValueError naming it (the dashboard changed: update MAIN)."""
    out = []
    for kind, title in wanted:
        found = [p for p in dashboards.panels(board) if p.get("type") == kind and p.get("title") == title]
        if len(found) != 1:
            raise ValueError(f"{board['uid']}: {len(found)} {kind} panels titled {title!r}, expected one: update MAIN")
        p = found[0]
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        stacking = defaults.get("custom", {}).get("stacking", {}).get("mode", "none")
        targets = tuple(Target(dashboards.concrete(t["expr"], values), t.get("legendFormat", "")) for t in p["targets"])
        out.append(Panel(kind, title, defaults.get("unit", "none"), stacking == "normal", targets))
    return out


_LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: ``{{name}}`` replaced by the series' label (empty when it has none)."""
    text = _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), fmt).strip()
    return re.sub(r"\s+", " ", text) or "value"


def scrape_config(router_port: int, interval: str = "1s") -> dict[str, Any]:
    """Prometheus's config: the router as the pod a PodMonitor would find (the router's own ``pod`` label on the
    per-backend gauges becomes ``exported_pod``, as in a cluster)."""
    labels = {"namespace": NAMESPACE, "pod": ROUTER_POD, "container": "router"}
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": "router", "static_configs": [{"targets": [f"127.0.0.1:{router_port}"], "labels": labels}]}],
    }


# --- drawing ---------------------------------------------------------------------------------------------
def _formatter(unit: str) -> Any:
    from matplotlib.ticker import FuncFormatter

    def fmt(v: float, _: Any = None) -> str:
        if unit == "s":
            return f"{v * 1e3:.0f} ms" if abs(v) < 1 else f"{v:.2g} s"
        if unit == "percentunit":
            return f"{v * 100:.0f}%"
        return f"{v:.3g}"

    return FuncFormatter(fmt)


def stat_text(unit: str, value: float | None) -> str:
    if value is None or math.isnan(value):
        return "No data"
    suffix = {"reqps": " req/s", "ops": "/s"}.get(unit, "")
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    return _formatter(unit)(value) + suffix


Series = list[tuple[str, list[float], list[float]]]  # (legend, times relative to the start, values)


def draw(title: str, panels: list[Panel], data: list[Series], seconds: float, path: Path) -> None:
    """One PNG: the stat panels as a row of numbers (the last value, over a faint line), the time series below in
    a grid of three, each titled and with its legend as the panel has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = [(p, d) for p, d in zip(panels, data, strict=True) if p.kind == "stat"]
    series = [(p, d) for p, d in zip(panels, data, strict=True) if p.kind != "stat"]
    cols, units = 3, 12  # time series three a row on a grid of 12 columns; the stats share the top row
    rows = math.ceil(len(series) / cols)
    fig = plt.figure(figsize=(15, 1.6 + 3.1 * rows), dpi=72)
    grid = fig.add_gridspec(rows + 1, units, height_ratios=[0.45] + [1] * rows, hspace=0.55, wspace=1.6, top=0.95)
    fig.suptitle(title, fontsize=12, x=0.01, y=0.99, ha="left")
    width = units // max(len(stats), 1)
    for i, (p, d) in enumerate(stats):
        ax = fig.add_subplot(grid[0, i * width:(i + 1) * width])
        last = next((v[-1] for _, _, v in d if v), None)
        for _, t, v in d:
            ax.plot(t, v, color="tab:green", alpha=0.35, linewidth=1)
        ax.text(0.5, 0.45, stat_text(p.unit, last), transform=ax.transAxes, ha="center", va="center", fontsize=20, weight="bold")
        ax.set_title(p.title, fontsize=10, loc="left")
        ax.set_xticks([])
        ax.set_yticks([])
    width = units // cols
    for i, (p, d) in enumerate(series):
        r, c = divmod(i, cols)
        ax = fig.add_subplot(grid[r + 1, c * width:(c + 1) * width])
        ax.set_title(p.title, fontsize=10, loc="left")
        if not d:
            ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color="grey")
        elif p.stacked:  # Grafana's normal stacking: each series on top of the ones before, a gap counting 0
            times = sorted({x for _, t, _ in d for x in t})
            stacks = [[dict(zip(t, v)).get(x, 0.0) for x in times] for _, t, v in d]
            ax.stackplot(times, *stacks, labels=[n for n, _, _ in d], alpha=0.6, linewidth=0.5)
        else:
            for name, t, v in d:
                ax.plot(t, v, label=name, linewidth=1.2)
        ax.set_xlim(0, seconds)
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(_formatter(p.unit))
        ax.tick_params(labelsize=8)
        ax.set_xlabel("seconds", fontsize=8)
        ax.grid(alpha=0.3)
        if d:
            ax.legend(fontsize=7, loc="upper left", ncol=2, framealpha=0.6)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72, bbox_inches="tight")
    plt.close(fig)


# --- the run: real engines, router and Prometheus --------------------------------------------------------
def fetch(prom: PrometheusServer, panel: Panel, start: float, end: float) -> Series:
    out: Series = []
    for target in panel.targets:
        for s in sorted(prom.query_range(target.expr, start, end, STEP), key=lambda s: sorted(s["metric"].items())):
            points = [(float(t) - start, float(v)) for t, v in s["values"] if not math.isnan(float(v))]
            if points:
                out.append((legend(target.legend, s["metric"]), [t for t, _ in points], [v for _, v in points]))
    return out


async def traffic(router_url: str, sims: dict[str, h.Sim], seconds: float, concurrency: int = 4) -> dict[str, int]:
    """Conversations (each turn a prompt holding the ones before: a shared prefix), every fifth request a short
    prompt decode serves alone, half the answers streamed; in the middle a spell of failed KV receives on one
    decode engine, then one prefill engine answering 503. Counts of the answers' statuses."""
    rng = random.Random(21)
    histories = {c: " ".join(f"sys{c}-{i}" for i in range(rng.randint(200, 500))) for c in range(12)}
    statuses: dict[int, int] = {}
    start = time.monotonic()

    async def faults() -> None:
        for at, sim, fault in ((0.35, "d1", {"fail_transfers": True}), (0.5, "d1", {"fail_transfers": False}),
                               (0.6, "p1", {"unavailable": True}), (0.7, "p1", {"unavailable": False})):  # fmt: skip
            await asyncio.sleep(max(0.0, start + at * seconds - time.monotonic()))
            await asyncio.to_thread(sims[sim].control, **fault)

    async def client(n: int) -> None:
        k = 0
        while time.monotonic() - start < seconds:
            k += 1
            if k % 5 == 0:
                prompt = " ".join(f"s{i}" for i in range(30))  # under the 64-token threshold: decode alone
            else:
                c = rng.randrange(len(histories))
                histories[c] += " " + " ".join(f"turn{n}-{k}-{i}" for i in range(rng.randint(20, 80)))
                prompt = histories[c]
            body = {**h.completion(max_tokens=rng.randint(8, 48), stream=k % 2 == 0), "prompt": prompt}
            reply = await h.post(router_url + "/v1/completions", body)
            statuses[reply.status] = statuses.get(reply.status, 0) + 1

    await asyncio.gather(faults(), *(client(n) for n in range(concurrency)))
    return statuses


def render_board(prom: PrometheusServer, board_name: str, values: dict[str, str], start: float, end: float, what: str,
                 out: Path) -> Path:
    """BOARD_NAME's MAIN panels over [START, END] from PROM, into OUT/<board>.png, titled with WHAT ran."""
    board = dashboards.load(board_name)
    panels = main_panels(board, MAIN[board_name], values)
    data = [fetch(prom, p, start, end) for p in panels]
    for p, d in zip(panels, data, strict=True):
        print(f"{p.title}: {len(d)} series", file=sys.stderr)
    path = out / board_name.replace(".json", ".png")
    draw(f"{board['title']}: main panels, {what}", panels, data, end - start, path)
    return path


def run(out: Path, seconds: float) -> list[Path]:
    board_name = "disagg-model.json"
    main_panels(dashboards.load(board_name), MAIN[board_name], variables(h.MODEL))  # a stale MAIN fails before starting
    with tempfile.TemporaryDirectory(prefix="dashboard-png-") as tmp:
        work = Path(tmp)
        sims = {name: h.launch_sim(work, "prefill" if name[0] == "p" else "decode", name=name, revision=REVISION)
                for name in ("p0", "p1", "d0", "d1")}  # fmt: skip
        static = work / "endpoints.json"
        h.write_static(static, [s.static_entry() for s in sims.values()])
        router = h.launch_router(work, static, extra=("--prefill-policy", "prefix-and-load", "--disaggregation-threshold-tokens",
                                                      "64", "--load-scrape-interval-seconds", "0.5"))  # fmt: skip
        try:
            h.wait_ready(*sims.values(), router)
            h.wait_until(lambda: router.health()["revisions"][REVISION]["readyPairs"] >= 1, what="a ready pair")
            with PrometheusServer(scrape_config(router.port), work / "prometheus") as prom:
                h.wait_until(lambda: prom.query(f'up{{pod="{ROUTER_POD}"}} == 1'), 30.0, interval=0.5, what="the router scraped")
                start = time.time()
                statuses = asyncio.run(traffic(router.url, sims, seconds))
                # a scrape after the last answer, so that its counts are in the series
                done = time.time()
                h.wait_until(lambda: float(prom.query(f'timestamp(up{{pod="{ROUTER_POD}"}})')[0]["value"][1]) > done + 1,
                             15.0, interval=0.2, what="a scrape after the traffic")  # fmt: skip
                end = time.time()
                print(f"answers by status: {statuses}", file=sys.stderr)
                path = render_board(prom, board_name, variables(h.MODEL), start, end,
                                    f"{seconds:.0f} s of simulated traffic (our router, 2 prefill + 2 decode simulated "
                                    "engines, a real Prometheus)", out)  # fmt: skip
        finally:
            h.stop_all(router, *sims.values())
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.gen.dashboard_png", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the PNGs (default: docs/dashboards)")
    parser.add_argument("--seconds", type=float, default=75.0, help="how long to drive traffic")
    args = parser.parse_args(argv)
    if args.seconds < 20:
        parser.error("--seconds must be at least 20 (the rate window and the failure spells need them)")
    for path in run(args.out, args.seconds):
        print(f"wrote {path} ({path.stat().st_size // 1024} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
