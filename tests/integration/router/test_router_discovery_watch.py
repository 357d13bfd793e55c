"""KubernetesDiscovery with the official client against a tiny fake API server on loopback.

List, watch events, an API outage (the last table is kept), a 410 Gone (relist). The real API server is
exercised by the e2e suite; this pins the client-side logic without a cluster.
"""

from __future__ import annotations

import asyncio
import json
import sys
import pathlib

from aiohttp import web

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from disagg_connector.router.discovery import EndpointTable, KubernetesDiscovery  # noqa: E402
from tests.fixtures.router import pod  # noqa: E402


class FakeApi:
    def __init__(self) -> None:
        self.pods = [pod("p1"), pod("d1", "decode")]
        self.rv = 10
        self.events: asyncio.Queue = asyncio.Queue()
        self.down = False
        self.lists = 0
        self.selectors: list[str] = []

    async def pods_handler(self, request: web.Request) -> web.StreamResponse:
        self.selectors.append(request.query.get("labelSelector", ""))
        if self.down:
            return web.json_response({"kind": "Status", "code": 503, "message": "down"}, status=503)
        if request.query.get("watch") not in ("true", "1", "True"):
            self.lists += 1
            return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}, "items": self.pods})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while True:
            ev = await self.events.get()
            if ev is None:  # the server ends this watch
                break
            await resp.write(json.dumps(ev).encode() + b"\n")
        await resp.write_eof()
        return resp


def test_watch_list_events_outage_and_gone():
    async def main() -> None:
        api = FakeApi()
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/ns/pods", api.pods_handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        from kubernetes import client

        conf = client.Configuration()
        conf.host = f"http://127.0.0.1:{port}"
        table = EndpointTable()
        errors: list[int] = []
        disc = KubernetesDiscovery("ns", "disagg.dev/model=m", table, api_client=client.ApiClient(conf), on_error=lambda: errors.append(1))

        async def until(pred, what: str, timeout: float = 30.0) -> None:
            end = asyncio.get_running_loop().time() + timeout
            while not pred():
                assert asyncio.get_running_loop().time() < end, f"timed out: {what}"
                await asyncio.sleep(0.02)

        def eligible() -> set[str]:
            return {r.revision for r in table.snapshot().revisions if r.eligible}

        await disc.start()
        try:
            await until(lambda: eligible() == {"rev1"}, "initial list")
            assert api.selectors[0] == "disagg.dev/model=m"

            # watch events: a new revision becomes ready, the old prefill starts terminating
            api.rv += 1
            await api.events.put({"type": "ADDED", "object": pod("p2", revision="rev2", created="2026-05-01T00:00:00Z")})
            await api.events.put({"type": "ADDED", "object": pod("d2", "decode", revision="rev2", created="2026-05-01T00:00:00Z")})
            await api.events.put({"type": "MODIFIED", "object": pod("p1", terminating=True)})
            await until(lambda: eligible() == {"rev2"}, "events applied")
            assert table.snapshot().revisions[0].revision == "rev2"

            # API outage: the watch ends and every request fails; the table stays as it was
            api.down = True
            await api.events.put(None)
            await until(lambda: len(errors) >= 2, "failures seen")
            assert eligible() == {"rev2"}

            # recovery: a relist is the new truth
            api.pods = [pod("p3", revision="rev3"), pod("d3", "decode", revision="rev3")]
            api.down = False
            await until(lambda: eligible() == {"rev3"}, "relist after outage")

            # 410 Gone on the watch: relist
            lists = api.lists
            api.pods = [pod("p4", revision="rev4"), pod("d4", "decode", revision="rev4")]
            await api.events.put({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}})
            await until(lambda: api.lists > lists and eligible() == {"rev4"}, "relist after 410")
        finally:
            await disc.stop()
            await api.events.put(None)
            await runner.cleanup()

    asyncio.run(main())
