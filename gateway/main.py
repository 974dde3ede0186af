"""The gateway process: aiohttp on uvloop in front of the mesh.

python -c "from pagemesh.gateway.main import main; main(['--tokenizer-address', ..., ...])"
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web

from pagemesh.common.logging import configure_logging
from pagemesh.common.messages import Ready
from pagemesh.common.process import run_until_signalled
from pagemesh.common.tokenizer import Tokenizer
from pagemesh.common.transport import Push
from pagemesh.gateway.app import Gateway
from pagemesh.gateway.config import GatewayConfig, parse_args
from pagemesh.gateway.drain import GatewayDrain
from pagemesh.gateway.http_server import GatewayRunner
from pagemesh.gateway.mesh import MeshClient
from pagemesh.gateway.metrics import GatewayMetrics

log = structlog.get_logger()


def main(argv: list[str]) -> None:
    config = parse_args(argv)
    configure_logging("gateway", config.name, config.log_level)
    drain = GatewayDrain(config.drain_timeout)
    run_until_signalled(run(config, drain), drain=drain.drain)


async def run(config: GatewayConfig, drain: GatewayDrain | None = None) -> None:
    """Serve until cancelled."""
    tokenizer = Tokenizer.from_path(config.model)  # logprob token texts
    mesh = MeshClient(config.tokenizer_addresses, config.scheduler_address, config.reply_address, config.name)
    if drain is not None:
        drain.mesh = mesh
    runner = GatewayRunner(
        Gateway(config, mesh, tokenizer, GatewayMetrics(config.served_model), drain).app(),
        max_header_bytes=config.max_header_bytes,
        handler_cancellation=True,
        access_log=None,
    )
    try:
        mesh.start()
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        log.info(
            "serving",
            http=[f"{host}:{port}" for host, port, *_ in runner.addresses],
            model=config.served_model,
            tokenizer=config.tokenizer_address,
            scheduler=config.scheduler_address,
            reply_to=mesh.reply_to,
        )
        if config.ready_address:
            with Push(config.ready_address) as ready:
                await ready.send(Ready(service="gateway", name=config.name))
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await mesh.close()
