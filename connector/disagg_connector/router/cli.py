"""Console entry point ``disagg-router``."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Sequence

from disagg_connector.router.config import parse_args
from disagg_connector.router.server import serve


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        asyncio.run(serve(cfg))
    else:
        uvloop.run(serve(cfg))


if __name__ == "__main__":
    main()
