"""The Triton weight-quantized matmul against dequantize-then-matmul (interpreter on CPU, small
shapes with tails in M, N and K; compiled on a GPU)."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize as gguf_quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(fmt: str, n: int, k: int):
    from pagemesh.kernels.quantized import from_gguf_blocks, quantize_int8

    w = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32) * 0.05
    if fmt == "int8":
        return quantize_int8(torch.from_numpy(w))
    return from_gguf_blocks(fmt.upper(), gguf_quantize(w, getattr(gguf.GGMLQuantizationType, fmt.upper())))


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(3, 70, 96)])  # tails: M in a tile of 16, N past one tile, half a K step
def test_triton_quant_matmul_matches_dequantize_then_matmul(fmt, dtype, m, n, k):
    from pagemesh.kernels.quant_matmul import quant_linear
    from pagemesh.kernels.quantized import dequantize

    qw = _weight(fmt, n, k).to(torch.device(DEVICE))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    bias = torch.randn(n).to(DEVICE)
    got = quant_linear(x, qw, bias, torch.float32)
    want = x.double() @ dequantize(qw).double().T + bias.double()
    # bf16: W is widened to bf16 before the product (an 8-bit code times its scale rounds there)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    assert quant_linear(x, qw).dtype == dtype
