"""The encoder worker: an `ImageEncoder` behind the worker shell (common/messages/encoder.py).

    EncodeTask ─▶ queue ─▶ one step: every queued image not encoded lately, in one batched
              tower call (an image sent again is taken from the last `RECENT` images' rows)
              ─▶ ImageEmbedsHeader + one tensor frame per image to the task's target endpoint

It holds no request state the mesh waits on: the LLM worker that asked waits for the rows up to
a deadline and then encodes them itself, so losing an encoder worker delays, never fails.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from pagemesh.common import protocol
from pagemesh.common.messages import EncodeTask, HeldRequest, WorkerKind, WorkerRole
from pagemesh.common.transport import KV, Push
from pagemesh.workers.model.vision.encoder import ImageEncoder
from pagemesh.workers.shell.backend import Load, Registration, WorkerContext

MAX_BATCH_IMAGES = 16  # images per tower call
RECENT = 64  # images whose rows are kept for a request that sends one again


@dataclass
class EncodedImage:
    task: EncodeTask
    digest: str
    rows: torch.Tensor


class EncoderWorker:
    """A `WorkerBackend` around one image encoder."""

    task_types = (EncodeTask,)

    def __init__(self, encoder: ImageEncoder, model: str, ctx: WorkerContext):
        self.encoder, self.model, self.ctx = encoder, model, ctx
        self.step_inline = encoder.device.type == "cpu"
        self.queue: list[EncodeTask] = []
        self.recent: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.pushes: dict[str, Push] = {}
        self.produced = 0  # images encoded, ever
        self.reused = 0  # images sent from `recent`, ever

    # ---- WorkerBackend ----------------------------------------------------------------------
    def registration(self) -> Registration:
        return Registration(kind=WorkerKind.ENCODER, role=WorkerRole.MIXED, model=self.model, max_running=64)

    def add(self, task: EncodeTask) -> None:
        self.queue.append(task)

    def abort(self, request_id: str) -> None:
        self.queue = [t for t in self.queue if t.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self.queue)

    def stalled(self) -> bool:
        return False

    def step(self) -> list[EncodedImage]:
        """Encode the queued tasks' images (up to MAX_BATCH_IMAGES new ones) in one call."""
        taken, fresh = [], {}
        while self.queue:
            task = self.queue[0]
            new = {i.digest: i for i in task.images if i.digest not in self.recent and i.digest not in fresh}
            if fresh and len(fresh) + len(new) > MAX_BATCH_IMAGES:
                break
            fresh |= new
            taken.append(self.queue.pop(0))
        if fresh:
            rows = self.encoder.encode([(i.data, i.grid) for i in fresh.values()])
            for digest, r in zip(fresh, rows, strict=True):
                self.recent[digest] = r
                self.produced += 1
            while len(self.recent) > RECENT:
                self.recent.popitem(last=False)
        out = []
        for task in taken:
            for image in task.images:
                out.append(EncodedImage(task, image.digest, self.recent[image.digest]))
                self.reused += image.digest not in fresh
        return out

    async def publish(self, encoded: list[EncodedImage]) -> None:
        for item in encoded:
            address = item.task.target_endpoint
            push = self.pushes.get(address)
            if push is None:
                push = self.pushes[address] = Push(address, options=KV)
            await push.send_frames(protocol.encode_image_embeds(item.task.request_id, item.digest, item.rows))

    async def between_steps(self) -> None:
        return None

    def load(self) -> Load:
        return Load(running=0, waiting=sum(len(t.images) for t in self.queue), produced=self.produced)

    def held(self) -> list[HeldRequest]:
        return []

    def registered_again(self) -> None:
        return None

    def background(self) -> list:
        return []

    def close(self) -> None:
        for push in self.pushes.values():
            push.close()
