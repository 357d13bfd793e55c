"""The P/D router: OpenAI-compatible front door that pairs a prefill and a decode engine per request.

Modules:
- ``config``: the command line (the flags the operator renders) -> :class:`RouterConfig`.
- ``discovery``: Kubernetes watch of P/D pods (or a static file) -> :class:`EndpointTable`.
- ``pairing``: revision choice and least-outstanding selection of backends.
- ``dispatch``: push (concurrent legs) and pull (sequential legs), deadlines, retries, cancellation.
- ``server``: the aiohttp application and graceful shutdown; ``metrics``: Prometheus.
"""
