"""The committed benchmark results (bench/results/): raw data stored compressed, summaries made from it.

    python -m disagg_bench.results list                       # each summary, its raw files, how it is made (README table)
    python -m disagg_bench.results regenerate NAME.md         # print what the summary's tables are made from, rebuilt
    python -m disagg_bench.results regenerate --check         # which regenerable summaries differ from their raw data
    python -m disagg_bench.results regenerate --write         # rewrite the summaries that are one program's whole output
    python -m disagg_bench.results compress FILE.json ...     # a new run's results.json in: FILE.json.xz, the plain one removed

Raw files are `NAME.json.xz` (xz: a tenth of the plain size, a third smaller than gzip; Python's lzma reads it). A
program names one by its plain name, `bench/results/NAME.json`, and reads it with `load_results`, which takes the
plain file where there is one (a fresh run) and else the `.json.xz` or `.json.gz` beside that name; `raw_files`
lists a folder's raw files by those plain names. `disagg-localrun bench` still writes plain results.json (a user's
run, read by eye and by jq); `compress` is the step that commits one.

Summaries are of three kinds (SUMMARIES): a whole file one program printed from the raw data (`disagg-localrun
report`: regenerated and compared byte for byte); a hand-written page whose tables a program printed (its tables are
regenerated and each must appear in the page verbatim; the prose is not checked); hand-written or from a program
whose raw data is not committed (not regenerable: said so, with how its figures were made).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import lzma
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterable

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results in a checkout
COMPRESSED = (".xz", ".gz")


def stored_path(path: str | Path) -> Path:
    """The file that holds a raw file named by its plain name: the plain file if present, else NAME.xz or NAME.gz."""
    path = Path(path)
    if path.suffix in COMPRESSED or path.exists():
        return path
    for suffix in COMPRESSED:
        candidate = path.with_name(path.name + suffix)
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{path}: no such results file, nor {path.name}.xz or {path.name}.gz beside it")


def open_results(path: str | Path) -> IO[str]:
    """A raw results file opened for reading as text: `.json`, `.json.xz` or `.json.gz`, or a plain name whose
    compressed file is stored (stored_path)."""
    stored = stored_path(path)
    if stored.suffix == ".xz":
        return lzma.open(stored, "rt", encoding="utf-8")
    if stored.suffix == ".gz":
        return gzip.open(stored, "rt", encoding="utf-8")
    return stored.open(encoding="utf-8")


def load_results(path: str | Path) -> Any:
    """A raw results file, parsed (see open_results)."""
    with open_results(path) as f:
        return json.load(f)


def plain_name(path: str | Path) -> Path:
    """`x.json.xz` -> `x.json`: the name a raw file is known by whatever its compression."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in COMPRESSED else path


def raw_files(directory: str | Path = RESULTS, pattern: str = "*") -> list[Path]:
    """The raw results in a folder by their plain names (`DIR/NAME.json`), sorted, stored plain or compressed;
    `pattern` matches the stem (e.g. "h200-*")."""
    directory = Path(directory)
    found = {plain_name(p) for ext in (".json", *(".json" + s for s in COMPRESSED)) for p in directory.glob(pattern + ext)}
    return sorted(found)


def compress(path: str | Path) -> Path:
    """FILE.json -> FILE.json.xz (the same bytes, xz -9e), the plain file removed."""
    path = Path(path)
    out = path.with_name(path.name + ".xz")
    out.write_bytes(lzma.compress(path.read_bytes(), preset=9 | lzma.PRESET_EXTREME))
    if load_results(out) != json.loads(path.read_bytes()):
        raise ValueError(f"{out}: does not read back as {path}")
    path.unlink()
    return out


# --- the summaries -----------------------------------------------------------------------------------------------
WHOLE, TABLES, NOT_REGENERABLE = "whole file", "tables", "not regenerable"


@dataclass(frozen=True)
class Summary:
    name: str  # the summary's file in bench/results
    raws: tuple[str, ...]  # its raw files' plain names (in bench/results)
    kind: str  # WHOLE, TABLES or NOT_REGENERABLE
    command: str = ""  # the command that prints it (WHOLE, TABLES), or how it was made (NOT_REGENERABLE)
    render: Callable[[list[Any]], str] | None = None  # the raw data, parsed, in `raws` order -> the command's output
    other_raws: tuple[str, ...] = ()  # raw files the page also cites, whose figures it copied by hand
    note: str = ""  # how the page uses other_raws
    known_difference: str = ""  # a difference between the page and its raw data found and left for a person to settle


