"""vLLM's prefix-cache block hashes, computed outside vLLM, pure (no I/O): what a vLLM engine names the
KV blocks of a prompt, so the router can ask its KV-event index which engine already holds a request's
leading blocks, and the simulator can publish the hashes a real engine would.

vLLM (0.26.0 and 0.33.0 alike, ``vllm/v1/core/kv_cache_utils.py``) chains one hash per *full* block of
``block_size`` tokens; a partial last block gets none::

    NONE_HASH = H(seed)                                   # init_none_hash
    h[0]      = H((NONE_HASH, tuple(block_0_tokens), None))
    h[i]      = H((h[i-1],    tuple(block_i_tokens), None))   # hash_block_tokens, extra_keys None

``H`` is ``--prefix-caching-hash-algo``: ``sha256_cbor`` = SHA-256 of ``cbor2.dumps(x, canonical=True)``,
``sha256`` = SHA-256 of ``pickle.dumps(x, protocol=HIGHEST_PROTOCOL)`` (``vllm/utils/hashing.py``). The
seed is ``PYTHONHASHSEED`` as a string; where it is unset, 0.33.0 uses ``"vllm-none-hash"`` for the
SHA-256 algorithms (``DEFAULT_NONE_HASH_SEED``) and 0.26.0 draws random bytes, so a 0.26.0 engine's
hashes are reproducible only with ``PYTHONHASHSEED`` set.

Only plain requests are covered: no LoRA adapter, no multimodal input, no ``cache_salt``, no prompt
embeddings, no speculative lookahead hashing (all of which make vLLM's ``extra_keys`` non-None), and one
KV-cache group (a hybrid model hashes at the groups' gcd, ``hash_block_size``). The xxhash algorithms are
not covered (their seed is random per process unless ``PYTHONHASHSEED`` is set, and xxhash is not
standard library).

What ``BlockStored``/``BlockRemoved`` events carry is not the 32-byte hash: ``maybe_convert_block_hash``
turns it into ``int.from_bytes(h, "big") & (2**64 - 1)`` (the last 8 bytes as an unsigned integer) while
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on, its default in both releases, and leaves the bytes as they
are when it is set to 0. ``external_hash`` mirrors that; ``hash_key`` folds either form to the same int,
so an index keyed by ``hash_key`` matches an engine whatever that setting is.

The canonical CBOR of the few types hashed here (bytes, str, ints, tuples, None) is written by hand, so
the contract imports no third-party library (the operator imports it too); where cbor2 is installed (the
router's extra pins it) its C encoder does the per-block work instead, about 5x faster (a 16k-token prompt
in 128-token blocks: ~1.7 ms against ~10 ms). The tests check the two byte for byte against each other and
the hashes against vLLM's own functions.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

try:  # optional: only the speed of the per-block encoding depends on it
    import cbor2 as _cbor2
except ImportError:  # pragma: no cover - the operator's install has no cbor2
    _cbor2 = None

HashAlgo = Literal["sha256_cbor", "sha256"]
HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256_cbor", "sha256")
# vLLM 0.33.0's NONE_HASH seed for the SHA-256 algorithms when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_INT64_MASK = (1 << 64) - 1

# --- canonical CBOR (RFC 8949 4.2.1: shortest heads), for bytes/str/int/tuple/None only --------------
_UINT8 = struct.Struct(">B")
_UINT16 = struct.Struct(">H")
_UINT32 = struct.Struct(">I")
_UINT64 = struct.Struct(">Q")
_CBOR_NULL = b"\xf6"


def _cbor_head(major: int, value: int) -> bytes:
    """A data item's head: major type and argument, in the shortest form (what canonical CBOR asks)."""
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value < 0x100:
        return bytes((mt | 24,)) + _UINT8.pack(value)
    if value < 0x10000:
        return bytes((mt | 25,)) + _UINT16.pack(value)
    if value < 0x100000000:
        return bytes((mt | 26,)) + _UINT32.pack(value)
    if value <= _INT64_MASK:
        return bytes((mt | 27,)) + _UINT64.pack(value)
    raise ValueError(f"integer {value} needs a CBOR bignum, which vLLM's token ids never do")


def _cbor_int(value: int) -> bytes:
    return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)


