"""Stream migration, the pure part: a decode stream that breaks, stalls or ends in the engine's error after its
first token is continued on another pair, and the client's stream goes on as if nothing happened
(docs/router.md, "Failures and stream migration"). The I/O (opening the continuation on a pair) is
:mod:`dispatch`'s, relaying it :mod:`relay`'s; this module decides and rewrites:

- :func:`refusal`: whether a request can be continued faithfully at all (known before it is dispatched);
- :class:`Trail`: what the client has been sent, read from the events relayed to it: the prompt's token ids and
  every generated token's id (the decode leg asks vLLM for them with ``return_token_ids``; both releases the
  project supports answer it, 0.26.0 and 0.33.0), and the fields the client did not ask for taken out again;
- :func:`continuation_body`: the continuation, a ``/v1/completions`` request whose prompt is the original
  prompt's token ids plus every generated token's id (never re-tokenised text: a chat's prompt ids are the
  ones vLLM rendered from its chat template), with what is left of ``max_tokens``;
- the continuation's events rewritten into the client's stream (:meth:`Trail.feed` with ``splice``): its id and
  ``created``, a chat chunk's shape for a chat request, and ``usage`` as if nothing had happened (prompt tokens:
  the client's prompt; completion tokens: every token the client got).

What cannot be continued faithfully (:data:`REFUSALS`) ends with an error event and no ``[DONE]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from disagg_connector.contract.vllm_pd import SSE_DONE, error_body

# What became of a stream whose decode failed after its first token (disagg_router_migrations_total's outcome):
# continued on another pair; whole already (every token was out); not continued (the request rules it out; its
# maxMigrations reached; no pair took it; migration off). The chart's alerts count all but UNCUT as cut streams.
MIGRATED, COMPLETE, REFUSED, EXHAUSTED, FAILED, OFF = "migrated", "complete", "refused", "exhausted", "failed", "off"
OUTCOMES = (MIGRATED, COMPLETE, REFUSED, EXHAUSTED, FAILED, OFF)
UNCUT = (MIGRATED, COMPLETE)

# Why a stream cannot be continued on another engine exactly as it would have gone on (the error event names it).
REFUSALS = {
    "n": "it asks for several choices (n or best_of above 1): each would need its own continuation",
    "logprobs": "it asks for logprobs, whose offsets and prompt logprobs a continuation cannot carry on",
    "structured_output": "its structured output (response_format, guided decoding) would restart at the "
    "grammar's root on another engine",
    "tools": "its tool calls are parsed by the engine's chat server, whose state a continuation cannot resume",
    "seed": "it is sampled with a seed: a continuation would draw from another random stream",
    "several_prompts": "it sends several prompts in one request",
    "echo": "it asks for its prompt echoed, which vLLM leaves out when it returns token ids",
    "parsed_delta": "the engine's reasoning or tool parser shaped its answer, whose state a continuation "
    "cannot resume",
    "no_token_ids": "the engine did not say which token ids it sent (return_token_ids)",
}
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
# A chat request's fields that a completions continuation must not carry (the prompt already holds their effect).
_CHAT_ONLY = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "documents", "mm_processor_kwargs", "max_completion_tokens",
    "reasoning_effort", "include_reasoning", "return_prompt_text", "response_format",
)  # fmt: skip
_CHAT_DELTA = frozenset(("role", "content"))


def refusal(kind: str, body: dict[str, Any]) -> str | None:
    """The key of :data:`REFUSALS` that rules a continuation out for this request, or None."""
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        return "n"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs"
    fmt = body.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or any(body.get(k) for k in _STRUCTURED):
        return "structured_output"
    if kind == "chat" and body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    if body.get("seed") is not None and body.get("temperature", 1.0) != 0:
        return "seed"
    if body.get("echo"):
        return "echo"
    prompt = body.get("prompt")
    if kind == "completions" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
        return "several_prompts"
    return None


def decode_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as the decode leg sends it when the stream may have to be continued: with token ids."""
    return body if body.get("return_token_ids") else {**body, "return_token_ids": True}


