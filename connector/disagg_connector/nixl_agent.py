"""A NIXL agent with exactly one backend, or an error that says why not.

The preflight init container uses it to prove the pod's NIXL build can instantiate the backend its
spec asks for; the KV transfer benchmark (``bench/disagg_bench/kvxfer``) builds its agents with it.
"""

from __future__ import annotations

from typing import Any

BACKENDS = ("UCX", "LIBFABRIC")


class NixlUnavailable(RuntimeError):
    """The nixl package cannot be imported."""


class BackendUnavailable(RuntimeError):
    """The requested NIXL backend (UCX, LIBFABRIC) is missing or fails to instantiate."""

    def __init__(self, backend: str, detail: str, plugins: list[str] | None = None) -> None:
        self.backend = backend
        self.detail = detail
        self.plugins = plugins or []
        super().__init__(f"NIXL backend {backend} unavailable: {detail}")


def import_nixl() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401
        import nixl._api as api
    except Exception as e:  # ImportError, or a broken native library (OSError)
        raise NixlUnavailable(f"{type(e).__name__}: {e}") from e
    return api


def make_agent(name: str, backend: str, num_threads: int = 0, progress_thread: bool = False) -> Any:
    """A nixl_agent with exactly ``backend`` instantiated, or BackendUnavailable saying why.

    ``progress_thread=False`` by default: nixl's progress thread polls with no delay (the Python
    API hard-codes ``pthrDelay=0``), i.e. one core spinning per agent. Our engine threads call
    ``get_new_notifs``/``check_xfer_state`` often enough to drive progress themselves.
    """
    api = import_nixl()
    # backends=[] and an explicit create_backend: nixl_agent() itself only *warns* and skips a
    # backend whose plugin is missing, which would hide the failure.
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[], num_threads=0))
    plugins = list(agent.get_plugin_list())
    if backend not in plugins:
        raise BackendUnavailable(backend, f"no {backend} plugin in this nixl build (plugins: {', '.join(plugins)})", plugins)
    params: dict[str, str] = {}
    if num_threads > 0:
        params["num_threads"] = str(num_threads)
    try:
        agent.create_backend(backend, params)
    except Exception as e:
        raise BackendUnavailable(backend, f"{type(e).__name__}: {e}", plugins) from e
    if backend not in agent.backends:
        raise BackendUnavailable(backend, "create_backend returned without a backend handle", plugins)
    return agent
