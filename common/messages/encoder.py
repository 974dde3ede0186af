"""The encoder channel (`pagemesh up --encoder N`): images encoded by a pool of their own.

    scheduler ──EncodeTask──▶ encoder worker ──ImageEmbedsHeader + one tensor frame──▶ the LLM
    worker that prefills the request (its `embeds_endpoint`), which runs the prompt once the
    rows of every image are there, or encodes them itself after a deadline (a lost encoder
    worker delays a request, it never strands one)

The encode, prefill, decode disaggregation of vLLM's and SGLang's EPD designs: the vision tower
runs beside the prefills, not inside them, and its rows travel as tensor frames like KV pages.
"""

from __future__ import annotations

import math
import typing

from pagemesh.common.messages.base import MAX_ID, ProtocolError, message
from pagemesh.common.messages.kv_transfer import KV_DTYPES
from pagemesh.common.messages.requests import ImageInput


@message
class EncodeTask:
    """Scheduler -> encoder worker: encode `images` and push each one's rows to `target_endpoint`
    (the embeds endpoint of LLM worker `target_worker_id`, where the request waits for them)."""

    request_id: str
    images: list[ImageInput]
    target_worker_id: str
    target_endpoint: str

    def _check(self) -> None:
        if not self.images:
            raise ProtocolError("EncodeTask.images: at least one image")


@message
class ImageEmbedsHeader:
    """Encoder worker -> LLM worker: one image's rows [placeholders, hidden] for `request_id`,
    in `dtype`, followed by one tensor frame of those bytes (`checksum`: their CRC-32)."""

    TENSOR_FRAMES: typing.ClassVar[bool] = True

    request_id: str
    digest: str
    dtype: str
    shape: list[int]
    checksum: int

    @property
    def num_frames(self) -> int:
        return 1

    def _check(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ProtocolError(f"ImageEmbedsHeader.dtype: one of {KV_DTYPES}")
        if len(self.shape) != 2 or math.prod(self.shape) > MAX_ID:
            raise ProtocolError("ImageEmbedsHeader.shape: [placeholders, hidden]")