def _max_tokens(kind: str, body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens") or body.get("max_tokens") if kind == "chat" else body.get("max_tokens")
    return value if isinstance(value, int) else None


@dataclass
class Trail:
    """One client stream as relayed so far. :meth:`feed` takes the bytes read from a decode and returns those for
    the client (whole events only; an event split across reads waits for its end)."""

    kind: str  # of the client's request: "completions" | "chat"
    keep_ids: bool  # the client asked for token ids itself: they stay in its events
    usage: bool = False  # the client asked for a usage event (stream_options.include_usage)
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    response_id: str = ""
    created: int = 0
    model: str = ""
    finished: bool = False  # a finish_reason came: every token is out
    usage_sent: bool = False  # the usage event came
    done: bool = False  # [DONE] came
    error: dict[str, Any] | None = None  # the engine's own error event, taken out of the stream
    unfaithful: str | None = None  # a key of REFUSALS learnt from the events themselves
    events: int = 0  # events with tokens, for the time per output token
    _base: int = 0  # tokens generated before the current continuation
    _splice: bool = False
    _tail: bytes = b""

    def continue_here(self) -> None:
        """A continuation starts: its events are rewritten into the client's stream from now on."""
        self._base, self._splice, self._tail = len(self.generated), True, b""
        self.error, self.done = None, False

    def feed(self, chunk: bytes) -> bytes:
        data = self._tail + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._tail = data
            return b""
        self._tail = data[cut + 2 :]
        out = bytearray()
        for event in data[: cut + 2].split(b"\n\n")[:-1]:
            out += self._event(event)
        return bytes(out)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: "):
            return event + b"\n\n"
        payload = event[6:]
        if payload == b"[DONE]":
            if self.error is not None:
                return b""  # the engine ended its error with [DONE]: the relay decides how this stream ends
            self.done = True
            return SSE_DONE
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if not isinstance(obj, dict):
            return event + b"\n\n"
        if "error" in obj:
            self.error = obj
            return b""
        self._learn(obj)
        if self._splice:
            obj = self._spliced(obj)
        elif not self.keep_ids:
            self._strip(obj)
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _learn(self, obj: dict[str, Any]) -> None:
        self.usage_sent = self.usage_sent or (obj.get("usage") is not None and not obj.get("choices"))
        if not self.response_id and not self._splice:
            self.response_id, self.created, self.model = str(obj.get("id", "")), int(obj.get("created", 0)), str(obj.get("model", ""))
        choices = obj.get("choices") or []
        if self.prompt_ids is None and not self._splice:
            ids = obj.get("prompt_token_ids") if self.kind == "chat" else (choices[0].get("prompt_token_ids") if choices else None)
            if isinstance(ids, list):
                self.prompt_ids = ids
        for c in choices:
            ids = c.get("token_ids")
            if isinstance(ids, list):
                self.generated += ids
                self.events += bool(ids)
            elif (c.get("text") or c.get("delta", {}).get("content")) and self.unfaithful is None:
                self.unfaithful = "no_token_ids"
            if self.kind == "chat" and not self._splice and not _CHAT_DELTA.issuperset(k for k, v in c.get("delta", {}).items() if v):
                self.unfaithful = self.unfaithful or "parsed_delta"
            if c.get("finish_reason") is not None:
                self.finished = True

    def _strip(self, obj: dict[str, Any]) -> None:
        obj.pop("prompt_token_ids", None)
        for c in obj.get("choices") or []:
            c.pop("prompt_token_ids", None)
            c.pop("token_ids", None)

    def _usage(self, usage: Any) -> Any:
        """The continuation's usage as the client's: its prompt held the tokens generated before it."""
        if not isinstance(usage, dict):
            return usage
        u = dict(usage)
        u["prompt_tokens"] = usage.get("prompt_tokens", 0) - self._base
        u["completion_tokens"] = usage.get("completion_tokens", 0) + self._base
        return u

    def _spliced(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A continuation's (completions) event in the client's stream."""
        choices = []
        for c in obj.get("choices") or []:
            if self.kind == "chat":
                choice: dict[str, Any] = {"index": 0, "delta": {"content": c.get("text", "")}, "logprobs": None,
                                          "finish_reason": c.get("finish_reason")}  # fmt: skip
                if c.get("finish_reason") is not None:  # vLLM's chat sets it on the finishing chunk only
                    choice["stop_reason"] = c.get("stop_reason")
            else:
                choice = {k: v for k, v in c.items() if k != "prompt_token_ids"}
            if self.keep_ids and "token_ids" in c:
                choice["token_ids"] = c["token_ids"]
            else:
                choice.pop("token_ids", None)
            choices.append(choice)
        out: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else obj.get("object", "text_completion"),
            "created": self.created,
            "model": self.model or obj.get("model", ""),
            "choices": choices,
        }
        if obj.get("usage") is not None:
            out["usage"] = self._usage(obj["usage"])
        return out

    def why_not(self) -> str | None:
        """Why what was sent so far cannot be continued (a key of REFUSALS), or None."""
        if self.unfaithful is not None:
            return self.unfaithful
        if self.prompt_ids is None:
            return "no_token_ids"
        return None

    def closing(self) -> bytes:
        """The end of a stream whose every token was out when its decode failed (a finish_reason came): the
        usage event the client asked for, unless it came, then [DONE]."""
        self.done = True
        out = b""
        if self.usage and not self.usage_sent and self.prompt_ids is not None:
            n, p = len(self.generated), len(self.prompt_ids)
            usage = {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}
            obj = {"id": self.response_id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                   "created": self.created, "model": self.model, "choices": [], "usage": usage}  # fmt: skip
            out = b"data: " + orjson.dumps(obj) + b"\n\n"
        return out + SSE_DONE


def continuation_body(kind: str, body: dict[str, Any], trail: Trail) -> dict[str, Any] | None:
    """The ``/v1/completions`` body that continues ``trail`` (None: nothing is left to generate)."""
    assert trail.prompt_ids is not None
    b = {k: v for k, v in body.items() if k not in _CHAT_ONLY} if kind == "chat" else dict(body)
    generated = len(trail.generated)
    limit = _max_tokens(kind, body)
    if limit is not None:
        if limit - generated <= 0:
            return None
        b["max_tokens"] = limit - generated
    if isinstance(body.get("min_tokens"), int):
        b["min_tokens"] = max(0, body["min_tokens"] - generated)
    b.pop("kv_transfer_params", None)
    b.pop("suffix", None)
    b["prompt"] = [*trail.prompt_ids, *trail.generated]
    b["echo"] = False
    b["stream"] = True
    b["return_token_ids"] = True
    return b


def wants_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def end_event(cause: str, detail: str) -> bytes:
    """How a stream that could not be continued ends: an error event and no ``[DONE]``, so that no client takes
    the truncated answer for a whole one (OpenAI's own streams end a server error this way; its SDK raises)."""
    message = f"the answer is incomplete: the decode engine's stream failed ({cause}) and {detail}"
    return b"data: " + orjson.dumps(error_body(502, message)) + b"\n\n"
