"""Where a prompt's start is probably cached: an approximate prefix index over prompt text, per prefill backend.

The router has no tokenizer (the engines do), so it cannot compute vLLM's block hashes of a text prompt. It
does what vllm-router's ``cache_aware`` does, in a form that costs one pass over the prompt's bytes:

- **Chunks.** A prompt is cut into chunks of :data:`CHUNK_BYTES` bytes of its text (about 64 tokens at the 4
  bytes per token the router estimates with: four vLLM blocks), or :data:`CHUNK_TOKENS` token ids for a
  token-id prompt; each chunk's key is chained (hash of the previous key and the chunk), so equal keys mean equal
  prefixes. Chat requests chain their messages' roles and texts in order, which is the order vLLM's chat template
  puts them in: a conversation's next turn shares the previous turn's chunks. Only the whole chunks count, as
  vLLM caches only whole blocks.
- **What an engine holds** is assumed from where the router sent prompts: each prefill dispatch records the
  prompt's chunks on the chosen backend. Each backend keeps at most its KV cache's worth of chunks (vLLM's
  ``cache_config_info``, read by :mod:`load`), least recently used out first, as vLLM evicts; the index as a
  whole at most ``max_chunks``.
- **A match** is the number of leading chunks a backend holds (a miss ends it: a prefix cache is a prefix).
- **Forgotten** when the backend leaves the table or its engine restarted (:class:`load.LoadBoard` sees its
  counters go back).

Pure state; the policies in :mod:`policy` read it. Python's ``hash`` keys the chunks: salted per process, which
is fine for an index that lives in one process, and much faster than a cryptographic hash on long prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from disagg_connector.contract.vllm_pd import BYTES_PER_TOKEN

# Four of vLLM's default 16-token blocks, in the bytes of text the router estimates a token by: coarse enough
# that a 16k-token prompt is 256 chunks (a pick stays well under a millisecond), fine enough to rank engines.
CHUNK_TOKENS = 64
CHUNK_BYTES = CHUNK_TOKENS * BYTES_PER_TOKEN
_SEPARATOR = b"\x1e"  # between chat messages: never inside UTF-8 text a template would render the same


@dataclass(frozen=True)
class PromptKey:
    """A request's chained chunk keys, made once per request."""

    chunks: tuple[int, ...]
    tokens: int  # the prompt's estimated length in tokens
    token_ids: tuple[int, ...] | None = None  # a token-id prompt's ids: matched exactly against KV events

    @property
    def tokens_per_chunk(self) -> float:
        return CHUNK_TOKENS


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_bytes(kind: str, body: dict[str, Any]) -> bytes | list[int] | None:
    """What the chunks are cut from: the prompt's text as bytes, its token ids, or None (a batch of prompts,
    or nothing recognisable: no key, the policy then weighs load alone)."""
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt.encode()
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) == 1:
            return prompt_bytes(kind, {"prompt": prompt[0]})
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    parts = [f"{m.get('role', '')}\n{_content_text(m.get('content'))}".encode() for m in messages if isinstance(m, dict)]
    return _SEPARATOR.join(parts)


def chunk_keys(data: bytes | Sequence[int]) -> tuple[int, ...]:
    """Chained keys of the whole chunks of ``data`` (bytes: CHUNK_BYTES each; token ids: CHUNK_TOKENS each)."""
    size = CHUNK_BYTES if isinstance(data, (bytes, bytearray)) else CHUNK_TOKENS
    keys = []
    prev = 0
    for start in range(0, len(data) - size + 1, size):
        chunk = data[start : start + size]
        prev = hash((prev, chunk if isinstance(chunk, bytes) else tuple(chunk)))
        keys.append(prev)
    return tuple(keys)


def prompt_key(kind: str, body: dict[str, Any], tokens: int) -> PromptKey:
    data = prompt_bytes(kind, body)
    if data is None:
        return PromptKey((), tokens)
    return PromptKey(chunk_keys(data), tokens, tuple(data) if isinstance(data, list) else None)


class PrefixIndex:
    """Per backend key, the chunk keys it is believed to hold, LRU ordered; a reverse map for matching."""

    def __init__(self, max_chunks: int = 500_000, default_backend_chunks: int = 1_000_000 // CHUNK_TOKENS) -> None:
        self.max_chunks = max_chunks
        self.default_backend_chunks = default_backend_chunks
        # chunk key -> backends holding it: a list, as most chunks have one holder (a set costs 216 bytes)
        self._holders: dict[int, list[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}  # backend -> its chunk keys, oldest first
        self._capacity: dict[str, int] = {}  # backend -> chunks it can hold
        self.size = 0  # (backend, chunk) entries
        self.evictions = 0

    def set_capacity(self, key: str, tokens: int) -> None:
        chunks = max(1, tokens // CHUNK_TOKENS)
        if self._capacity.get(key) != chunks:  # every prefill pick says it again: trim only on a change
            self._capacity[key] = chunks
            self._trim(key)

    def match(self, chunks: Sequence[int], keys: Iterable[str]) -> dict[str, int]:
        """How many leading chunks each of ``keys`` holds (absent: none)."""
        alive = {k for k in keys if k in self._lru}
        matched: dict[str, int] = {}
        for i, c in enumerate(chunks):
            holders = self._holders.get(c)
            if not holders:
                break
            alive.intersection_update(holders)
            if not alive:
                break
            for k in alive:
                matched[k] = i + 1
        return matched

    def insert(self, key: str, chunks: Sequence[int]) -> None:
        """``key`` now holds ``chunks`` (a prompt just sent there): most recently used, oldest evicted past its capacity."""
        lru = self._lru.setdefault(key, OrderedDict())
        for c in chunks:
            if c in lru:
                lru.move_to_end(c)
                continue
            lru[c] = None
            self._holders.setdefault(c, []).append(key)
            self.size += 1
        self._trim(key)
        while self.size > self.max_chunks:
            # Over the index's bound: the backend holding the most gives up its oldest.
            self._evict(max(self._lru, key=lambda k: len(self._lru[k])))

    def _trim(self, key: str) -> None:
        lru = self._lru.get(key)
        if lru is None:
            return
        cap = self._capacity.get(key, self.default_backend_chunks)
        while len(lru) > cap:
            self._evict(key)

    def _evict(self, key: str) -> None:
        c, _ = self._lru[key].popitem(last=False)
        holders = self._holders[c]
        holders.remove(key)
        if not holders:
            del self._holders[c]
        self.size -= 1
        self.evictions += 1

    def forget(self, key: str) -> None:
        """The backend left, or its engine restarted with an empty cache."""
        lru = self._lru.pop(key, None)
        if lru is None:
            return
        for c in lru:
            holders = self._holders[c]
            holders.remove(key)
            if not holders:
                del self._holders[c]
        self.size -= len(lru)

    def keep_only(self, keep: set[str]) -> None:
        for key in [k for k in self._lru if k not in keep]:
            self.forget(key)
        for key in [k for k in self._capacity if k not in keep]:
            del self._capacity[key]

    def held(self, key: str) -> int:
        return len(self._lru.get(key, ()))
