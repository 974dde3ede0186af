"""The gateway's part of a drain (SIGTERM), which it leads: it stops admitting first.

    SIGTERM ──▶ /ready and every new /v1 request: 503 with Retry-After (load balancers and
                clients go elsewhere); requests in flight go on
            ──▶ all finished: the process stops (exit 0)
            ──▶ --drain-timeout passed: those left end with a 503 `shutting_down` (an error
                event in a stream) and are aborted in the mesh; then the process stops

A second SIGTERM stops at once (common/process.py).
"""

from __future__ import annotations

from aiohttp import web

from pagemesh.common.process import wait_until_idle
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.mesh import MeshClient

RETRY_AFTER_S = 5  # what a refused client is told to wait (another replica, or this one restarted)
FLUSH_S = 5.0  # after the timeout: how long the handlers get to write their error events


class GatewayDrain:
    """Attach the process's MeshClient (`mesh`) once it exists; `middleware()` goes into the app."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.draining = False
        self.mesh: MeshClient | None = None

    def middleware(self):
        @web.middleware
        async def refuse_while_draining(request: web.Request, handler) -> web.StreamResponse:
            if self.draining and (request.path == "/ready" or request.path.startswith("/v1/")):
                raise ApiError(
                    503,
                    "Service unavailable: the server is shutting down; retry later.",
                    "server_error",
                    None,
                    "shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            return await handler(request)

        return refuse_while_draining

    async def drain(self) -> None:
        self.draining = True
        mesh = self.mesh
        if mesh is None or await wait_until_idle(lambda: mesh.in_flight == 0, self.timeout):
            return
        mesh.fail_in_flight(
            "Request failed: the server shut down before it finished; retry later.", "shutting_down", "gateway drained"
        )
        await wait_until_idle(lambda: mesh.in_flight == 0, FLUSH_S)
