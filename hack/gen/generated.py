"""Files generated from one source of truth and committed beside it (the chart's copies, the dashboards): write
them, or name the stale ones. One command line for every generator: ``python -m <module> [--check]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Iterable

REPO = Path(__file__).resolve().parents[2]


def stale(expected: dict[Path, str], strays: Iterable[Path] = ()) -> list[Path]:
    """The files whose text is not what the generator makes, and ``strays`` (files nothing generates any more)."""
    return [path for path, text in expected.items() if not path.exists() or path.read_text() != text] + list(strays)


def shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def main(prog: str, description: str, expected: Callable[[], dict[Path, str]], argv: list[str] | None = None,
         strays: Callable[[dict[Path, str]], Iterable[Path]] = lambda want: (),
         check_text: Callable[[str], object] = lambda text: None) -> int:  # fmt: skip
    """--check: name the stale files on stderr, exit 1 if any. Otherwise write what changed (each text passed to
    ``check_text`` first: it raises rather than let a broken file be written)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1)")
    args = parser.parse_args(argv)
    want = expected()
    if args.check:
        out = stale(want, strays(want))
        for path in out:
            print(f"stale: {shown(path)}", file=sys.stderr)
        return 1 if out else 0
    for path, text in want.items():
        check_text(text)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {shown(path)}")
    return 0
