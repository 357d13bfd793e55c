"""Kubernetes quantities ("64Gi", "500m", 8), parsed by the kubernetes library's own parser.

The one place the pure layers (api, render, drift) touch the `kubernetes` package: the import-linter
contracts forbid it everywhere else in them, so no API client can creep into pure code.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import format_quantity as _format, parse_quantity as _parse


def parse_quantity(value: Any) -> Decimal:
    """The quantity's value as a Decimal; ValueError when it is not a quantity."""
    return Decimal(_parse(value))


_BINARY = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


def format_bytes(value: int) -> str:
    """Bytes as the largest binary suffix that holds them whole ("1200Gi"), else plain bytes."""
    for suffix, unit in _BINARY:
        if value and value % unit == 0:
            return _format(Decimal(value), suffix)
    return str(value)
