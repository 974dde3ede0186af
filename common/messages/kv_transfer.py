"""The KV channel: prefill worker ──KVPagesHeader + tensor frames──▶ decode worker ──KVPagesAck──▶.

A DEALER per destination at the prefill worker, a ROUTER at the decode worker's KV address.
"""

from __future__ import annotations

import dataclasses
import math
import typing

from pagemesh.common.messages.base import MAX_ID, ProtocolError, message

KV_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


@message
class KVPagesHeader:
    """Prefill -> decode: KV pages of one request, followed by one tensor frame per layer.

    Frame i (0 <= i < layer_end - layer_start) holds layer `layer_start + i` as a C-contiguous
    tensor of shape [num_pages, *page_shape] in `dtype`; its page j is the request's logical page
    `page_indices[j]` (pages the decode worker already holds are skipped). `checksum` is the
    CRC-32 of all tensor frames' bytes in order (see `encode_tensor_frames`). `seq_index` numbers
    the transfers of one request from 0; `last` marks the final one. `first_token_ids` are the
    tokens the prefill worker sampled (one per choice). An fp8 `dtype` comes with the sender's
    `kv_scales`: (layer, K|V, kv_head) flattened in that order over the frames' layers (a page's
    value is fp8 * its scale, workers/engine/kv_quant.py); other dtypes send none.

    A tensor-parallel prefill worker of `tp_size` ranks sends one header per rank: `tp_rank`'s
    pages hold that rank's KV heads only (`page_shape` is a rank's), and the decode worker,
    which must have the same `tp_size`, writes them into its rank `tp_rank`'s pool. A worker of
    pipeline stages sends one header per rank of every stage, [layer_start, layer_end) being
    that stage's layers; the decode worker's stages must hold the same ranges.
    """

    TENSOR_FRAMES: typing.ClassVar[bool] = True

    request_id: str
    seq_index: int
    num_tokens: int
    layer_start: int
    layer_end: int
    num_pages: int
    dtype: str
    page_shape: list[int]
    checksum: int
    first_token_ids: list[int]
    last: bool
    page_indices: list[int]
    tp_rank: int = 0  # the sending rank: these pages hold its share of the KV heads
    tp_size: int = 1  # the sending worker's tensor-parallel size (one header per rank)
    kv_scales: list[float] = dataclasses.field(default_factory=list)

    @property
    def num_frames(self) -> int:
        return self.layer_end - self.layer_start

    def _check(self) -> None:
        if not 0 <= self.layer_start <= self.layer_end <= MAX_ID:
            raise ProtocolError("KVPagesHeader: need 0 <= layer_start <= layer_end")
        if not 0 <= self.num_pages == len(self.page_indices):
            raise ProtocolError("KVPagesHeader: num_pages must equal len(page_indices)")
        if self.dtype not in KV_DTYPES:
            raise ProtocolError(f"KVPagesHeader.dtype: must be one of {KV_DTYPES}")
        if not 1 <= len(self.page_shape) <= 8 or 0 in self.page_shape:
            raise ProtocolError("KVPagesHeader.page_shape: 1 to 8 positive dimensions")
        want = self.num_frames * 2 * self.page_shape[-2] if self.dtype.startswith("float8") else 0
        if len(self.kv_scales) != want or not all(math.isfinite(x) and x > 0 for x in self.kv_scales):
            raise ProtocolError(f"KVPagesHeader.kv_scales: {want} finite positive scales for {self.dtype}")
        if not 0 <= self.checksum <= 0xFFFFFFFF:
            raise ProtocolError("KVPagesHeader.checksum: must be a 32-bit unsigned integer")
        if not 0 <= self.tp_rank < self.tp_size <= 4096:
            raise ProtocolError("KVPagesHeader: need 0 <= tp_rank < tp_size <= 4096")


@message
class KVPagesAck:
    """Decode -> prefill: the pages of `request_id` were written (ok) or refused (error)."""

    request_id: str
    ok: bool
    error: str | None
