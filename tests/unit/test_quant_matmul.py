"""Quantized weights: the GGUF blocks and our int8 in one layout (`pagemesh.kernels.quantized`), and the C
matmul (`pagemesh.kernels.cpu.quant`) against dequantize-then-matmul on random blocks, tails included."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagemesh.kernels.cpu import quant
from pagemesh.kernels.quantized import (
    BLOCK,
    QuantizedWeight,
    concat_rows,
    dequantize,
    from_gguf_blocks,
    quantize_activations,
    quantize_int8,
    row_codes,
    unpack_codes,
    with_tiles,
    without_row_codes,
)


def _weight(fmt: str, n: int, k: int, seed: int):
    """A random W [N, K] in `fmt`: GGUF formats through gguf's own quantizer."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    if fmt == "int8":
        return quantize_int8(torch.from_numpy(w))
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    return from_gguf_blocks(fmt.upper(), gguf_quantize(w, qtype))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_gguf_blocks_convert_bit_for_bit(fmt):
    w = np.random.default_rng(1).standard_normal((7, 96)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    blocks = gguf_quantize(w, qtype)
    qw = from_gguf_blocks(fmt.upper(), blocks)
    assert qw.format == fmt and qw.shape == (7, 96)
    assert torch.equal(dequantize(qw), torch.from_numpy(gguf_dequantize(blocks, qtype).reshape(7, 96)))


def test_int8_rounds_each_block_to_its_own_scale():
    w = torch.randn(5, 64)
    w[2, :32] *= 100  # one loud block must not coarsen its neighbours
    qw = quantize_int8(w)
    err = (dequantize(qw) - w).abs()
    bound = w.reshape(5, 2, 32).abs().amax(-1) / 127 * 0.51  # half a step, and fp16 scale rounding
    assert (err.reshape(5, 2, 32) <= bound.unsqueeze(-1) + 1e-6).all()


def test_shards_and_fused_rows_keep_the_values():
    qw = _weight("q4_1", 12, 128, 2)
    dense = dequantize(qw)
    assert torch.equal(dequantize(qw.rows(3, 4)), dense[3:7])
    assert torch.equal(dequantize(qw.columns(64, 64)), dense[:, 64:])
    assert torch.equal(dequantize(concat_rows([qw.rows(0, 5), qw.rows(5, 7)])), dense)
    with pytest.raises(ValueError, match="blocks of 32"):
        qw.columns(16, 64)


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
@pytest.mark.parametrize("fmt", ["int8", "q4_0", "q4_1", "q8_0"])
# M 1 and 7 (a tile of 4 and a tail of 3), N 37 (no round count), K from one block to 48
@pytest.mark.parametrize("m, n, k", [(1, 37, 32), (7, 37, 96), (5, 64, 1536)])
def test_cpu_kernel_matches_dequantize_then_matmul(fmt, m, n, k):
    qw = _weight(fmt, n, k, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n)
    got = quant.quant_linear(x, qw, bias)
    # the kernel's activation rounding, then plain matmul in float64; an activation within an
    # ulp of a rounding tie may round the other way in C (-ffast-math takes 1/amax once), so
    # one activation step times the largest weight is allowed on top of fp32 summation
    want = quantize_activations(x).double() @ dequantize(qw).double().T + bias.double()
    step = float(x.abs().max() / 127 * dequantize(qw).abs().max())
    torch.testing.assert_close(got.double(), want, atol=1e-4 + step, rtol=1e-4)
    # and within the int8 activation rounding of the unrounded product
    plain = x.double() @ dequantize(qw).double().T + bias.double()
    assert (got.double() - plain).abs().max() < 0.02 * plain.abs().max()
    # bf16 in: the same values read, the same sums; bf16 out: those sums rounded once
    x16, bias16 = x.bfloat16(), bias.bfloat16()
    wide = quant.quant_linear(x16.float(), qw, bias16.float())
    assert torch.equal(quant.quant_linear(x16, qw, bias16, torch.float32), wide)
    assert torch.equal(quant.quant_linear(x16, qw, bias16), wide.bfloat16())


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
def test_cpu_kernel_reads_strided_rows_and_rejects_bad_shapes():
    qw = _weight("q4_0", 16, 64, 3)
    wide = torch.randn(3, 128)
    assert torch.equal(quant.quant_linear(wide[:, :64], qw), quant.quant_linear(wide[:, :64].contiguous(), qw))
    assert quant.quant_linear(torch.zeros(0, 64), qw).shape == (0, 16)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        quant.quant_linear(torch.randn(2, 32), qw)


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
@pytest.mark.parametrize("fmt", ["int8", "q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(1, 32), (37, 96), (64, 1536)])
def test_dequantize_bf16_is_the_reference_rounded_once(fmt, n, k):
    qw = _weight(fmt, n, k, seed=n + k)
    want = dequantize(qw).bfloat16()
    assert torch.equal(quant.dequantize_bf16(qw), want)
    assert torch.equal(quant.dequantize_bf16(qw, n // 3, n - n // 4), want[n // 3 : n - n // 4])
    with pytest.raises(ValueError, match="rows"):
        quant.dequantize_bf16(qw, 0, n + 1)


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_linear_takes_the_bf16_gemm_from_the_row_threshold(fmt):
    from pagemesh.workers.model import layers
    from pagemesh.workers.model.layers import DEQUANTIZE_MIN_ROWS, quantized_linear

    qw = _weight(fmt, 40, 128, 5)
    bias = torch.randn(40)
    dense = dequantize(qw).bfloat16()
    gen = torch.Generator().manual_seed(6)
    for m in (DEQUANTIZE_MIN_ROWS, DEQUANTIZE_MIN_ROWS + 51):
        x = torch.randn(m, 128, generator=gen).bfloat16()
        # the dense model's own linear on the same bf16 weights, bit for bit
        want = torch.nn.functional.linear(x, dense, bias.bfloat16())
        assert torch.equal(quantized_linear(x, qw, bias, None), want)
        assert torch.equal(quantized_linear(x, qw, bias, torch.float32), want.float())
    # a weight larger than a tile goes through in row tiles (the last one cut): the same numbers
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "DEQUANTIZE_TILE", 128 * 15)
        assert torch.equal(quantized_linear(x, qw, bias, None), want)
    # below the threshold, and for fp32 activations, the integer kernel
    x = torch.randn(DEQUANTIZE_MIN_ROWS - 1, 128, generator=gen).bfloat16()
    assert torch.equal(quantized_linear(x, qw, bias, None), quant.quant_linear(x, qw, bias))
    x = torch.randn(DEQUANTIZE_MIN_ROWS + 3, 128, generator=gen)
    assert torch.equal(quantized_linear(x, qw, bias, None), quant.quant_linear(x, qw, bias))


def test_tiles_hold_every_code_and_scale_of_their_rows():
    for fmt in ("q4_1", "q8_0"):
        qw = with_tiles(_weight(fmt, 37, 96, 7))  # 3 tiles, the last with 11 padding rows
        codes, scales = qw.tiles.codes, qw.tiles.scales
        assert codes.shape == (3, 3, qw.bits, 16, 4) and scales.shape == (3, 3, 2, 16)
        # [tile, block, group, row, byte] back to [row, block, group, byte]: the row's own bytes
        rows = codes.permute(0, 3, 1, 2, 4).reshape(48, -1)
        assert torch.equal(rows[:37], qw.codes) and not rows[37:].any()
        d_c = scales.permute(0, 3, 2, 1).reshape(48, 2, 3)
        assert torch.equal(d_c[:37, 0], qw.scale) and torch.equal(d_c[:37, 1], qw.offset)
        assert not d_c[37:].any()
    assert torch.equal(unpack_codes(qw), unpack_codes(with_tiles(qw)))
    # shards and fused rows are new weights: their tiles are made again where they are installed
    assert qw.rows(0, 16).tiles is None and concat_rows([qw, qw]).tiles is None


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
@pytest.mark.parametrize("fmt", ["int8", "q4_0", "q4_1", "q8_0"])
def test_a_weight_kept_in_tiles_only_gives_back_every_row_and_the_same_products(fmt):
    whole = with_tiles(_weight(fmt, 37, 96, 11))  # 3 tiles, the last with 11 padding rows
    tiled = without_row_codes(whole)
    assert not tiled.has_row_codes and tiled.shape == whole.shape and tiled.codes.numel() == 0
    ids = torch.tensor([36, 0, 17, 17, 15, 16])
    assert torch.equal(row_codes(tiled, ids), whole.codes[ids])
    assert torch.equal(row_codes(tiled, slice(5, 33)), whole.codes[5:33])
    for empty in (slice(0, 0), slice(37, 37), torch.tensor([], dtype=torch.long)):  # no row: an empty [0, K bytes]
        assert torch.equal(row_codes(tiled, empty), whole.codes[empty])
    assert torch.equal(row_codes(tiled, slice(0, 37, 5)), whole.codes[0:37:5])
    assert torch.equal(dequantize(tiled), dequantize(whole))
    assert torch.equal(quant.dequantize_bf16(tiled, 3, 30), quant.dequantize_bf16(whole, 3, 30))
    x = torch.randn(9, 96)
    assert torch.equal(quant.quant_gemm(x, tiled), quant.quant_gemm(x, whole))
    for build in (lambda: tiled.rows(0, 16), lambda: tiled.columns(0, 32), lambda: with_tiles(tiled)):
        with pytest.raises(ValueError, match="tiles only"):  # what needs the row-major codes says so
            build()
    with pytest.raises(ValueError, match="tiles only"):
        quant.quant_linear(x, tiled)


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
@pytest.mark.parametrize("fmt", ["int8", "q4_0", "q4_1", "q8_0"])
# M: one row, a chunk of 8 and its tail, 32 (4 chunks), 70 (9 chunks of 8 and 7 rows: near-equal
# chunks); N: under one tile, a tail of 5, whole tiles; K: one block to 48
@pytest.mark.parametrize("m, n, k", [(1, 37, 32), (13, 5, 96), (32, 64, 1536), (70, 21, 64)])
def test_tiled_gemm_matches_dequantize_then_matmul(fmt, m, n, k):
    qw = with_tiles(_weight(fmt, n, k, seed=m + n + k))
    gen = torch.Generator().manual_seed(m * k)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    got = quant.quant_gemm(x, qw, bias)
    # the same reference and allowance as the plain kernel's test above (the same int8 activations)
    want = quantize_activations(x).double() @ dequantize(qw).double().T + bias.double()
    step = float(x.abs().max() / 127 * dequantize(qw).abs().max())
    torch.testing.assert_close(got.double(), want, atol=1e-4 + step, rtol=1e-4)
    # the plain kernel's sums, in another order
    torch.testing.assert_close(got, quant.quant_linear(x, qw, bias), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(quant.quant_gemm(x, qw) + bias, got)  # no bias: the same sums
    # bf16 in: the same values read; bf16 out: the fp32 sums rounded once
    x16, bias16 = x.bfloat16(), bias.bfloat16()
    wide = quant.quant_gemm(x16.float(), qw, bias16.float())
    assert torch.equal(quant.quant_gemm(x16, qw, bias16, torch.float32), wide)
    assert torch.equal(quant.quant_gemm(x16, qw, bias16), wide.bfloat16())


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_tiled_gemm_takes_every_row_count(fmt):
    """M = 1..70: every chunk size (1..8 rows, compiled apart) and every split into chunks"""
    qw = with_tiles(_weight(fmt, 21, 96, 9))
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(10))
    want = quant.quant_linear(x, qw)
    for m in range(1, 71):
        torch.testing.assert_close(quant.quant_gemm(x[:m], qw), want[:m], atol=1e-4, rtol=1e-5, msg=f"M={m}")


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
def test_tiled_gemm_reads_strided_rows_and_rejects_bad_input():
    qw = with_tiles(_weight("q4_1", 16, 64, 3))
    wide = torch.randn(3, 128)
    assert torch.equal(quant.quant_gemm(wide[:, :64], qw), quant.quant_gemm(wide[:, :64].contiguous(), qw))
    assert quant.quant_gemm(torch.zeros(0, 64), qw).shape == (0, 16)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        quant.quant_gemm(torch.randn(2, 32), qw)
    with pytest.raises(ValueError, match="no tiles"):
        quant.quant_gemm(torch.randn(2, 64), _weight("q4_1", 16, 64, 3))


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
def test_linear_takes_the_tiled_gemm_below_the_row_threshold():
    from pagemesh.workers.model.layers import DEQUANTIZE_MIN_ROWS, quantized_linear

    qw = with_tiles(_weight("q4_1", 40, 128, 5))
    bias = torch.randn(40)
    gen = torch.Generator().manual_seed(8)
    for m in (1, DEQUANTIZE_MIN_ROWS - 1):
        x = torch.randn(m, 128, generator=gen).bfloat16()
        assert torch.equal(quantized_linear(x, qw, bias, None), quant.quant_gemm(x, qw, bias))
    # fp32 activations at any row count
    x = torch.randn(DEQUANTIZE_MIN_ROWS + 3, 128, generator=gen)
    assert torch.equal(quantized_linear(x, qw, bias, None), quant.quant_gemm(x, qw, bias))
    # from the threshold: W widened to bf16, the dense model's linear bit for bit
    x = torch.randn(DEQUANTIZE_MIN_ROWS, 128, generator=gen).bfloat16()
    want = torch.nn.functional.linear(x, dequantize(qw).bfloat16(), bias.bfloat16())
    assert torch.equal(quantized_linear(x, qw, bias, None), want)


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
@pytest.mark.parametrize("fmt", ["int8", "q4_0"])
def test_kernels_sum_extreme_codes_exactly(fmt):
    """Codes at the ends of their range against activations of +-127 and +-126: the dot products
    saturate nowhere (AVX2's maddubs would at 2 * 255 * 127 if fed 8-bit codes whole). With d = 1,
    c = -128 (8-bit) or 0 (4-bit) and dx = 1 (every block's max |x| is 127) each output is an
    integer below 2^24, so the fp32 sums equal the integer reference whatever their order."""
    n, k, bits = 37, 96, 8 if fmt == "int8" else 4
    gen = torch.Generator().manual_seed(11)
    top = 255 if bits == 8 else 15
    codes = torch.tensor([0, 1, top - 1, top], dtype=torch.uint8)[torch.randint(0, 4, (n, k), generator=gen)]
    codes[0], codes[1] = top, 0  # whole rows at the ends
    x = torch.tensor([-127.0, -126.0, 126.0, 127.0])[torch.randint(0, 4, (9, k), generator=gen)]
    x[0], x[1] = 127.0, -127.0
    x[:, ::BLOCK] = 127.0  # max |x| of every block: dx = 1, the activations kept as they are
    halves = codes.reshape(n, -1, 2, 16)  # 4-bit: code j in byte j's low nibble, code j + 16 in its high one
    packed = codes if bits == 8 else halves[:, :, 0] | (halves[:, :, 1] << 4)
    ones = torch.ones(n, k // BLOCK, dtype=torch.float16)
    qw = QuantizedWeight(fmt, packed.reshape(n, -1).contiguous(), ones, ones * (-128.0 if bits == 8 else 0.0))
    assert torch.equal(unpack_codes(qw), codes)
    want = (x.long() @ codes.long().T - (128 * x.long().sum(1, keepdim=True) if bits == 8 else 0)).float()
    assert want.abs().max() < 2**24
    tiled = with_tiles(qw)
    for m in (1, 3, 4, 5, 8, 9):  # a chunk's tail, whole chunks and more
        assert torch.equal(quant.quant_linear(x[:m], qw), want[:m]), m
        assert torch.equal(quant.quant_gemm(x[:m], tiled), want[:m]), m
