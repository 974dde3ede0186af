"""GGUF Q5_0, Q5_1 and K-quant tensors in our layout (`pagemesh.kernels.gguf_conversions`) against gguf-py's
numpy dequantizers on synthetic blocks, the C matmul on the converted formats, and (where
bench/peers/llama_cpp.sh made one) a real Q4_K_M file served with `--quantization gguf`."""

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagemesh.kernels.cpu import quant
from pagemesh.kernels.gguf_conversions import GGUF_CONVERSIONS, from_gguf_converted, fusable
from pagemesh.kernels.quantized import concat_rows, dequantize, quantize_activations, unpack_codes

ROWS, K = 6, 512  # two K-quant super-blocks per row
Q = gguf.GGMLQuantizationType


def _k_blocks(type_name: str, seed: int) -> np.ndarray:
    """Random K-quant rows [ROWS, bytes]: random codes and 6-bit/int8 sub-scales, with the fp16
    super-block scales set to weights' magnitudes (random bytes there would be inf or NaN)."""
    rng = np.random.default_rng(seed)
    block_bytes = GGUF_CONVERSIONS[type_name][1]
    raw = rng.integers(0, 256, size=(ROWS, K // 256, block_bytes), dtype=np.uint8)
    d = (rng.uniform(1e-4, 2e-3, size=(ROWS, K // 256, 1))).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        raw[:, :, 208:210] = d
    else:
        dmin = (rng.uniform(1e-4, 2e-3, size=(ROWS, K // 256, 1))).astype(np.float16).view(np.uint8)
        raw[:, :, 0:2], raw[:, :, 2:4] = d, dmin
    return raw.reshape(ROWS, -1)


def _reference(type_name: str, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(blocks, getattr(Q, type_name)).reshape(ROWS, K).astype(np.float32))


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_q5_blocks_convert_exactly(type_name):
    w = np.random.default_rng(1).standard_normal((ROWS, K)).astype(np.float32) * 0.05
    blocks = gguf_quantize(w, getattr(Q, type_name))
    qw = from_gguf_converted(type_name, blocks)
    assert qw.format == "u8" and qw.shape == (ROWS, K) and int(qw.codes.max()) <= 31
    assert torch.equal(dequantize(qw), _reference(type_name, blocks))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quant_sub_blocks_keep_their_codes_and_round_only_the_scales(type_name):
    blocks = _k_blocks(type_name, seed=2)
    qw = from_gguf_converted(type_name, blocks)
    assert qw.format == GGUF_CONVERSIONS[type_name][0] and qw.shape == (ROWS, K)
    want, got = _reference(type_name, blocks), dequantize(qw)
    # d*sc and dmin*m are exact in fp32 and rounded to fp16 once: each moves by at most half an
    # fp16 ulp (2^-11 relative, or half the subnormal step 2^-25); a code of at most 31 scales it
    codes = torch.from_numpy(gguf_codes(type_name, blocks)).float()
    scale, offset = qw.scale.float().repeat_interleave(32, 1), qw.offset.float().repeat_interleave(32, 1)
    bound = codes * (scale.abs() * 2.0**-11 + 2.0**-25) + offset.abs() * 2.0**-11 + 2.0**-25
    assert ((got - want).abs() <= bound * 1.001).all()
    assert (got - want).abs().max() > 0  # the rounding is real (not bit-exact), and this bound is what it costs
    assert torch.equal(torch.from_numpy(gguf_codes(type_name, blocks)), unpack_codes(qw))


def gguf_codes(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """The unsigned codes as gguf-py decodes them: the dequantized value with d*sc = 1, dmin*m = 0
    (the scales' bytes replaced), [ROWS, K] uint8."""
    raw = blocks.reshape(ROWS, K // 256, -1).copy()
    raw[:, :, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d = 1
    raw[:, :, 2:4] = 0  # dmin = 0
    raw[:, :, 4:16] = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)  # every sc = 1, m = 0
    return gguf_dequantize(raw.reshape(ROWS, -1), getattr(Q, type_name)).reshape(ROWS, K).astype(np.uint8)


def test_q6_k_goes_to_int8_blocks_within_half_a_step():
    blocks = _k_blocks("Q6_K", seed=3)
    qw = from_gguf_converted("Q6_K", blocks)
    assert qw.format == "int8" and qw.shape == (ROWS, K)
    want, got = _reference("Q6_K", blocks), dequantize(qw)
    step = qw.scale.float().repeat_interleave(32, 1)  # max|w| / 127 per block of 32, in fp16
    assert ((got - want).abs() <= step * 0.5 * 1.01 + 1e-7).all()
    # int8 over a block of 32 is coarser than Q6_K's 16-element sub-blocks where the two halves'
    # scales differ: that is the cost of this route, bounded above
    assert (got - want).abs().max() > 0


def test_mixed_fused_parts_widen_to_one_byte_codes_exactly():
    w = np.random.default_rng(4).standard_normal((ROWS, K)).astype(np.float32) * 0.05
    parts = [
        from_gguf_converted("Q5_0", gguf_quantize(w, Q.Q5_0)),
        from_gguf_converted("Q4_K", _k_blocks("Q4_K", seed=5)),
        from_gguf_converted("Q6_K", _k_blocks("Q6_K", seed=6)),
    ]
    fused = concat_rows(fusable(parts))
    assert fused.format == "u8" and fused.shape == (3 * ROWS, K)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
    one = [parts[1], parts[1]]
    assert fusable(one) == one  # one format: left as it is (4-bit stays 4-bit)


@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q5_1"])
def test_cpu_kernel_on_converted_formats(type_name):
    if type_name == "Q5_1":
        w = np.random.default_rng(7).standard_normal((ROWS, K)).astype(np.float32) * 0.05
        qw = from_gguf_converted(type_name, gguf_quantize(w, Q.Q5_1))
    else:
        qw = from_gguf_converted(type_name, _k_blocks(type_name, seed=8))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(9))
    got = quant.quant_linear(x, qw).double()
    want = quantize_activations(x).double() @ dequantize(qw).double().T
    step = float(x.abs().max() / 127 * dequantize(qw).abs().max())  # one activation tie (test_quant_matmul)
    torch.testing.assert_close(got, want, atol=1e-4 + step, rtol=1e-4)


PEERS = Path(os.environ.get("PEERS_DIR", "/work/peers")) / "llama_cpp"
Q4_K_M = PEERS / "SmolLM2-135M-Instruct.Q4_K_M.gguf"


@pytest.mark.slow
@pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
@pytest.mark.skipif(
    not Q4_K_M.exists(), reason=f"no {Q4_K_M} (bench/peers/llama_cpp.sh perplexity 512 q4_k_m makes it)"
)
def test_a_q4_k_m_file_serves_quantized_and_agrees_with_its_dense_model(caplog):
    from pagemesh.bench.quantized import make_runner, prompt_logits, quality_texts
    from pagemesh.tests.default_model import tokenizer
    from pagemesh.workers.model import layers
    from pagemesh.workers.model.layers import ColumnParallelLinear, RowParallelLinear
    from pagemesh.workers.model.loader import load_model

    cpu = torch.device("cpu")
    with caplog.at_level("INFO", logger="pagemesh.workers.model.loader"):
        model = load_model(Q4_K_M, torch.bfloat16, cpu, quantization="gguf")
    routes = " ".join(r.getMessage() for r in caplog.records)
    assert "Q4_K tensors as q4_k" in routes and "Q6_K tensors as int8" in routes and "Q5_0 tensors as u8" in routes
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert all(m.packed is not None for m in linears) and {m.packed.format for m in linears} >= {"q4_k", "u8"}
    dense = load_model(Q4_K_M, torch.bfloat16, cpu)
    ids = tokenizer().encode(quality_texts()["license"])[:96]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "DEQUANTIZE_MIN_ROWS", 1 << 30)  # the decode path: int8 activations
        got = prompt_logits(make_runner(model, 96), ids)
    want = prompt_logits(make_runner(dense, 96), ids)
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agreement >= 0.88, agreement  # the floor of tests/unit/test_quantized_model.py
