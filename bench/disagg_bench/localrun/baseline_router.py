"""The router with a benchmark's dispatch of push revisions: one leg after the other, as vLLM's 0.33-era
demo proxy dispatches (the decode chosen by load after the prefill answered, with P's identity from
discovery and P's own request id from its answer). A baseline for what push's concurrent legs buy
(`disagg-localrun --modes router-push-sequential`); the production router cannot be configured into it.

    python -m disagg_bench.localrun.baseline_router --mode push-sequential <the router's other flags>
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Sequence

from disagg_connector.contract.vllm_pd import engine_request_id, returned_request_id
from disagg_connector.router import cli
from disagg_connector.router.discovery import Backend
from disagg_connector.router.dispatch import Dispatcher, RequestContext
from disagg_connector.router.legs import LegRequest, Timeline
from disagg_connector.router.pairing import Candidates
from disagg_connector.router.relay import Opened

MODE = "push-sequential"


class SequentialPushDispatcher(Dispatcher):
    async def push_attempt(
        self, ctx: RequestContext, req: LegRequest, chosen: Candidates, p: Backend, tl: Timeline, held: contextlib.ExitStack
    ) -> Opened:
        def decode_params(returned: dict[str, Any]) -> dict[str, Any]:
            # P's own id (random suffix included): its heartbeats then match the decode's.
            rid = returned_request_id(returned) or engine_request_id(req.kind, req.xid)
            return p.identity.push_decode_params(rid, req.transfer_id)

        return await self.sequential_attempt(ctx, req, chosen.revision, p, tl, held, decode_params)


def router_argv(argv: Sequence[str]) -> list[str]:
    """The router's flags: ``--mode push-sequential`` names this dispatcher, whose default protocol is push."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == f"--mode={MODE}":
            out[i] = "--mode=push"
        elif arg == MODE and i > 0 and out[i - 1] == "--mode":
            out[i] = "push"
    return out


def main(argv: Sequence[str] | None = None) -> None:
    cli.main(router_argv(sys.argv[1:] if argv is None else argv), dispatcher=SequentialPushDispatcher)


if __name__ == "__main__":
    main()