def _localrun_report(baseline: str | None = None, repeats: bool = False) -> Callable[[list[Any]], str]:
    def render(runs: list[Any]) -> str:
        from disagg_bench.localrun import report

        return report.render(runs, baseline, repeats)

    return render


def _migration(runs: list[Any]) -> str:
    """disagg-localrun migrate's report of each run (migration.md), in order."""
    from disagg_bench.localrun.migrate import markdown

    return "\n".join(markdown(run) for run in runs)


def _kvbench(runs: list[Any]) -> str:
    """kvbench's own per-run lines (its table on the terminal), one block per results file."""
    from disagg_bench import kvbench

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for doc in runs:
            for i, r in enumerate(doc["runs"]):
                kvbench._print_run(r, header=i == 0)
            print()
    return out.getvalue()


def _r(stem: str, reps: Iterable[Any]) -> tuple[str, ...]:
    return tuple(f"{stem}{i}.json" for i in reps)


_LR = "disagg-localrun report"
_ROUTING = "router-push:least-outstanding"
SUMMARIES: tuple[Summary, ...] = (
    Summary("h200-1gpu-push.md", ("h200-1gpu-push.json",), WHOLE, f"{_LR} h200-1gpu-push.json.xz", _localrun_report()),
    Summary("h200-1gpu-push-sequential.md", ("h200-1gpu-push-sequential.json",), WHOLE,
            f"{_LR} h200-1gpu-push-sequential.json.xz", _localrun_report()),
    Summary("h200-1gpu-pull-tcp.md", ("h200-1gpu-pull-tcp.json",), WHOLE, f"{_LR} h200-1gpu-pull-tcp.json.xz", _localrun_report()),
    Summary("h200-issue20-1gpu.md", _r("h200-issue20-1gpu-r", (1, 2, 3)), TABLES,
            f"{_LR} h200-issue20-1gpu-r{{1,2,3}}.json.xz --repeats --baseline router-pull", _localrun_report("router-pull", True)),
    Summary("h200-issue20-peers.md", _r("h200-issue20-peers-r", (1, 2, 3)), TABLES,
            f"{_LR} h200-issue20-peers-r{{1,2,3}}.json.xz --repeats --baseline router-pull", _localrun_report("router-pull", True),
            other_raws=("h200-issue20-peers-8b.json",),
            note=f"its 8B section's two tables are rows of `{_LR} h200-issue20-peers-8b.json.xz`, reordered by hand (every row "
            "verbatim, checked once; not by --check)"),
    Summary("h200-issue30-migration.md", tuple(f"h200-issue30-migration-{run}.json" for run in ("push", "pull", "push-4096-x32", "pull-4096-x32")), TABLES,
            "the migration.md that `disagg-localrun migrate` wrote with each .json.xz (hack/gpu/run.sh issue30-migration)", _migration),
    Summary("kvbench-h200.md", ("kvbench-h200.json", "kvbench-h200-per-block.json", "kvbench-h200-llama70b.json"), TABLES,
            "kvbench's per-run lines (disagg_bench.kvbench._print_run) of each of the three .json.xz", _kvbench,
            known_difference="Llama-3.1-70B table, pull-background's bg-thr ms: the page says 1.650, "
            "kvbench-h200-llama70b.json 1.787 (every other figure agrees); the page is left as committed"),
)


def summary(name: str) -> Summary:
    for s in SUMMARIES:
        if s.name == name or s.name == Path(name).name:
            return s
    raise KeyError(f"{name}: not a regenerable summary (python -m disagg_bench.results list)")


def regenerate(s: Summary, directory: Path = RESULTS) -> str:
    assert s.render is not None, s.name
    return s.render([load_results(directory / raw) for raw in s.raws])


def blocks(text: str) -> list[list[str]]:
    """Runs of consecutive non-blank lines (a table, a terminal table), without the indentation of a code block."""
    out: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.strip():
            out[-1].append(line.rstrip())
        elif out[-1]:
            out.append([])
    return [b for b in out if b]


