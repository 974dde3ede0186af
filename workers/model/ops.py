"""The model's non-attention math: Triton kernels on CUDA; on a CPU the C kernels of `pagemesh.kernels.cpu`
(plain torch where no C compiler is found, or PAGEMESH_CPU_KERNELS=0). Which one runs is chosen
once, with the attention backend, by `pagemesh.workers.engine.backend.select_backend`.

Both classes have the same methods; the model reaches them through `ForwardContext.ops`, so no
layer knows which device it runs on (attention goes through `ForwardContext.backend` the same way).

    rms_norm(x, residual, weight, eps) -> (normed, new_residual)   residual None: new_residual = x
    rope_tables(cos_sin_cache, positions, dtype) -> tables         once per step, for every layer
    rotary(q, k, tables) -> (q, k)                                 new tensors, inputs untouched
    silu_and_mul(x) -> out

`cos_sin_cache` is [max_positions, head_dim] fp32 with cos in the first half of the columns and
sin in the second, the layout of `pagemesh.kernels.rotary_embedding`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    """Plain torch with Hugging Face Llama's numerics (the CPU tests compare token for token):
    norm statistics in fp32, the weight applied after rounding back; RoPE in the model dtype."""

    def rms_norm(self, x, residual, weight, eps):
        if residual is not None:
            x = x + residual
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype), x

    def rope_tables(self, cos_sin_cache, positions, dtype):
        """(cos, sin), each [T, 1, head_dim] in `dtype`, gathered once per step."""
        half = cos_sin_cache.shape[1] // 2
        rows = cos_sin_cache[positions].unsqueeze(1)
        cos, sin = rows[..., :half], rows[..., half:]
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)

    def rotary(self, q, k, tables):
        """q: [T, H, D], k: [T, KVH, D], rotate-half layout."""
        cos, sin = tables
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuKernelOps:
    """The C kernels of `pagemesh.kernels.cpu`, with TorchOps' numerics (fp32 statistics, the model
    dtype's rounding after each op). `rotary` and `rms_norm` work in place: the rotated q/k are
    the projection's own memory, the residual stream is updated where it lies."""

    def __init__(self) -> None:
        import pagemesh.kernels.cpu

        self.kernels = pagemesh.kernels.cpu

    def rms_norm(self, x, residual, weight, eps):
        return self.kernels.add_rms_norm(x, residual, weight, eps)

    def rope_tables(self, cos_sin_cache, positions, dtype):
        return cos_sin_cache, positions  # the kernel reads each token's row itself

    def rotary(self, q, k, tables):
        cos_sin_cache, positions = tables
        return self.kernels.rotary_(q, k, positions, cos_sin_cache)

    def silu_and_mul(self, x):
        return self.kernels.silu_and_mul(x)


class TritonOps:
    """The Triton kernels of `kernels/`: fp32 math inside each kernel, one launch per op, no host
    synchronisation (so a decode step can be captured in a CUDA graph)."""

    def __init__(self) -> None:
        import pagemesh.kernels

        self.kernels = pagemesh.kernels

    def rms_norm(self, x, residual, weight, eps):
        if residual is None:
            return self.kernels.rms_norm(x, weight, eps), x
        return self.kernels.fused_add_rms_norm(x, residual, weight, eps)

    def rope_tables(self, cos_sin_cache, positions, dtype):
        return cos_sin_cache, positions  # the kernel gathers each token's row itself

    def rotary(self, q, k, tables):
        cos_sin_cache, positions = tables
        return self.kernels.rotary_embedding(positions, q, k, cos_sin_cache)

    def silu_and_mul(self, x):
        return self.kernels.silu_and_mul(x)


ModelOps = TorchOps | CpuKernelOps | TritonOps


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)
