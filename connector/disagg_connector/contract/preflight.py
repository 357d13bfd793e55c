"""The preflight's termination message: what ``disagg-preflight`` writes when a check fails, and what the
operator reads back from the init container's ``terminated.message`` to set the fabric condition.

One line, ``<Reason>: <what to change>``; the reasons are the fixed set below (each is also a reason of the
operator's vocabulary, ``disagg_operator.api.vocabulary``, checked by a test).
"""

from __future__ import annotations

import re

REASONS: tuple[str, ...] = (
    "NixlImportFailed",
    "NixlBackendUnavailable",
    "EfaDevicesMissing",
    "AcceleratorsMissing",
    "HugepagesMissing",
    "SharedMemoryTooSmall",
)

_LINE = re.compile(r"^([A-Z][A-Za-z0-9]*): (.*)$")


def format_termination_message(reason: str, message: str) -> str:
    if reason not in REASONS:
        raise ValueError(f"unknown preflight reason {reason!r}")
    return f"{reason}: {' '.join(message.split())}"


def parse_termination_message(text: str | None) -> tuple[str, str] | None:
    """(reason, message) from a container's termination message, or None if it is not ours."""
    if not text:
        return None
    for line in text.strip().splitlines():
        m = _LINE.match(line.strip())
        if m and m.group(1) in REASONS:
            return m.group(1), m.group(2)
        return None  # only the first non-empty line counts
    return None
