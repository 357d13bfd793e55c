"""The router's command line. The operator renders the contract flags; the rest are optional.

Contract flags the operator renders (keep their names): ``--served-model-name``, ``--namespace``,
``--selector``, ``--port``, ``--leg-timeout-seconds``, ``--kv-lease-seconds``, ``--max-retries``,
``--shutdown-grace-seconds``, ``--disaggregation-threshold-tokens``, ``--prefill-policy``, ``--decode-policy``. ``--static-endpoints`` and ``--mode``
are for a router without discovery (`disagg-localrun`, benchmarks): the operator renders neither, since every
engine pod carries its revision's transfer mode.

Every default is written once, in :class:`RouterConfig`; the parser reads it from there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from disagg_connector import contract
from disagg_connector.contract.health import TransferMode

_SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# vLLM's default kv_lease_duration (kv_connector_extra_config), in seconds.
VLLM_DEFAULT_LEASE_SECONDS = 30.0


def default_leg_timeout(lease_seconds: float) -> float:
    """Two thirds of the lease (vLLM extends a lease by the same fraction per heartbeat): a request the
    router gives up on at its deadline is cancelled while prefill still holds its blocks."""
    return lease_seconds * 2 / 3


MODES = ("push", "pull")
# How each role's engine is picked within a revision (docs/router.md, "Policies"; spec.router.prefillPolicy and
# decodePolicy render them). least-outstanding is the router's own in-flight count alone, ties round robin.
PREFILL_POLICIES = ("prefix-and-load", "least-outstanding")
DECODE_POLICIES = ("least-loaded", "least-outstanding")


@dataclass(frozen=True)
class RouterConfig:
    served_model_name: str
    mode: str = "push"  # one of MODES: the protocol of pods without a transfer-mode annotation
    namespace: str | None = None
    selector: str | None = None
    model_name: str | None = None  # the DisaggregatedModel the router serves: its Events go there
    static_endpoints: str | None = None
    kubeconfig: str | None = None
    host: str = "0.0.0.0"
    port: int = contract.ROUTER_PORT
    kv_lease_seconds: float = VLLM_DEFAULT_LEASE_SECONDS
    leg_timeout: float = default_leg_timeout(VLLM_DEFAULT_LEASE_SECONDS)
    request_timeout: float = 600.0
    max_retries: int = 1
    max_migrations: int = 2  # continuations of one stream whose decode failed mid-stream; 0: off
    migration_wait: float = 120.0  # how long such a stream waits for a pair when none takes it at once
    shutdown_grace: float = 30.0
    disaggregation_threshold_tokens: int = 0
    probe_interval: float = 5.0
    connect_timeout: float = 5.0
    static_poll_seconds: float = 0.5
    prefill_policy: str = "prefix-and-load"  # one of PREFILL_POLICIES
    decode_policy: str = "least-loaded"  # one of DECODE_POLICIES
    load_scrape_interval: float = 1.0
    prefix_index_tokens: int = 0  # 0: per backend, its KV cache size as vLLM reports it (vllm:cache_config_info)
    log_level: str = "INFO"

    @property
    def default_mode(self) -> TransferMode:
        return "Pull" if self.mode == "pull" else "Push"


def _default(name: str) -> Any:
    return {f.name: f.default for f in dataclasses.fields(RouterConfig)}[name]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagg-router",
        description="OpenAI-compatible router for prefill/decode disaggregated vLLM (NIXL push or pull).",
    )
    p.add_argument("--served-model-name", required=True, help="the only model name this router accepts")
    p.add_argument(
        "--mode",
        choices=MODES,
        default=_default("mode"),
        help="protocol for engine pods without a disagg.dev/transfer-mode annotation (each revision follows "
        "its pods' annotation): push sends both legs concurrently (NixlPushConnector), pull prefill then "
        "decode (NixlConnector)",
    )
    p.add_argument("--namespace", help="namespace of the P/D pods (default: the pod's own namespace)")
    p.add_argument("--selector", help="label selector of this model's P and D pods, e.g. disagg.dev/model=NAME")
    p.add_argument(
        "--model-name", help="the DisaggregatedModel in --namespace this router serves: it records Events on it when "
        "a decode engine fails mid-stream (what became of the streams); none without it or with --static-endpoints",
    )  # fmt: skip
    p.add_argument(
        "--static-endpoints",
        metavar="FILE",
        help="read backends from a YAML/JSON file (re-read when it changes) instead of the Kubernetes API",
    )
    p.add_argument("--kubeconfig", help="kubeconfig to use when not running in a pod (default: $KUBECONFIG)")
    p.add_argument("--host", default=_default("host"), help="listen address")
    p.add_argument("--port", type=int, default=_default("port"))
    p.add_argument(
        "--kv-lease-seconds",
        type=float,
        default=_default("kv_lease_seconds"),
        help="the engines' kv_lease_duration (how long prefill holds finished KV blocks; vLLM's default is 30)",
    )
    p.add_argument(
        "--leg-timeout-seconds",
        type=float,
        help="deadline of each leg until its first byte (whole prefill leg; decode leg until its first "
        "streamed chunk, i.e. the wait for the KV, then the longest gap between chunks); must stay below "
        "--kv-lease-seconds (default: two thirds of it)",
    )
    p.add_argument(
        "--request-timeout-seconds",
        type=float,
        default=_default("request_timeout"),
        help="deadline of a non-streaming decode leg (its first byte is its last)",
    )
    p.add_argument("--max-retries", type=int, default=_default("max_retries"), help="retries on another pair with fresh ids")
    p.add_argument(
        "--max-migrations", type=int, default=_default("max_migrations"),
        help="times one stream is continued on another pair when its decode fails after the first token "
        "(docs/router.md, Failures and stream migration); 0 turns migration off",
    )  # fmt: skip
    p.add_argument(
        "--migration-wait-seconds", type=float, default=_default("migration_wait"),
        help="how long a stream whose decode failed waits in the router for a pair to continue on when none takes "
        "it at once (every decode gone: a restarting engine, a recreated group); 0: it ends at once",
    )  # fmt: skip
    p.add_argument("--shutdown-grace-seconds", type=float, default=_default("shutdown_grace"))
    p.add_argument(
        "--disaggregation-threshold-tokens",
        type=int,
        default=_default("disaggregation_threshold_tokens"),
        help="prompts shorter than this many tokens (estimated from their length, 4 bytes per token as "
        "llm-d does; exact for token-id prompts) go to a decode engine alone, which prefills them itself; "
        "0 disaggregates every request",
    )
    p.add_argument(
        "--probe-interval-seconds",
        type=float,
        default=_default("probe_interval"),
        help="GET /health of every backend this often; a failed probe ejects it until a probe succeeds (0: off)",
    )
    p.add_argument(
        "--prefill-policy",
        choices=PREFILL_POLICIES,
        default=_default("prefill_policy"),
        help="prefix-and-load: the prefill engine whose prefix cache most likely holds the prompt's start, weighed "
        "against its queue (vLLM's running and waiting requests, plus this router's legs in flight sent since it last read them); "
        "least-outstanding: fewest legs in flight from this router",
    )
    p.add_argument(
        "--decode-policy",
        choices=DECODE_POLICIES,
        default=_default("decode_policy"),
        help="least-loaded: fewest requests running and waiting per vLLM's /metrics plus this router's legs in flight sent since "
        "it last read them; least-outstanding: fewest legs in flight from this router",
    )
    p.add_argument(
        "--load-scrape-interval-seconds",
        type=float,
        default=_default("load_scrape_interval"),
        help="read every engine's /metrics this often for its load and prefix-cache counters (0: never; the "
        "policies then use this router's own in-flight counts)",
    )
    p.add_argument(
        "--prefix-index-tokens",
        type=int,
        default=_default("prefix_index_tokens"),
        help="tokens of prompt prefix remembered per prefill engine (0: its KV cache size from vllm:cache_config_info, "
        "or 1M tokens until it is known)",
    )
    p.add_argument("--log-level", default=os.environ.get("DISAGG_ROUTER_LOG_LEVEL", _default("log_level")))
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
    if a.kv_lease_seconds <= 0:
        parser.error("--kv-lease-seconds must be positive")
    leg_timeout = a.leg_timeout_seconds if a.leg_timeout_seconds is not None else default_leg_timeout(a.kv_lease_seconds)
    if leg_timeout <= 0 or a.request_timeout_seconds <= 0:
        parser.error("timeouts must be positive")
    if leg_timeout >= a.kv_lease_seconds:
        parser.error(
            f"--leg-timeout-seconds {leg_timeout:g} must be below --kv-lease-seconds {a.kv_lease_seconds:g}: "
            "prefill frees a request's KV blocks when its lease ends, and a decode still waiting then gets "
            "nothing (push) or reads freed blocks (pull). Lower the timeout or raise the engines' kv_lease_duration."
        )
    if a.max_retries < 0:
        parser.error("--max-retries must be >= 0")
    if a.max_migrations < 0:
        parser.error("--max-migrations must be >= 0 (0 turns stream migration off)")
    if a.migration_wait_seconds < 0:
        parser.error("--migration-wait-seconds must be >= 0")
    if a.disaggregation_threshold_tokens < 0:
        parser.error("--disaggregation-threshold-tokens must be >= 0")
    if a.probe_interval_seconds < 0:
        parser.error("--probe-interval-seconds must be >= 0")
    if a.load_scrape_interval_seconds < 0:
        parser.error("--load-scrape-interval-seconds must be >= 0")
    if a.prefix_index_tokens < 0:
        parser.error("--prefix-index-tokens must be >= 0")
    return RouterConfig(
        served_model_name=a.served_model_name,
        mode=a.mode,
        namespace=namespace,
        selector=a.selector,
        model_name=a.model_name,
        static_endpoints=a.static_endpoints,
        kubeconfig=a.kubeconfig,
        host=a.host,
        port=a.port,
        kv_lease_seconds=a.kv_lease_seconds,
        leg_timeout=leg_timeout,
        request_timeout=max(a.request_timeout_seconds, leg_timeout),
        max_retries=a.max_retries,
        max_migrations=a.max_migrations,
        migration_wait=a.migration_wait_seconds,
        shutdown_grace=a.shutdown_grace_seconds,
        disaggregation_threshold_tokens=a.disaggregation_threshold_tokens,
        probe_interval=a.probe_interval_seconds,
        prefill_policy=a.prefill_policy,
        decode_policy=a.decode_policy,
        load_scrape_interval=a.load_scrape_interval_seconds,
        prefix_index_tokens=a.prefix_index_tokens,
        log_level=a.log_level,
    )
