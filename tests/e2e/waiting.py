"""Small helpers the e2e tests share: bounded waits, readiness of API objects and watches over pods."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Generic, Self, TypeVar

import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from disagg_connector import contract

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


def engine_pods(model: str) -> str:
    """The label selector of a model's prefill and decode pods."""
    return f"{contract.LABEL_MODEL}={contract.model_label_value(model)},{contract.LABEL_ROLE} in (prefill,decode)"


class PodWatch:
    """Lists the pods a label selector picks, then watches them on a thread of its own until `stop()`.

    Subclasses take the listed pods in `listed` and every watch event in `changed`, each with the monotonic
    time it was read. Usable as a context manager that stops it on exit.
    """

    def __init__(self, api_client: Any, namespace: str, selector: str):
        self._core = client.CoreV1Api(api_client)
        self._watch = watch.Watch()
        self._stopped = False
        # Listed before the constructor returns and watched from that list's resourceVersion: no pod event
        # after construction is missed, however late the thread starts.
        listed = self._core.list_namespaced_pod(namespace, label_selector=selector)
        self.listed(listed.items, time.monotonic())
        self._thread = threading.Thread(
            target=self._run, args=(namespace, selector, listed.metadata.resource_version), daemon=True
        )
        self._thread.start()

    def listed(self, pods: list[Any], now: float) -> None:
        """The pods there when the watch began."""

    def changed(self, kind: str, pod: Any, now: float) -> None:
        """One watch event: kind is ADDED, MODIFIED or DELETED."""
        raise NotImplementedError

    def _run(self, namespace: str, selector: str, version: str) -> None:
        try:
            for event in self._watch.stream(self._core.list_namespaced_pod, namespace, label_selector=selector,
                                            resource_version=version, timeout_seconds=600):  # fmt: skip
                self.changed(event["type"], event["object"], time.monotonic())
        except urllib3.exceptions.ProtocolError:
            if not self._stopped:  # stop() shuts the socket under the read: that is no failure
                raise

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()
        self._thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


Facts = TypeVar("Facts")


class PodStates(PodWatch, Generic[Facts]):
    """After every pod event: pod name -> `facts(pod)` of the pods there, terminating pods left out (as a
    Deployment's surge leaves them out); and when each pod was first seen terminating or gone."""

    def __init__(self, api_client: Any, namespace: str, selector: str, facts: Callable[[Any], Facts]):
        self.states: list[tuple[float, dict[str, Facts]]] = []  # (monotonic time, pods then)
        self.deleted: dict[str, float] = {}  # pod name -> monotonic time its deletion was seen
        self._facts = facts
        self._pods: dict[str, Facts] = {}
        super().__init__(api_client, namespace, selector)

    def listed(self, pods: list[Any], now: float) -> None:
        self._pods = {p.metadata.name: self._facts(p) for p in pods if not p.metadata.deletion_timestamp}
        self.states.append((now, dict(self._pods)))

    def changed(self, kind: str, pod: Any, now: float) -> None:
        name = pod.metadata.name
        if kind == "DELETED" or pod.metadata.deletion_timestamp:  # a terminating pod holds no room
            self.deleted.setdefault(name, now)
            self._pods.pop(name, None)
        else:
            self._pods[name] = self._facts(pod)
        self.states.append((now, dict(self._pods)))
