"""``GET /metrics`` over HTTP: a route for the OpenAI server's app, and a server of
its own (``router.metrics_port``) for a router that serves gRPC only."""

from __future__ import annotations

from aiohttp import web

from splitserve.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics


def add_metrics_route(app: web.Application, metrics: RouterMetrics) -> None:
    async def handle(request: web.Request) -> web.Response:
        resp = web.Response(body=metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    app.router.add_get("/metrics", handle)


class MetricsServer:
    """Only ``/metrics``, on the router's loop (the registry it reads lives there)."""

    def __init__(self, metrics: RouterMetrics, host: str, port: int):
        self.metrics = metrics
        self.host, self.port = host, port
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        app = web.Application()
        add_metrics_route(app, self.metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