def canonical_cbor(obj: object) -> bytes:
    """``cbor2.dumps(obj, canonical=True)`` for bytes, str, int, tuple/list and None (nothing else)."""
    if obj is None:
        return _CBOR_NULL
    if isinstance(obj, bool):  # a bool is an int to Python, a simple value to CBOR: not hashed by vLLM here
        raise TypeError("bool is not among the types hashed for plain requests")
    if isinstance(obj, int):
        return _cbor_int(obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(map(canonical_cbor, obj))
    raise TypeError(f"{type(obj).__name__} is not among the types hashed for plain requests")


def _cbor_block_stdlib(parent: bytes, tokens: Sequence[int]) -> bytes:
    """canonical_cbor((parent, tuple(tokens), None)) without the generic dispatch."""
    return b"".join(
        (b"\x83", _cbor_head(2, len(parent)), parent, _cbor_head(4, len(tokens)), *map(_cbor_int, tokens), _CBOR_NULL)
    )


def _cbor_block_cbor2(parent: bytes, tokens: Sequence[int]) -> bytes:
    return _cbor2.dumps((parent, tuple(tokens), None), canonical=True)  # type: ignore[union-attr]


# The hot path: one call per block of every prompt the router scores.
_cbor_block: Callable[[bytes, Sequence[int]], bytes] = _cbor_block_stdlib if _cbor2 is None else _cbor_block_cbor2


# --- vLLM's hash functions -----------------------------------------------------------------------------
def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(canonical_cbor(obj)).digest()


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str, algo: HashAlgo = "sha256_cbor") -> bytes:
    """vLLM's NONE_HASH, the parent of every prompt's first block: ``H(seed)``."""
    if algo == "sha256_cbor":
        return _sha256_cbor(seed)
    if algo == "sha256":
        return _sha256_pickle(seed)
    raise ValueError(f"unsupported prefix-caching hash algorithm {algo!r}; supported: {', '.join(HASH_ALGOS)}")


def iter_block_hashes(
    token_ids: Sequence[int], block_size: int, seed: str, algo: HashAlgo = "sha256_cbor"
) -> Iterator[bytes]:
    """``block_hashes`` one block at a time, so a caller matching a prefix can stop at its first miss
    without hashing the rest of the prompt."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = none_hash(seed, algo)
    sha256 = hashlib.sha256
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        if algo == "sha256_cbor":
            parent = sha256(_cbor_block(parent, block)).digest()
        else:
            parent = _sha256_pickle((parent, tuple(block), None))
        yield parent


def block_hashes(token_ids: Sequence[int], block_size: int, seed: str, algo: HashAlgo = "sha256_cbor") -> list[bytes]:
    """The 32-byte hashes vLLM gives the full blocks of a plain request's ``token_ids`` (see the module
    docstring), first block first; a partial last block has none. ``seed`` is the engine's PYTHONHASHSEED
    (or ``DEFAULT_NONE_HASH_SEED`` for a 0.33.0 engine without one)."""
    return list(iter_block_hashes(token_ids, block_size, seed, algo))


def external_hash(block_hash: bytes, int_hashes: bool = True) -> int | bytes:
    """What a vLLM KV event carries for ``block_hash`` (``maybe_convert_block_hash``): its low 64 bits as
    an unsigned int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` on (the default), else the bytes."""
    return int.from_bytes(block_hash, "big") & _INT64_MASK if int_hashes else block_hash


def hash_key(event_hash: int | bytes) -> int:
    """One int for a block whichever form an event carried it in (``external_hash``'s int, or the bytes),
    and for a hash computed here: an index keyed by it compares like with like."""
    if isinstance(event_hash, int):
        return event_hash & _INT64_MASK
    return int.from_bytes(event_hash[-8:], "big")


def iter_block_hash_keys(
    token_ids: Sequence[int], block_size: int, seed: str, algo: HashAlgo = "sha256_cbor"
) -> Iterator[int]:
    """``hash_key`` of each block hash, lazily: what the router looks a request up by, hashing no further
    than the index reads (``KvIndex.hits_by_backend`` stops where no backend holds the prefix)."""
    return (int.from_bytes(h[-8:], "big") for h in iter_block_hashes(token_ids, block_size, seed, algo))


def block_hash_keys(token_ids: Sequence[int], block_size: int, seed: str, algo: HashAlgo = "sha256_cbor") -> list[int]:
    """``hash_key`` of each of ``block_hashes(...)``."""
    return list(iter_block_hash_keys(token_ids, block_size, seed, algo))
