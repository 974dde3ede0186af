"""Compile the kernel variants the launchers pick for sm_90 (H100 / H200), without a GPU.

The interpreter runs kernels on CPU but never lowers them, so a kernel can pass every
interpreter test and still fail to compile for a GPU. This script calls the real launchers
with CPU tensors, records each launch instead of running it, and compiles it through
`JITFunction.warmup` against a stand-in driver that reports an sm_90 target (triton's wheel
ships ptxas), with the same argument specialisation (alignment, divisibility by 16) a real
launch gets. One line per variant: registers, spilled stack bytes, shared memory, MMA kind.

    python tests/kernels/compile_sm90.py        # not under TRITON_INTERPRET; exit 1 on failure
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


class _Sm90Driver:
    """What JITFunction.run/warmup asks of a driver before it compiles."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


class _Recorder:
    def __init__(self, name, jit_fn, launches):
        self.name, self.jit_fn, self.launches = name, jit_fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, self.jit_fn, args, kwargs))


def record_launches() -> list:
    """Run every launcher over representative shapes; return the launches they made."""
    from pagemesh.kernels import activation, attention, fused_moe, kv_write, lora, norm, quant_matmul, rotary
    from pagemesh.kernels.attention import AttentionConfig
    from pagemesh.kernels.reference import rope_cos_sin_cache
    from pagemesh.kernels.testing import make_paged_batch

    launches: list = []
    for module, names in (
        (attention, ["_paged_attention_kernel", "_reduce_splits_kernel"]),
        (kv_write, ["_write_kv_kernel"]),
        (norm, ["_rms_norm_kernel"]),
        (rotary, ["_rotary_kernel"]),
        (activation, ["_silu_and_mul_kernel"]),
        (quant_matmul, ["_quant_matmul_kernel"]),
        (fused_moe, ["_moe_gemm_kernel"]),
        (lora, ["_lora_shrink_kernel", "_lora_expand_kernel"]),
    ):
        module.check_launchable = lambda *args: None
        for name in names:
            setattr(module, name, _Recorder(name, getattr(module, name), launches))

    def batch(query_lens, seq_lens, heads, kv_heads, dim, page, dtype):
        return make_paged_batch(
            query_lens,
            seq_lens,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=dim,
            page_size=page,
            dtype=dtype,
            device="cpu",
        )

    decode = batch([1] * 4, [100, 200, 300, 40], 32, 8, 128, 16, torch.bfloat16)
    mixed = batch([1, 1, 70], [100, 200, 90], 32, 8, 128, 16, torch.bfloat16)
    attention.paged_attention(*decode.attention_args(), num_splits=1)
    attention.paged_attention(*decode.attention_args(), num_splits=8)
    attention.paged_attention(*mixed.attention_args())
    for cfg in (
        AttentionConfig(64, 64, 4, 3),
        AttentionConfig(128, 64, 8, 2),
        AttentionConfig(128, 32, 8, 3),
        AttentionConfig(64, 32, 4, 3),
    ):
        attention.paged_attention(*mixed.attention_args(), config=cfg)
    smol = batch([1, 1, 40], [60, 9, 40], 9, 3, 64, 32, torch.float16)  # GQA 3, head_dim 64
    attention.paged_attention(*smol.attention_args())
    attention.paged_attention(*smol.attention_args(), num_splits=4)
    fp32 = batch([1, 30], [50, 30], 4, 4, 64, 16, torch.float32)
    attention.paged_attention(*fp32.attention_args())
    for variant in ({"window": 4096}, {"softcap": 50.0}, {"window": 4096, "softcap": 50.0}):  # SLIDING, SOFTCAP
        attention.paged_attention(*decode.attention_args(), num_splits=8, **variant)
        attention.paged_attention(*mixed.attention_args(), **variant)

    k = torch.randn(6, 8, 128, dtype=torch.bfloat16)
    kv_write.write_kv(k, k, decode.kv_layer[:, :, :, :8], torch.arange(6))
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):  # --kv-cache-dtype fp8_*: bf16 q over an fp8 pool
        args = list(decode.attention_args())
        args[1] = decode.kv_layer.to(fp8)
        scales = torch.ones(2, 8)
        attention.paged_attention(*args, num_splits=1, kv_scales=scales)
        attention.paged_attention(*args, num_splits=8, kv_scales=scales)
        args = list(mixed.attention_args())
        args[1] = mixed.kv_layer.to(fp8)
        attention.paged_attention(*args, kv_scales=scales)
        kv_write.write_kv(k, k, args[1][:, :, :, :8].contiguous(), torch.arange(6), kv_scales=scales)
    x = torch.randn(2, 4096, dtype=torch.bfloat16)
    norm.rms_norm(x, x[0], 1e-5)
    norm.fused_add_rms_norm(x, x.clone(), x[0], 1e-5)
    cache = rope_cos_sin_cache(128, 64, 10000.0, None, "cpu")
    qkv = torch.randn(3, 48, 128, dtype=torch.bfloat16)
    rotary.rotary_embedding(torch.arange(3), qkv[:, :32], qkv[:, 32:40], cache)
    activation.silu_and_mul(torch.randn(2, 2 * 14336, dtype=torch.bfloat16))
    from pagemesh.kernels.quantized import quantize_int8

    int8 = quantize_int8(torch.randn(256, 4096))
    q4 = type(int8)("q4_0", int8.codes[:, :2048].contiguous(), int8.scale, int8.offset)
    for qw in (int8, q4):
        for rows in (1, 64):
            quant_matmul.quant_linear(torch.randn(rows, 4096, dtype=torch.bfloat16), qw, torch.randn(256))
    for tokens in (4, 512):  # a decode batch (BLOCK_M 16) and a prefill chunk (BLOCK_M 64)
        ids = torch.randint(0, 8, (tokens, 2))
        x, weights = torch.randn(tokens, 2048, dtype=torch.bfloat16), torch.rand(tokens, 2)
        w13, w2 = torch.randn(8, 2 * 768, 2048, dtype=torch.bfloat16), torch.randn(8, 2048, 768, dtype=torch.bfloat16)
        fused_moe.fused_moe(x, w13, w2, weights, ids)
    fused_moe.fused_moe(torch.randn(4, 64), torch.randn(4, 64, 64), torch.randn(4, 64, 32), torch.rand(4, 2), ids[:4])
    for dtype in (torch.bfloat16, torch.float32):  # LoRA: q/k/v of a 4096-wide model, 8 slots of rank 16 x 3
        x, y = torch.randn(32, 4096, dtype=dtype), torch.randn(32, 6144, dtype=dtype)
        a, b = torch.randn(8 * 48, 4096, dtype=dtype), torch.randn(8 * 48, 6144, dtype=dtype)
        lora.lora_add_(y, x, a, b, torch.arange(32) % 9 - 1, 48)
    return launches