def differences(s: Summary, directory: Path = RESULTS) -> list[str]:
    """What differs between the committed summary and its regeneration: [] when they agree. WHOLE: the first
    differing line; TABLES: each regenerated table (block of lines) not found verbatim in the summary."""
    text = regenerate(s, directory)
    committed = (directory / s.name).read_text()
    if s.kind == WHOLE:
        if text == committed:
            return []
        old, new = committed.splitlines(), text.splitlines()
        n = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        return [f"line {n + 1}: committed {old[n] if n < len(old) else '<end>'!r}, regenerated {new[n] if n < len(new) else '<end>'!r}"]
    lines = [line.rstrip() for line in committed.splitlines()]
    problems = []
    for block in blocks(text):
        if block[0].startswith("|") or len(block) > 1:  # a table; single lines (headings of a section) are the page's own
            if not any(lines[i:i + len(block)] == block for i in range(len(lines) - len(block) + 1)):
                problems.append(f"table starting {block[0][:100]!r} ({len(block)} lines) is not in the page as regenerated")
    return problems


def readme_table() -> str:
    """The table of bench/results/README.md: every summary (SUMMARIES and NOT_REGENERABLE_SUMMARIES)."""
    lines = ["| summary | raw files | kind | regenerate, or how it was made |", "|---|---|---|---|"]
    for s in (*SUMMARIES, *NOT_REGENERABLE_SUMMARIES):
        raws = ", ".join(f"`{r}.xz`" for r in (*s.raws, *s.other_raws)) or "none committed"
        how = f"`python -m disagg_bench.results regenerate {s.name}` (= `{s.command}`)" if s.render else s.command
        how += f"; {s.note}" if s.note else ""
        how += f". **Differs:** {s.known_difference}" if s.known_difference else ""
        lines.append(f"| [{s.name}]({s.name}) | {raws} | {s.kind} | {how} |")
    return "\n".join(lines) + "\n"


_I19 = _r("h200-issue19-routing-r", range(1, 8)) + _r("h200-issue19-routing-8b-r", (1, 2, 3)) + \
    _r("h200-issue19-noreuse-r", range(1, 8)) + _r("h200-issue19-noreuse-8b-r", (1, 2, 3))
