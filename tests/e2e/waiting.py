"""Small helpers the e2e tests share: bounded waits and readiness of API objects."""

from __future__ import annotations

import time
from typing import Any, Callable

from kubernetes.client.exceptions import ApiException

DEADLINE = 120.0


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float = DEADLINE,
    interval: float = 0.3,
    retry_on: tuple[type[BaseException], ...] = (ApiException,),
) -> Any:
    """Poll `check` until it returns something truthy (`retry_on` errors count as "not yet")."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except retry_on as error:
            last = error
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    """A condition of a DisaggregatedModel dict, or {}."""
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def pod_ready(pod: Any) -> bool:
    """A V1Pod that is Ready and not terminating."""
    return pod.metadata.deletion_timestamp is None and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []
    )
