"""Quantized linear weights in one layout for every format, and the conversions into it.

A `QuantizedWeight` holds W [N, K] (K a multiple of 32) as unsigned codes with, per row and block
of 32 codes, an fp16 scale d and an fp16 offset c:

    W[n, 32 b + j] = d[n, b] * q[n, 32 b + j] + c[n, b]

    format   bits  codes q                 c          source
    q4_0     4     GGUF nibbles (0..15)    -8 d       a GGUF Q4_0 tensor, bit for bit
    q4_1     4     GGUF nibbles (0..15)    m          a GGUF Q4_1 tensor, bit for bit
    q8_0     8     int8 + 128              -128 d     a GGUF Q8_0 tensor, bit for bit
    int8     8     int8 + 128              -128 d     any dense weight (`quantize_int8`): d = max|w| / 127
    q4_k     4     Q4_K sub-block codes    -dmin m    a GGUF Q4_K tensor (kernels/gguf_conversions.py)
    u8       8     codes as they are       any        GGUF Q5_0/Q5_1/Q5_K, or 4-bit parts widened

4-bit codes are two to a byte in GGUF's order: byte j of a block holds code j in its low nibble
and code j + 16 in its high one. The matmul kernels (`pagemesh.kernels.cpu.quant`, `pagemesh.kernels.quant_matmul`)
read this layout; `dequantize` is their reference.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
FORMATS = {"q4_0": 4, "q4_1": 4, "q8_0": 8, "int8": 8}
# converted GGUF types (kernels/gguf_conversions.py): Q4_K sub-blocks; any codes one per byte
FORMATS.update(q4_k=4, u8=8)
# GGUF tensor type name -> (our format, bytes per block)
GGUF_BLOCK_FORMATS = {"Q4_0": ("q4_0", 18), "Q4_1": ("q4_1", 20), "Q8_0": ("q8_0", 34)}


@dataclass(frozen=True)
class QuantizedWeight:
    """W [N, K] as codes [N, K * bits / 8] uint8, scale and offset [N, K / 32] float16 (see above)."""

    # tell one apart by this, not isinstance: the Triton tests reload kernels.* (TRITON_INTERPRET),
    # which makes a second class while models built before still hold the first one's weights
    is_quantized_weight: typing.ClassVar[bool] = True

    format: str
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    # the same codes and scales repacked for the CPU decode-batch GEMM (`with_tiles`), or None;
    # shards, fused rows and device copies leave it out (make it again on the result)
    tiles: OutputTiles | None = None

    @property
    def bits(self) -> int:
        return FORMATS[self.format]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.scale.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        tiles = () if self.tiles is None else (self.tiles.codes, self.tiles.scales)
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset, *tiles))

    @property
    def has_row_codes(self) -> bool:
        """False once `without_row_codes` kept the tiles' copy only (`codes` is then [N, 0])."""
        return self.codes.shape[1] > 0

    def _whole(self, what: str) -> None:
        if not self.has_row_codes:
            raise ValueError(f"quantized weight: {what} needs the row-major codes (kept in tiles only)")

    def rows(self, start: int, size: int) -> QuantizedWeight:
        """Rows start:start+size (a column-parallel shard)."""
        self._whole("a row shard")
        return QuantizedWeight(
            self.format, *(t[start : start + size].contiguous() for t in (self.codes, self.scale, self.offset))
        )

    def columns(self, start: int, size: int) -> QuantizedWeight:
        """Columns start:start+size, both multiples of 32 (a row-parallel shard)."""
        if start % BLOCK or size % BLOCK:
            raise ValueError(f"quantized weight: columns {start}:{start + size} do not fall on blocks of {BLOCK}")
        self._whole("a column shard")
        per_code = 8 // self.bits
        codes = self.codes[:, start // per_code : (start + size) // per_code]
        blocks = slice(start // BLOCK, (start + size) // BLOCK)
        return QuantizedWeight(
            self.format, codes.contiguous(), self.scale[:, blocks].contiguous(), self.offset[:, blocks].contiguous()
        )

    def to(self, device: torch.device) -> QuantizedWeight:
        self._whole("a device copy")
        return QuantizedWeight(self.format, self.codes.to(device), self.scale.to(device), self.offset.to(device))


@dataclass(frozen=True)
class OutputTiles:
    """W's codes and scales in tiles of TILE_N output rows (N padded with zero rows), the layout
    of `pm_quant_gemm_tiles` (kernels/cpu/quant_matmul.c): one 64-byte vector holds 4 codes' bytes
    of each of 16 rows, so a block's scale work is one vector over 16 outputs.

        codes  uint8 [N16 / 16, K / 32, G, 16, 4]   G = bytes per row and block / 4 (8-bit: 8,
               4-bit: 4; byte 4g+i of a row's block, as in `codes`, low nibble code 4g+i, high
               nibble code 16+4g+i)
        scales float16 [N16 / 16, K / 32, 2, 16]    d, then c, of the tile's 16 rows
    """

    codes: torch.Tensor
    scales: torch.Tensor


TILE_N = 16


def with_tiles(qw: QuantizedWeight) -> QuantizedWeight:
    """`qw` with its `tiles` made (a second copy of the codes, N * K * bits / 8 bytes, and of the
    scales): from a CPU weight only; the tiled GEMM takes decode batches
    (`pagemesh.workers.model.layers.quantized_linear`)."""
    qw._whole("tiling")
    n, k = qw.shape
    tiles_n, kb = (n + TILE_N - 1) // TILE_N, k // BLOCK
    pad = tiles_n * TILE_N - n
    codes = torch.nn.functional.pad(qw.codes, (0, 0, 0, pad)).reshape(tiles_n, TILE_N, kb, -1, 4)
    scales = torch.stack((qw.scale, qw.offset), dim=1)  # [N, 2, KB]
    scales = torch.nn.functional.pad(scales, (0, 0, 0, 0, 0, pad)).reshape(tiles_n, TILE_N, 2, kb)
    tiles = OutputTiles(codes.permute(0, 2, 3, 1, 4).contiguous(), scales.permute(0, 3, 2, 1).contiguous())
    return QuantizedWeight(qw.format, qw.codes, qw.scale, qw.offset, tiles)


def without_row_codes(qw: QuantizedWeight) -> QuantizedWeight:
    """`qw` (with its tiles) holding its codes once, in the tiles: `codes` becomes an [N, 0]
    placeholder and `row_codes` rebuilds any rows from the tiles. What reads row-major codes (the
    prefill path's widening, an embedding lookup) takes them from there; the tiled GEMM never
    needed them. Saves N * K * bits / 8 bytes (~85 MB for the embedded model's weights)."""
    if qw.tiles is None:
        raise ValueError("without_row_codes: the weight has no tiles (with_tiles)")
    return QuantizedWeight(qw.format, qw.codes.new_empty(qw.codes.shape[0], 0), qw.scale, qw.offset, qw.tiles)


def row_codes(qw: QuantizedWeight, rows: torch.Tensor | slice) -> torch.Tensor:
    """`qw.codes[rows]` (uint8 [R, K * bits / 8], contiguous), read from the tiles where the
    row-major copy was dropped (`without_row_codes`): row r is lane r % 16 of tile r // 16."""
    if qw.has_row_codes:
        return qw.codes[rows].contiguous()
    if isinstance(rows, slice):  # a run of rows: its whole tiles turned back, a plain copy
        start, stop, step = rows.indices(qw.shape[0])
        row_bytes = qw.shape[1] * qw.bits // 8
        if step == 1 and stop <= start:
            return qw.codes.new_empty(0, row_bytes)
        if step == 1:
            first, last = start // TILE_N, (stop + TILE_N - 1) // TILE_N
            # [T, K / 32, G, 16, 4] -> [T, 16, K / 32, G, 4], moving each row's 4 bytes as one int32
            words = qw.tiles.codes[first:last].view(torch.int32).squeeze(-1)
            whole = words.permute(0, 3, 1, 2).contiguous().view(torch.uint8).reshape((last - first) * TILE_N, row_bytes)
            return whole[start - first * TILE_N : stop - first * TILE_N].contiguous()
    ids = torch.arange(qw.shape[0])[rows] if isinstance(rows, slice) else rows.reshape(-1)
    picked = qw.tiles.codes[ids // TILE_N, :, :, ids % TILE_N, :]  # [R, K / 32, G, 4]
    return picked.reshape(ids.shape[0], qw.shape[1] * qw.bits // 8)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack row blocks of one format (fused q/k/v or gate/up)."""
    if len({p.format for p in parts}) != 1:
        raise ValueError("quantized weight: fused parts must share one format")
    return QuantizedWeight(
        parts[0].format, *(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "offset"))
    )


def from_gguf_blocks(type_name: str, blocks: np.ndarray) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row], as gguf.GGUFReader gives them) in our
    layout, the same bits: Q4_0, Q4_1 and Q8_0."""
    fmt, block_bytes = GGUF_BLOCK_FORMATS[type_name]
    rows = blocks.shape[0]
    raw = np.ascontiguousarray(blocks).reshape(rows, -1, block_bytes)
    scale = raw[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    if fmt == "q4_1":
        offset = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0]
        codes = raw[:, :, 4:]
    elif fmt == "q4_0":
        offset = (scale.astype(np.float32) * -8).astype(np.float16)
        codes = raw[:, :, 2:]
    else:
        offset = (scale.astype(np.float32) * -128).astype(np.float16)
        codes = (raw[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return QuantizedWeight(
        fmt,
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(scale)),
        torch.from_numpy(np.ascontiguousarray(offset)),
    )


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Weight-only int8 of a dense W [N, K] (K a multiple of 32): per block of 32, symmetric,
    d = max|w| / 127 rounded to fp16, q = round(w / d) in [-127, 127]."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"quantize_int8: K={k} is not a multiple of {BLOCK}")
    blocks = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=-1) / 127).to(torch.float16)
    inv = torch.where(scale > 0, 1 / scale.float(), torch.zeros(()))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127)
    codes = (q + 128).to(torch.uint8).reshape(n, k)
    return QuantizedWeight("int8", codes.contiguous(), scale.contiguous(), (scale.float() * -128).to(torch.float16))


def unpack_codes(qw: QuantizedWeight) -> torch.Tensor:
    """The codes one per element: uint8 [N, K]."""
    codes = row_codes(qw, slice(None))
    if qw.bits == 8:
        return codes
    n = codes.shape[0]
    packed = codes.reshape(n, -1, BLOCK // 2)
    return torch.cat((packed & 15, packed >> 4), dim=-1).reshape(n, -1)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """W [N, K] in fp32: the reference the kernels are tested against."""
    n, k = qw.shape
    q = unpack_codes(qw).float().reshape(n, k // BLOCK, BLOCK)
    return (q * qw.scale.float().unsqueeze(-1) + qw.offset.float().unsqueeze(-1)).reshape(n, k)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels see it: rounded per row and block of 32 to int8 with scale
    max|x| / 127 (llama.cpp's Q8 activations), returned dequantized in fp32."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros(()))
    return (torch.round(blocks * inv) * (amax / 127)).reshape(m, k)


def is_quantized(weight: object) -> bool:
    """A QuantizedWeight, whichever load of this module made it (see QuantizedWeight)."""
    return getattr(weight, "is_quantized_weight", False)
