"""vLLM's prefill/decode wire protocol, as the router speaks it: the prefill leg's body, the ids of one
dispatch, the data-parallel rank header. Shared by the router and the benchmark's load generator, which
drives engine pairs without a router (docs/vllm-protocol.md describes the protocol, version by version).
"""

from __future__ import annotations

import uuid
from typing import Any

PREFILL_LEG_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
DROP_ON_PREFILL = ("min_tokens", "min_completion_tokens", "stream_options")
DP_RANK_HEADER = "X-data-parallel-rank"


def engine_request_id(kind: str, xid: str) -> str:
    """vLLM's request id for X-Request-Id ``xid`` (before its random ``-<8hex>`` suffix)."""
    return f"cmpl-{xid}-0" if kind == "completions" else f"chatcmpl-{xid}"


def mint_ids() -> tuple[str, str]:
    """A fresh (X-Request-Id, transfer_id) for one dispatch: never reused, not even by a retry (P may
    still hold a registration or blocks under the old ones). The ``xfer-`` prefix is vLLM's demo's."""
    xid = uuid.uuid4().hex
    return xid, f"xfer-{xid}"


def prefill_body(kind: str, body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    b = {k: v for k, v in body.items() if k not in DROP_ON_PREFILL}
    b["kv_transfer_params"] = {**PREFILL_LEG_PARAMS, "transfer_id": transfer_id}
    b["max_tokens"] = 1
    if kind == "chat" or "max_completion_tokens" in body:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    return b
