"""The P/D router: OpenAI-compatible front door that pairs a prefill and a decode engine per request.

Modules:
- ``config``: the command line (the flags the operator renders) -> :class:`RouterConfig`.
- ``discovery``: Kubernetes watch of P/D pods (or a static file) -> :class:`EndpointTable`.
- ``pairing``: revision choice and least-outstanding selection of backends.
- ``dispatch``: a request's attempts, push (concurrent legs) and pull (sequential legs), and its retries.
- ``legs``: the prefill and decode legs over HTTP, their deadlines and failures (their wire format is
  :mod:`disagg_connector.contract.vllm_pd`); ``relay``: the decode's answer to the client.
- ``outcomes``: what happened, counted once into ``metrics`` (Prometheus) and ``stats`` (``/health``).
- ``server``: the aiohttp application and graceful shutdown; ``metrics``: Prometheus.
"""
