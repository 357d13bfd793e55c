"""Does a live child still match what we would apply? Pure, so the answer is testable.

Every child carries a hash of the manifest we applied. A changed hash means our desired state moved
(apply, and server-side apply drops fields we stopped sending). An equal hash still gets a field-by-field
check, so a hand edit of a field we own (kubectl edit, scale) is put back. Equal on both counts means
no request at all: in steady state the operator writes nothing.
"""

from __future__ import annotations

import json
from typing import Any

from disagg_connector import contract

from .quantity import parse_quantity

HASH_ANNOTATION = f"{contract.API_GROUP}/applied-hash"


def manifest_hash(obj: dict[str, Any]) -> str:
    return contract.short_hash(json.dumps(obj, sort_keys=True), 16)


def stamped(obj: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its own hash as an annotation (computed before the annotation is added)."""
    digest = manifest_hash(obj)
    meta = dict(obj["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), HASH_ANNOTATION: digest}
    return {**obj, "metadata": meta}


def _empty(value: Any) -> bool:
    # The API server omits empty and false values (omitempty), so "absent" equals them.
    return value in (None, "", [], {}, False, 0)


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have:
        return True
    if isinstance(want, str) and isinstance(have, (str, int)):
        # Quantities come back normalised ("1.5Gi" -> "1536Mi", "8" -> 8 in int-or-string fields).
        try:
            return parse_quantity(want) == parse_quantity(str(have))
        except ValueError:
            return False
    if isinstance(want, int) and isinstance(have, str):
        return str(want) == have
    return False


def contains(want: Any, have: Any) -> bool:
    """Every field of `want` is in `have` with an equal value (extra fields in `have` are defaults or
    other managers' fields and are ignored; lists must match element by element)."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return _empty(want) and _empty(have)
        return all(contains(v, have.get(k)) if k in have else _empty(v) for k, v in want.items())
    if isinstance(want, list):
        if not isinstance(have, list):
            return _empty(want) and _empty(have)
        return len(want) == len(have) and all(contains(w, h) for w, h in zip(want, have))
    return _same_scalar(want, have)


def needs_apply(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    if live is None:
        return True
    live_hash = (live.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION)
    if live_hash != desired["metadata"]["annotations"][HASH_ANNOTATION]:
        return True
    return not contains(desired, live)
