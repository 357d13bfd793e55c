"""Console entry point ``disagg-router``."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Sequence

from disagg_connector.router.config import parse_args
from disagg_connector.router.dispatch import Dispatcher
from disagg_connector.router.server import serve


def main(argv: Sequence[str] | None = None, dispatcher: type[Dispatcher] = Dispatcher) -> None:
    """``dispatcher``: a benchmark's variant (bench/disagg_bench/localrun/baseline_router.py), never a flag."""
    cfg = parse_args(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        asyncio.run(serve(cfg, dispatcher=dispatcher))
    else:
        uvloop.run(serve(cfg, dispatcher=dispatcher))


if __name__ == "__main__":
    main()
