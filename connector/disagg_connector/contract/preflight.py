"""The preflight's termination message: what ``disagg-preflight`` writes when a check fails, and what the
operator reads back from the init container's ``terminated.message`` to set the fabric condition.

One line, ``<Reason>: <what to change>``; the reasons are the fixed set below, declared here once (the
operator's vocabulary, ``disagg_operator.api.vocabulary``, takes its fabric reasons from this enum).
"""

from __future__ import annotations

import re
from enum import StrEnum


class PreflightReason(StrEnum):
    """Why a preflight failed: the first word of the termination message, and FabricReady's reason."""

    NIXL_IMPORT_FAILED = "NixlImportFailed"
    NIXL_BACKEND_UNAVAILABLE = "NixlBackendUnavailable"
    EFA_DEVICES_MISSING = "EfaDevicesMissing"
    ACCELERATORS_MISSING = "AcceleratorsMissing"
    HUGEPAGES_MISSING = "HugepagesMissing"
    SHARED_MEMORY_TOO_SMALL = "SharedMemoryTooSmall"


REASONS: tuple[PreflightReason, ...] = tuple(PreflightReason)

_LINE = re.compile(r"^([A-Z][A-Za-z0-9]*): (.*)$")


def format_termination_message(reason: PreflightReason, message: str) -> str:
    if reason not in REASONS:
        raise ValueError(f"unknown preflight reason {reason!r}")
    return f"{PreflightReason(reason).value}: {' '.join(message.split())}"


def parse_termination_message(text: str | None) -> tuple[PreflightReason, str] | None:
    """(reason, message) from a container's termination message, or None if it is not ours."""
    if not text:
        return None
    for line in text.strip().splitlines():
        m = _LINE.match(line.strip())
        if m and m.group(1) in REASONS:
            return PreflightReason(m.group(1)), m.group(2)
        return None  # only the first non-empty line counts
    return None
