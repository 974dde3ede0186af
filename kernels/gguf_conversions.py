"""GGUF tensor types that do not land bit for bit on 4-bit codes, in our layout (kernels/quantized.py:
blocks of 32 codes, an fp16 scale d and an fp16 offset c each, W = d q + c).

    GGUF   GGUF block                            ours     how
    Q5_0   32 x 5-bit q, fp16 d: d (q - 16)      u8       codes one per byte, c = -16 d: exact
    Q5_1   32 x 5-bit q, fp16 d, m: d q + m      u8       codes one per byte, c = m: exact
    Q4_K   256 = 8 sub-blocks of 32, fp16 d and  q4_k     each sub-block its own block: d = fp16(d sc),
           dmin, 6-bit sc and m per sub-block:            c = fp16(-dmin m), codes as they are; the two
           d sc q - dmin m                                products rounded to fp16 (not bit-exact)
    Q5_K   the same with 5-bit codes             u8       as Q4_K, codes one per byte
    Q6_K   256 = 16 sub-blocks of 16, int8 sc,   int8     two sub-blocks of 16 share no scale: the
           fp16 d: d sc (q - 32)                          values (gguf-py's dequantizer) rounded again
                                                          to int8 blocks of 32 (`quantize_int8`)

What the fp16 rounding of Q4_K/Q5_K costs: d sc needs up to 11 + 6 significant bits and keeps 11,
so each weight moves by at most |q d sc| 2^-11 + |dmin m| 2^-11 (half an fp16 ulp of each product,
plus subnormal steps for tiny scales): about 1% of one quantization step (d sc) for 4-bit codes;
on a real Q4_K_M file its RMS is 3.6% of the Q4_K rounding error itself (docs/perf/quantization.md).
The 8-bit layouts read 8 bits per weight where the file has 5.5-6.6: that memory and bandwidth is
the price of keeping our two code widths.
"""

from __future__ import annotations

import numpy as np
import torch

from pagemesh.kernels.quantized import BLOCK, QuantizedWeight, quantize_int8, unpack_codes

QK_K = 256  # weights per K-quant super-block
# GGUF type -> (our format, bytes per GGUF block, the route in words for the load log)
GGUF_CONVERSIONS = {
    "Q5_0": ("u8", 22, "u8 codes, exact"),
    "Q5_1": ("u8", 24, "u8 codes, exact"),
    "Q4_K": ("q4_k", 144, "q4_k: sub-blocks of 32, d*sc and -dmin*m rounded to fp16"),
    "Q5_K": ("u8", 176, "u8 codes: sub-blocks of 32, d*sc and -dmin*m rounded to fp16"),
    "Q6_K": ("int8", 210, "int8 blocks of 32: dequantized (sub-blocks of 16), rounded again"),
}


def from_gguf_converted(type_name: str, blocks: np.ndarray) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row], as gguf.GGUFReader gives them) of a
    type in GGUF_CONVERSIONS, in our layout (see the table above)."""
    fmt, block_bytes, _ = GGUF_CONVERSIONS[type_name]
    rows = blocks.shape[0]
    raw = np.ascontiguousarray(blocks).reshape(rows, -1, block_bytes)
    if type_name == "Q6_K":
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        dense = dequantize(np.ascontiguousarray(blocks), GGMLQuantizationType.Q6_K).reshape(rows, -1)
        return quantize_int8(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)))
    if type_name in ("Q5_0", "Q5_1"):
        codes, scale, offset = _q5_blocks(raw, with_min=type_name == "Q5_1")
    else:
        codes, scale, offset = _k_blocks(raw, five_bit=type_name == "Q5_K")
    if fmt == "q4_k":
        codes = codes[..., :16] | (codes[..., 16:] << 4)  # our nibble order: code j low, j + 16 high
    return QuantizedWeight(
        fmt,
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(offset.reshape(rows, -1))),
    )


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block: [rows, blocks]."""
    return raw[:, :, at : at + 2].copy().view(np.float16)[:, :, 0]


def _q5_blocks(raw: np.ndarray, with_min: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_0 / Q5_1: codes [rows, blocks, 32] (0..31), scale and offset [rows, blocks] fp16."""
    d = _f16(raw, 0)
    at = 4 if with_min else 2
    offset = _f16(raw, 2) if with_min else (d.astype(np.float32) * -16).astype(np.float16)
    qh = raw[:, :, at : at + 4].copy().view(np.uint32)  # bit j: the fifth bit of code j
    qs = raw[:, :, at + 4 : at + 20]  # byte j: code j's low nibble, code j + 16's in the high one
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1
    return (low | (high << 4)).astype(np.uint8), d, offset


def _k_blocks(raw: np.ndarray, five_bit: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks as sub-blocks of 32: codes [rows, 8 * supers, 32], fp16 scale and
    offset [rows, 8 * supers]."""
    from gguf.quants import Q4_K

    rows, supers, _ = raw.shape
    d, dmin = _f16(raw, 0).astype(np.float32), _f16(raw, 2).astype(np.float32)
    sc, m = Q4_K.get_scale_min(raw[:, :, 4:16].reshape(-1, 12))  # the 6-bit packing, [rows*supers, 8]
    sc, m = sc.reshape(rows, supers, 8).astype(np.float32), m.reshape(rows, supers, 8).astype(np.float32)
    scale = (d[..., None] * sc).astype(np.float16)  # both products exact in fp32, rounded once here
    offset = (-(dmin[..., None] * m)).astype(np.float16)
    qs = raw[:, :, 48:176] if five_bit else raw[:, :, 16:144]
    # 4 groups of 32 bytes: sub-block 2g in the low nibbles of group g, 2g + 1 in the high ones
    qs = qs.reshape(rows, supers, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    codes = (qs & 15).reshape(rows, supers, 8, 32)
    if five_bit:  # bit s of byte j of qh: the fifth bit of sub-block s's code j
        qh = raw[:, :, 16:48].reshape(rows, supers, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        codes = codes | ((qh & 1) << 4)
    return codes.reshape(rows, supers * 8, BLOCK).astype(np.uint8), scale, offset


def widen_to_u8(qw: QuantizedWeight) -> QuantizedWeight:
    """The same weight with one code per byte (format u8): exact, twice the bytes for 4-bit codes."""
    return QuantizedWeight("u8", unpack_codes(qw).contiguous(), qw.scale, qw.offset)


def fusable(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Parts of one fused weight (q/k/v, gate/up) in one format: as they are when they share one;
    else all u8 (a K-quant file mixes types within a layer, e.g. Q5_0 q/k with a Q8_0 v)."""
    if len({p.format for p in parts}) == 1:
        return parts
    return [widen_to_u8(p) if p.bits == 4 else QuantizedWeight("u8", p.codes, p.scale, p.offset) for p in parts]
