"""Wire format of the small messages that ride on NIXL notifications and on the side channel.

A notification is ``b"KVX1" + kind (1 byte) + codec (b"M" msgpack | b"J" JSON) + payload``.
Kinds:
  ``R`` registration (decode rank -> prefill rank, push): where to write a request's KV;
  ``D`` done        (prefill rank -> decode rank, push): carried by the last WRITE of a request,
                    NIXL delivers it after the data has landed;
  ``F`` failed      (prefill rank -> decode rank): the push will not happen, with a reason;
  ``C`` cancel      (decode rank -> prefill rank): drop a registration (aborted request);
  ``A`` read done   (decode rank -> prefill rank, pull): carried by the READ, frees the prefill blocks.
Anything that does not start with the magic is ignored (a peer speaking another protocol).
"""

from __future__ import annotations

import json
from typing import Any

try:  # msgpack is optional: JSON is the fallback, the receiver accepts both.
    import msgpack  # type: ignore

    _HAVE_MSGPACK = True
except Exception:  # pragma: no cover - depends on the environment
    msgpack = None
    _HAVE_MSGPACK = False

MAGIC = b"KVX1"
REGISTER = b"R"
DONE = b"D"
FAILED = b"F"
CANCEL = b"C"
READ_DONE = b"A"
KINDS = (REGISTER, DONE, FAILED, CANCEL, READ_DONE)


def encode(kind: bytes, payload: dict[str, Any], codec: str | None = None) -> bytes:
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}")
    use_msgpack = _HAVE_MSGPACK if codec is None else codec == "msgpack"
    if use_msgpack:
        return MAGIC + kind + b"M" + msgpack.packb(payload, use_bin_type=True)
    return MAGIC + kind + b"J" + json.dumps(payload, separators=(",", ":")).encode()


def decode(msg: bytes) -> tuple[bytes, dict[str, Any]] | None:
    """(kind, payload) or None for anything that is not one of ours or is malformed."""
    if not isinstance(msg, (bytes, bytearray)) or len(msg) < 6 or bytes(msg[:4]) != MAGIC:
        return None
    kind, codec, body = bytes(msg[4:5]), bytes(msg[5:6]), bytes(msg[6:])
    if kind not in KINDS:
        return None
    try:
        if codec == b"M" and _HAVE_MSGPACK:
            payload = msgpack.unpackb(body, raw=False)
        elif codec == b"J":
            payload = json.loads(body)
        else:
            return None
    except Exception:
        return None
    return (kind, payload) if isinstance(payload, dict) else None


def pack_obj(obj: dict[str, Any]) -> bytes:
    """Side-channel blob (peer info, pull parameters): msgpack when present, else JSON."""
    if _HAVE_MSGPACK:
        return b"M" + msgpack.packb(obj, use_bin_type=True)
    return b"J" + json.dumps(obj).encode()


def unpack_obj(blob: bytes) -> dict[str, Any]:
    if blob[:1] == b"M":
        if not _HAVE_MSGPACK:
            raise ValueError("peer sent msgpack but msgpack is not installed")
        return msgpack.unpackb(blob[1:], raw=False)
    if blob[:1] == b"J":
        return json.loads(blob[1:])
    raise ValueError("not a kvxfer side-channel blob")
