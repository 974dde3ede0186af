"""An LLM worker's end of the encoder channel (common/messages/encoder.py): a PULL socket where
encoder workers push image rows (ImageEmbedsHeader + one tensor frame), each handed to the
engine between steps (`Engine.receive_image_rows`), which lets the waiting prompt run."""

from __future__ import annotations

from pagemesh.common import protocol
from pagemesh.common.messages import ImageEmbedsHeader, ProtocolError
from pagemesh.common.transport import KV, Pull
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.shell.backend import WorkerContext


class ImageRowsIn:
    """Binds `address` (the worker's `embeds_endpoint`) and feeds what comes to the engine."""

    def __init__(self, ctx: WorkerContext, engine: Engine, address: str):
        self.ctx, self.engine = ctx, engine
        self.socket = Pull(address, options=KV)  # few, large frames: KV's limits
        self.received = 0  # images' rows taken, ever

    async def receive_loop(self) -> None:
        while True:
            msg, frames = await self.socket.recv_with_frames()
            if not isinstance(msg, ImageEmbedsHeader):
                self.ctx.log.warning("unexpected message on the image rows socket", type=type(msg).__name__)
                continue
            try:
                rows = protocol.decode_image_embeds(msg, frames).clone()  # off the frame's memory
            except ProtocolError as e:
                self.ctx.log.warning("bad image rows", request_id=msg.request_id, error=str(e))
                continue  # the prompt encodes the image itself after its deadline
            self.received += 1
            self.ctx.post(lambda m=msg, r=rows: self.engine.receive_image_rows(m.request_id, m.digest, r))

    def close(self) -> None:
        self.socket.close()
