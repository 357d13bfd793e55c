"""vLLM's prefill/decode wire protocol, as the router speaks it, pure (no I/O): both legs' bodies, headers
and ``kv_transfer_params``, the ids of one dispatch, the prefill's answer read and checked, the SSE and
error shapes of vLLM's OpenAI server, the prompt-length estimate. Shared by the router and the benchmark's
load generator, which drives engine pairs without a router (docs/vllm-protocol.md describes the protocol,
version by version). Standard library only: the operator imports the contract package too.
"""

from __future__ import annotations

import json
import math
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
# llm-d's prefix decider estimates prompt tokens as bytes / 4 (AverageCharactersPerToken).
BYTES_PER_TOKEN = 4
SSE_ERROR = b'data: {"error"'  # how a vLLM stream that failed starts its error event
SSE_DONE = b"data: [DONE]\n\n"
_ERROR_STATUS_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


# --- ids ---------------------------------------------------------------------------------------------
def engine_request_id(kind: str, xid: str) -> str:
    """vLLM's request id for X-Request-Id ``xid`` (before its random ``-<8hex>`` suffix)."""
    return f"cmpl-{xid}-0" if kind == "completions" else f"chatcmpl-{xid}"


def mint_ids() -> tuple[str, str]:
    """A fresh (X-Request-Id, transfer_id) for one dispatch: never reused, not even by a retry (P may
    still hold a registration or blocks under the old ones). The ``xfer-`` prefix is vLLM's demo's."""
    xid = uuid.uuid4().hex
    return xid, f"xfer-{xid}"


# --- the legs' requests --------------------------------------------------------------------------------
def leg_headers(xid: str, auth: str | None, dp_rank: int | None) -> dict[str, str]:
    """One leg's headers: the dispatch's id on both legs, the client's credentials, no compression (the
    relay passes bytes through), and the DP rank to pin (``None``: the engine's API server chooses)."""
    h = {"Content-Type": "application/json", "X-Request-Id": xid, "Accept-Encoding": "identity"}
    if auth:
        h["Authorization"] = auth
    if dp_rank is not None:
        h[DP_RANK_HEADER] = str(dp_rank)
    return h


def prefill_body(kind: str, body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    b = {k: v for k, v in body.items() if k not in DROP_ON_PREFILL}
    b["kv_transfer_params"] = {**PREFILL_LEG_PARAMS, "transfer_id": transfer_id}
    b["max_tokens"] = 1
    if kind == "chat" or "max_completion_tokens" in body:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    return b


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's body with the decode leg's ``kv_transfer_params`` (``None``: a local decode, which
    prefills itself). A client's own ``kv_transfer_params`` never reach the engines: they would steer
    the engines' KV transfer."""
    b = dict(body)
    if params is None:
        b.pop("kv_transfer_params", None)
    else:
        b["kv_transfer_params"] = params
    return b


def pull_decode_params(transfer_id: str, returned: dict[str, Any]) -> dict[str, Any]:
    """Pull: P's answer verbatim, with the dispatch's ``transfer_id`` unless P echoed one."""
    return {"transfer_id": transfer_id, **returned}


def returned_request_id(returned: dict[str, Any]) -> str | None:
    """P's own request id in its answer (random suffix included), where it gives one."""
    rid = returned.get("remote_request_id")
    return rid if isinstance(rid, str) else None


# --- the prefill's answer --------------------------------------------------------------------------------
class PrefillAnswerError(ValueError):
    """P's answer is not what the protocol expects. ``mismatch``: it is a JSON object, but speaks another
    protocol than the revision announces (or none)."""

    def __init__(self, message: str, mismatch: bool) -> None:
        super().__init__(message)
        self.mismatch = mismatch


def prefill_transfer_params(answer: Any, mode: str) -> dict[str, Any]:
    """P's ``kv_transfer_params`` from its answer (decoded JSON), checked against the revision's ``mode``
    (Push|Pull): vLLM 0.33.0 announces its ``transfer_mode``; a different one (or none at all) is a
    protocol mismatch, whose decode leg would wait for a KV that never comes, or read it the wrong way."""
    if not isinstance(answer, dict):
        raise PrefillAnswerError("invalid JSON (not an object)", mismatch=False)
    returned = answer.get("kv_transfer_params")
    if not isinstance(returned, dict):
        raise PrefillAnswerError("no kv_transfer_params (not a NIXL kv_producer?)", mismatch=True)
    announced = returned.get("transfer_mode")
    if isinstance(announced, str) and announced.lower() != mode.lower():
        raise PrefillAnswerError(f"transfer_mode {announced!r}", mismatch=True)
    return returned


# --- the decode's answer -----------------------------------------------------------------------------------
def sse_error_message(chunk: bytes) -> str:
    """The message of the error event that starts ``chunk``."""
    try:
        return str(json.loads(chunk.lstrip()[6:].split(b"\n\n", 1)[0])["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return "error event"


def stream_failed_early(first: bytes) -> str | None:
    """Why a stream whose first chunk is ``first`` failed before its first token, or None."""
    if not first:
        return "an empty stream"
    return sse_error_message(first) if first.lstrip().startswith(SSE_ERROR) else None


# --- what the router answers itself ------------------------------------------------------------------------
def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict[str, Any]:
    """The error body of vLLM's OpenAI server (and OpenAI's): {"error": {message, type, param, code}}."""
    return {"error": {"message": message, "type": err_type or _ERROR_STATUS_TYPES.get(status, "Error"), "param": param, "code": status}}


# --- the prompt's length -----------------------------------------------------------------------------------
def _text_tokens(value: Any) -> int:
    if isinstance(value, str):
        return math.ceil(len(value.encode()) / BYTES_PER_TOKEN)
    if isinstance(value, list):
        if value and all(isinstance(x, int) for x in value):
            return len(value)  # token ids: exact
        return sum(_text_tokens(v) for v in value)
    if isinstance(value, dict):  # a chat content part
        return _text_tokens(value.get("text"))
    return 0


def estimate_prompt_tokens(kind: str, body: dict[str, Any]) -> int:
    """Prompt length in tokens without a tokenizer: exact for token ids, bytes / 4 for text."""
    if kind == "completions":
        return _text_tokens(body.get("prompt"))
    messages = body.get("messages")
    return sum(_text_tokens(m.get("content")) for m in messages if isinstance(m, dict)) if isinstance(messages, list) else 0
