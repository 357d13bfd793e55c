"""Kubernetes quantities ("64Gi", "500m", 8), parsed by the kubernetes library's own parser.

The one place the pure layers (api, render, drift) touch the `kubernetes` package: the import-linter
contracts forbid it everywhere else in them, so no API client can creep into pure code.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity as _parse


def parse_quantity(value: Any) -> Decimal:
    """The quantity's value as a Decimal; ValueError when it is not a quantity."""
    return Decimal(_parse(value))