NOT_REGENERABLE_SUMMARIES: tuple[Summary, ...] = (
    Summary("h200-localrun.md", ("h200-1gpu-push.json", "h200-1gpu-push-sequential.json", "h200-1gpu-pull-tcp.json"),
            NOT_REGENERABLE, "hand-written: figures from the three runs' reports (h200-1gpu-*.md, regenerable) and the "
            "device calls' logs, composed by hand"),
    Summary("h200-issue18-dp.md", ("h200-issue18-dp.json",), NOT_REGENERABLE,
            "hand-written: figures from the json (written by hand from the runs' logs; no program reads or prints it)"),
    Summary("h200-issue19-routing.md", _I19, NOT_REGENERABLE,
            f"hand-written: tables from `{_LR} ... --repeats --baseline {_ROUTING}` over the runs the page names (its commands), "
            "edited by hand (columns dropped, modes renamed, bold), so they do not appear verbatim (the first table's "
            "figures agree with the command's), and an inline python3 snippet"),
    Summary("h200-issue20-inversion.md", _r("h200-issue20-1gpu-r", (1, 2, 3)) + _r("h200-issue20-peers-r", (1, 2, 3)),
            NOT_REGENERABLE, "hand-written: figures printed by the inline python3 snippets in the page (they read the raw files "
            "with `load_results`; rerun them to check), composed by hand"),
    Summary("h200-issue31-cpu-tier.md", tuple(f"h200-issue31-cpu-tier-{run}.json" for run in ("8gi", "base-r1", "32gi", "base-r2", "pages")),
            NOT_REGENERABLE, "hand-written: the cells table printed by `python3 hack/gpu/cpu_tier_report.py report` over the four "
            "runs' folders (their results.json and /metrics pages; the report's json is the -pages file), the pages table made "
            "from that json, the by-turn table printed by the inline python3 snippet in the page"),
    Summary("sim-vs-real.md", ("h200-1gpu-pull-tcp.json", "h200-1gpu-push-sequential.json", "h200-1gpu-push.json",
                               *_r("h200-issue20-1gpu-r", (1, 2, 3)), *_r("h200-issue19-routing-r", range(1, 6)),
                               *_r("h200-issue19-noreuse-r", range(1, 6))), NOT_REGENERABLE,
            "`python -m disagg_bench.sim_vs_real` (~22 min): replays, in real time on the simulator, the h200-*.json.xz runs "
            "a calibration profile names; its figures vary run to run, so they regenerate only approximately"),
    Summary("routing-sim.md", (), NOT_REGENERABLE,
            "`python -m disagg_bench.routing_sim --runs 3 --cell-seconds 30 --peer` (simulator, ~7 min); no raw data committed"),
    Summary("cpu-tier-sim.md", (), NOT_REGENERABLE,
            "`python -m disagg_bench.cpu_tier_sim --runs 3 --cell-seconds 40` (simulator, ~13 min); no raw data committed"),
    Summary("operator-scale.md", (), NOT_REGENERABLE,
            "`python -m disagg_bench.operator_scale --sizes 50,200 --runs 3` (local control plane); no raw data committed"),
    Summary("router-bench.txt", (), NOT_REGENERABLE, "`python -m disagg_bench.router_bench` (timed run); no raw data committed"),
    Summary("migration-gap-sim.md", (), NOT_REGENERABLE,
            "`python -m disagg_bench.migration_bench` (timed run of simulated engines, H200 profile); no raw data committed"),
    Summary("autoscale-sim.md", (), NOT_REGENERABLE,
            "`python -m disagg_bench.autoscale_sim` (fleet model, seeded: the same figures each run, ~3 min) and the page's "
            "before/after snippet; no raw data committed"),
    Summary("router-bench-cpu.txt", (), NOT_REGENERABLE,
            "`python -m disagg_bench.router_bench --only-cpu ...` (the file's header); no raw data committed"),
    Summary("router-bench-short.txt", (), NOT_REGENERABLE,
            "`python -m disagg_bench.router_bench --skip-headroom --skip-peers`; no raw data committed"),
    Summary("router-bench-peers-2026-12-06.txt", (), NOT_REGENERABLE,
            "`python -m disagg_bench.router_bench --skip-headroom --skip-short --skip-cpu --peer-engines zero-cost --runs 3`; "
            "no raw data committed"),
    Summary("router-bench-peers-timed-2026-12-06.txt", (), NOT_REGENERABLE,
            "`python -m disagg_bench.router_bench --skip-headroom --skip-short --skip-cpu --peer-engines timed --runs 3`; "
            "no raw data committed"),
    Summary("router-bench-toy-proxy.txt", (), NOT_REGENERABLE,
            "`python -m disagg_bench.router_bench --skip-short --toy-proxy ...`; no raw data committed"),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m disagg_bench.results", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=RESULTS, help="the results folder (default: bench/results)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the summaries, their raw files and how each is made (bench/results/README.md's table)")
    regen = sub.add_parser("regenerate", help="rebuild the regenerable summaries' tables from the raw data")
    regen.add_argument("names", nargs="*", help="summaries (default: every regenerable one)")
    what = regen.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="say which summaries differ from their regeneration; exit 1 if any")
    what.add_argument("--write", action="store_true",
                      help="rewrite the whole-file summaries in place (a page with tables in prose is never rewritten)")
    comp = sub.add_parser("compress", help="FILE.json -> FILE.json.xz, the plain file removed")
    comp.add_argument("files", nargs="+", type=Path)
    a = ap.parse_args(argv)

    if a.cmd == "list":
        sys.stdout.write(readme_table())
        return 0
    if a.cmd == "compress":
        for path in a.files:
            print(compress(path))
        return 0
    chosen = [summary(n) for n in a.names] if a.names else list(SUMMARIES)
    if a.check:
        bad = 0
        for s in chosen:
            problems = differences(s, a.dir)
            known = bool(problems) and bool(s.known_difference)
            print(f"{'differs' if problems else 'ok':<8} {s.name} ({s.kind}){f' - known: {s.known_difference}' if known else ''}")
            for p in problems:
                print(f"         {p}")
            bad += bool(problems) and not known
        return 1 if bad else 0
    for s in chosen:
        text = regenerate(s, a.dir)
        if a.write:
            if s.kind == WHOLE:
                (a.dir / s.name).write_text(text)
                print(f"wrote {s.name}")
            else:
                print(f"left {s.name}: tables inside a hand-written page (`regenerate {s.name}` prints them)")
        else:
            sys.stdout.write(text if len(chosen) == 1 else f"===== {s.name}\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
