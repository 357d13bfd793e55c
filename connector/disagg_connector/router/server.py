"""The router's HTTP server (aiohttp on uvloop): OpenAI endpoints, /health, /metrics, graceful shutdown.

- ``POST /v1/completions``, ``POST /v1/chat/completions``: validated here (JSON object, ``model`` present and
  equal to the served model name, ``stream`` boolean), then dispatched (see ``dispatch``). Errors use the
  OpenAI/vLLM shape ``{"error": {"message", "type", "param", "code"}}``.
- ``GET /v1/models``: the served model. ``GET /health``: 200 while serving (body: the pairing table),
  503 while draining. ``GET /metrics``: Prometheus.
- SIGTERM/SIGINT: stop listening, answer 503 to requests on kept-alive connections, let in-flight requests
  (streams included) finish for up to ``--shutdown-grace-seconds``, then cancel what remains (both legs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from typing import Any

from aiohttp import web

from disagg_connector.router.config import RouterConfig
from disagg_connector.router.discovery import EndpointTable, KubernetesDiscovery, StaticDiscovery
from disagg_connector.router.dispatch import Dispatcher, RequestContext, openai_error
from disagg_connector.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from disagg_connector.router.pairing import Balancer

log = logging.getLogger("disagg_router")

STATE: web.AppKey[dict[str, Any]] = web.AppKey("state", dict)
_KINDS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def build_app(cfg: RouterConfig, table: EndpointTable, dispatcher: Dispatcher, metrics: RouterMetrics) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    state: dict[str, Any] = {"draining": False, "started": time.time()}
    app[STATE] = state

    async def generate(request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        if state["draining"]:
            resp = openai_error(503, "the router is shutting down")
            resp.force_close()
            return resp
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return openai_error(400, f"Invalid JSON in request body: {e}")
        if not isinstance(body, dict):
            return openai_error(400, "The request body must be a JSON object")
        model = body.get("model")
        if model is None:
            return openai_error(400, "The 'model' field is required", param="model")
        if not isinstance(model, str):
            return openai_error(400, "The 'model' field must be a string", param="model")
        if model != cfg.served_model_name:
            return openai_error(404, f"The model `{model}` does not exist.", param="model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return openai_error(400, "The 'stream' field must be a boolean", param="stream")
        ctx = RequestContext(
            request=request,
            kind=_KINDS[request.path],
            path=request.path,
            body=body,
            stream=stream,
            t0=t0,
            auth=request.headers.get("Authorization"),
        )
        return await dispatcher.handle(ctx)

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.served_model_name,
                        "object": "model",
                        "created": int(state["started"]),
                        "owned_by": "vllm",
                        "root": cfg.served_model_name,
                        "parent": None,
                        "permission": [],
                    }
                ],
            }
        )

    async def health(request: web.Request) -> web.Response:
        snap = table.snapshot()
        body = {
            "status": "draining" if state["draining"] else "ok",
            "mode": cfg.mode,
            "synced": table.synced,
            "revisions": [
                {"revision": r.revision, "prefill": len(r.prefill), "decode": len(r.decode), "eligible": r.eligible}
                for r in snap.revisions
            ],
        }
        return web.json_response(body, status=503 if state["draining"] else 200)

    async def prom(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    for path in _KINDS:
        app.router.add_post(path, generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prom)
    return app


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None) -> None:
    metrics = RouterMetrics()
    table = EndpointTable()
    table.add_listener(metrics.on_table)
    balancer = Balancer(cfg.revision_policy, cfg.eject_seconds, on_inflight=metrics.on_inflight)
    dispatcher = Dispatcher(cfg, table, balancer, metrics)
    on_error = metrics.discovery_errors.inc
    if cfg.static_endpoints:
        discovery: StaticDiscovery | KubernetesDiscovery = StaticDiscovery(
            cfg.static_endpoints, table, cfg.static_poll_seconds, on_error=on_error
        )
    else:
        assert cfg.namespace and cfg.selector
        discovery = KubernetesDiscovery(
            cfg.namespace, cfg.selector, table, cfg.kubeconfig, on_error=on_error, on_event=metrics.discovery_events.inc
        )
    await dispatcher.start()
    await discovery.start()
    app = build_app(cfg, table, dispatcher, metrics)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=cfg.shutdown_grace, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024, reuse_address=True)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "disagg-router listening on %s:%d (model %s, mode %s, discovery %s)",
        cfg.host,
        cfg.port,
        cfg.served_model_name,
        cfg.mode,
        f"static file {cfg.static_endpoints}" if cfg.static_endpoints else f"pods {cfg.selector!r} in {cfg.namespace}",
    )
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("shutting down: draining in-flight requests for up to %gs", cfg.shutdown_grace)
    app[STATE]["draining"] = True
    await runner.cleanup()  # closes the listener, waits for handlers up to shutdown_timeout, then cancels
    await discovery.stop()
    await dispatcher.close()
    log.info("stopped")
