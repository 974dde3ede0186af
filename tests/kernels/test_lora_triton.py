"""kernels/lora.py (Triton, interpreted on CPU) against each row's own adapter in plain torch."""

import pytest
import torch

from pagemesh.kernels import lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_adds_its_own_adapters_delta(dtype):
    gen = torch.Generator().manual_seed(0)
    slots_n, width, fan_in, fan_out = 3, 24, 200, 150  # neither a multiple of the blocks
    slots = torch.tensor([2, -1, 0, 2, 1])
    a = torch.randn(slots_n * width, fan_in, generator=gen).to(dtype)
    b = torch.randn(slots_n * width, fan_out, generator=gen).to(dtype)
    x = torch.randn(len(slots), fan_in, generator=gen).to(dtype)
    y = torch.randn(len(slots), fan_out, generator=gen).to(dtype)
    expected = y.float().clone()
    for r, s in enumerate(slots.tolist()):
        if s >= 0:
            part = slice(s * width, (s + 1) * width)
            expected[r] += (x[r].float() @ a[part].float().T) @ b[part].float()
    out = lora.lora_add_(y.clone(), x, a, b, slots, width)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    assert torch.equal(out[1], y[1])  # a base row is left as it is