def resources(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        dump = subprocess.run(
            [str(CUOBJDUMP), "-res-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", dump)
    ptx = kernel.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "-")
    return f"REG:{usage.group(1)} STACK:{usage.group(2)} SMEM:{kernel.metadata.shared} MMA:{mma}"


def main(argv: list[str]) -> int:
    """`compile_sm90.py [SHARD SHARDS]`: compile every SHARDS-th variant from the SHARD-th (0 1:
    all), so that a test can run shards side by side, one a core."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_sm90: unset TRITON_INTERPRET (it compiles, not interprets)")
        return 2
    shard, shards = (int(argv[0]), int(argv[1])) if argv else (0, 1)
    driver.set_active(_Sm90Driver())
    failures = 0
    for i, (name, jit_fn, args, kwargs) in enumerate(record_launches()):
        if i % shards != shard:
            continue
        consts = {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")}
        label = f"{name} {args[3].dtype if name == '_paged_attention_kernel' else ''} " + " ".join(
            f"{k}={v}" for k, v in consts.items()
        )
        try:
            kernel = jit_fn.warmup(*args, grid=(1,), **kwargs)
            print(f"ok   {resources(kernel)}  {label}")
        except Exception as err:  # report every variant, then fail
            failures += 1
            print(f"FAIL {type(err).__name__}: {str(err)[:2000]}  {label}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
