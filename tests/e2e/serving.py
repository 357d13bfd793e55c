"""Simulated engines on a model's pods, its router on the router pod's IP, and a client sending through it.

What the traffic e2e tests (rollout, multi-node, node drain) set up around the model they exercise, and the
teardown they all need whatever the test body raised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

from tests.vllm_sim.pods import LocalRouter, PodEngines, start_pod_router

from .test_router_e2e import BackgroundClient, Result, wait_for


class Serving:
    """On enter: the model's simulated engines start (`listening`: wait until that many (prefill, decode) listen)
    and its router starts; `start_client` adds a background client. On exit: client, router, engines stop."""

    def __init__(self, cluster: Any, namespace: str, model: str, served: str, log_dir: Path,
                 listening: tuple[int, int], timing: dict[str, float] | None = None):  # fmt: skip
        self.cluster, self.namespace, self.model, self.served, self.log_dir = cluster, namespace, model, served, log_dir
        self.listening = listening
        # stop_gone: kwok hands a gone pod's IP to the next pod of its node, whose engine must bind it.
        self.engines = PodEngines(cluster.api_client(), namespace, model, served, log_dir, timing=timing, stop_gone=True)
        self.router: LocalRouter  # started on enter
        self.background: BackgroundClient | None = None

    def __enter__(self) -> Self:
        self.engines.start()
        try:
            prefill, decode = self.listening
            wait_for(f"{prefill}P{decode}D engines listening", lambda: self.engines.serving(prefill, decode), 120)
            self.router = start_pod_router(self.cluster, self.namespace, self.model, self.log_dir)
        except BaseException:
            self.engines.stop()
            raise
        return self

    def start_client(self, workers: int) -> BackgroundClient:
        assert self.background is None
        self.background = BackgroundClient(self.router.url, self.served, workers=workers)
        self.background.start()
        return self.background

    def stop_client(self) -> list[Result]:
        """Every request the client sent (it sends no more)."""
        assert self.background is not None
        results = self.background.stop()
        self.background = None
        return results

    def __exit__(self, *exc: object) -> None:
        try:
            if self.background is not None:
                self.stop_client()
        finally:
            try:
                code = self.router.proc.stop()
                log = self.router.proc.log_text()
                print(f"router exited with {code}; log tail:\n{log[-2000:]}")
                if exc[0] is None:  # a quiet end: its watch closed by stop() is no discovery failure
                    _, _, shutdown = log.partition("shutting down")
                    assert "pod discovery failed" not in shutdown, shutdown[-2000:]
            finally:
                self.engines.stop()
