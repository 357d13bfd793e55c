"""The router's command line. The operator renders exactly the flags of the contract; the rest are optional.

Contract flags (keep their names): ``--served-model-name``, ``--mode {push,pull}``, ``--namespace``,
``--selector``, ``--static-endpoints``, ``--port``, ``--leg-timeout-seconds``, ``--max-retries``,
``--shutdown-grace-seconds``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from disagg_connector import contract

MODES = ("push", "pull", "push-sequential")
REVISION_POLICIES = ("newest", "spread")
_SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class RouterConfig:
    served_model_name: str
    mode: str = "push"
    namespace: str | None = None
    selector: str | None = None
    static_endpoints: str | None = None
    kubeconfig: str | None = None
    host: str = "0.0.0.0"
    port: int = contract.ROUTER_PORT
    leg_timeout: float = 30.0
    request_timeout: float = 600.0
    max_retries: int = 1
    shutdown_grace: float = 30.0
    revision_policy: str = "newest"
    eject_seconds: float = 5.0
    connect_timeout: float = 5.0
    static_poll_seconds: float = 0.5
    log_level: str = "INFO"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagg-router",
        description="OpenAI-compatible router for prefill/decode disaggregated vLLM (NIXL push or pull).",
    )
    p.add_argument("--served-model-name", required=True, help="the only model name this router accepts")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="push",
        help="push: both legs concurrently (NixlPushConnector); pull: prefill then decode (NixlConnector); "
        "push-sequential: push engines dispatched one leg after the other (for benchmarks only)",
    )
    p.add_argument("--namespace", help="namespace of the P/D pods (default: the pod's own namespace)")
    p.add_argument("--selector", help="label selector of this model's P and D pods, e.g. disagg.dev/model=NAME")
    p.add_argument(
        "--static-endpoints",
        metavar="FILE",
        help="read backends from a YAML/JSON file (re-read when it changes) instead of the Kubernetes API",
    )
    p.add_argument("--kubeconfig", help="kubeconfig to use when not running in a pod (default: $KUBECONFIG)")
    p.add_argument("--host", default="0.0.0.0", help="listen address")
    p.add_argument("--port", type=int, default=contract.ROUTER_PORT)
    p.add_argument(
        "--leg-timeout-seconds",
        type=float,
        default=30.0,
        help="deadline of each leg until its first byte (whole prefill leg; decode leg until its first "
        "streamed chunk, then the longest gap between chunks); must stay below the KV lease",
    )
    p.add_argument(
        "--request-timeout-seconds",
        type=float,
        default=600.0,
        help="deadline of a non-streaming decode leg (its first byte is its last)",
    )
    p.add_argument("--max-retries", type=int, default=1, help="retries on another pair with a fresh id")
    p.add_argument("--shutdown-grace-seconds", type=float, default=30.0)
    p.add_argument(
        "--revision-policy",
        choices=REVISION_POLICIES,
        default="newest",
        help="newest: all traffic to the newest revision that has ready P and D; "
        "spread: least-outstanding over every eligible revision (pairs still within one revision)",
    )
    p.add_argument("--eject-seconds", type=float, default=5.0, help="avoid a backend this long after a connection error")
    p.add_argument("--log-level", default=os.environ.get("DISAGG_ROUTER_LOG_LEVEL", "INFO"))
    return p


def _default_namespace() -> str | None:
    try:
        return _SA_NAMESPACE_FILE.read_text().strip() or None
    except OSError:
        return None


def parse_args(argv: Sequence[str] | None = None) -> RouterConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    namespace = a.namespace
    if not a.static_endpoints:
        namespace = namespace or _default_namespace()
        if not namespace:
            parser.error("--namespace is required unless --static-endpoints is given (or running in a pod)")
        if not a.selector:
            parser.error("--selector is required unless --static-endpoints is given")
    if a.leg_timeout_seconds <= 0 or a.request_timeout_seconds <= 0:
        parser.error("timeouts must be positive")
    if a.max_retries < 0:
        parser.error("--max-retries must be >= 0")
    return RouterConfig(
        served_model_name=a.served_model_name,
        mode=a.mode,
        namespace=namespace,
        selector=a.selector,
        static_endpoints=a.static_endpoints,
        kubeconfig=a.kubeconfig,
        host=a.host,
        port=a.port,
        leg_timeout=a.leg_timeout_seconds,
        request_timeout=max(a.request_timeout_seconds, a.leg_timeout_seconds),
        max_retries=a.max_retries,
        shutdown_grace=a.shutdown_grace_seconds,
        revision_policy=a.revision_policy,
        eject_seconds=a.eject_seconds,
        log_level=a.log_level,
    )
