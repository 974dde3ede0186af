"""A quantized model's decode-only step through `DecodeLayers` (every layer in one C call) gives
the Python layers' logits and KV pages, bit for bit: int8 and Q4_1 weights, a QKV bias, bf16 and
fp32, several sequences of different lengths on shared and partly filled pages."""

from __future__ import annotations

import pytest
import torch

from pagemesh.kernels import cpu
from pagemesh.kernels.cpu import quant
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.model.decode_layers import DecodeLayers
from pagemesh.workers.model.llama import ForwardContext

pytestmark = pytest.mark.skipif(
    not (cpu.available() and quant.available()), reason=f"CPU kernels did not build: {cpu.load_error()}"
)
PAGE = 4
CPU = torch.device("cpu")
PROMPTS = [[(7 * i + s) % 250 + 1 for i in range(n)] for s, n in enumerate((5, 12, 1))]
# 11 sequences: the tiled GEMM's rows in two chunks (of at most 8)
MANY_PROMPTS = [[(5 * i + s) % 250 + 1 for i in range(n)] for s, n in enumerate((5, 12, 1, 3, 9, 2, 7, 4, 6, 1, 10))]


def quantized_model(dtype: torch.dtype, fmt: str, layer_windows=None):
    import gguf
    from gguf.quants import quantize as gguf_quantize

    from pagemesh.common.model_config import ModelConfig
    from pagemesh.kernels.quantized import from_gguf_blocks, quantize_int8
    from pagemesh.workers.model.loader import build_random_model
    from pagemesh.workers.model.quantization import _install, _linears

    cfg = ModelConfig(
        architecture="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=True,
        layer_windows=layer_windows,
    )
    model = build_random_model(cfg, dtype, CPU, seed=5)
    for _, m in _linears(model):
        w = m.weight.detach().float()
        if fmt == "int8":
            qw = quantize_int8(w)
        else:
            qw = from_gguf_blocks("Q4_1", gguf_quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1))
        _install(m, qw, release=True)
    return model


def prefill(runner: ModelRunner, prompts=PROMPTS) -> list[list[int]]:
    """Every prompt's KV into the pool (one mixed step through the Python layers); the block tables."""
    tables, page = [], 1
    for p in prompts:
        n = (len(p) + 1 + PAGE - 1) // PAGE  # room for the decoded token
        tables.append(list(range(page, page + n)))
        page += n
    lens = [len(p) for p in prompts]
    md = AttentionMetadata.build(lens, lens, tables, PAGE, CPU, for_cpu=True, decode_gather=False)
    ids = torch.tensor([t for p in prompts for t in p])
    runner.model(ids, ForwardContext(runner.kv_cache, md, runner.attention, runner.ops), torch.tensor([0]))
    return tables


def decode(runner: ModelRunner, tables, fused: DecodeLayers | None, prompts=PROMPTS) -> torch.Tensor:
    lens = [len(p) + 1 for p in prompts]
    md = AttentionMetadata.build([1] * len(prompts), lens, tables, PAGE, CPU, for_cpu=True, decode_gather=False)
    ctx = ForwardContext(runner.kv_cache, md, runner.attention, runner.ops, decode_layers=fused)
    if fused is not None:
        assert fused.can_run(md, torch.empty(len(prompts), runner.model.config.hidden_size, dtype=runner.dtype))
    ids = torch.tensor([p[-1] for p in prompts])
    return runner.model(ids, ctx, torch.arange(len(prompts)))


def assert_fused_equals_python(runner: ModelRunner) -> None:
    """One decode step of PROMPTS through the Python layers, then again from the same pool
    through the fused call: the same outputs and the same pool bytes, and the step wrote K/V."""
    assert isinstance(runner.decode_layers, DecodeLayers)
    tables = prefill(runner)
    before = runner.kv_cache.clone()
    python = decode(runner, tables, None)
    after_python = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    fused = decode(runner, tables, runner.decode_layers)
    assert torch.equal(fused, python)
    assert torch.equal(runner.kv_cache.view(torch.uint8), after_python.view(torch.uint8))
    assert not torch.equal(after_python.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_fused_decode_step_equals_the_python_layers(dtype, fmt):
    runner = ModelRunner(quantized_model(dtype, fmt), 16, PAGE, CPU, cuda_graphs=False)
    assert_fused_equals_python(runner)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_fused_decode_step_over_an_fp8_pool_equals_the_python_layers(kv_dtype, fmt):
    """An fp8 pool: the C call writes and reads its bytes with each layer's scales, as the fp8
    attention backend's kernels do (workers/engine/fp8_attention.py)."""
    runner = ModelRunner(quantized_model(torch.bfloat16, fmt), 16, PAGE, CPU, cuda_graphs=False, kv_dtype=kv_dtype)
    assert_fused_equals_python(runner)


def test_the_fp8_kv_write_kernel_gives_torchs_bytes_for_every_bf16_value():
    """pm_write_kv_fp8 against `(x / scale).clamp(-max, max).to(fp8)` (the torch reference the
    pool's bytes were defined by), over every finite bf16 value and three scales."""
    import pagemesh.kernels.cpu as kernels

    heads, dim, page = 2, 64, 16
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every.float())]
    x = every[: every.numel() // (heads * dim) * heads * dim].view(-1, heads, dim)
    slots = torch.arange(x.shape[0], dtype=torch.int64)
    pages = -(-x.shape[0] // page)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for scale in (1.0, 0.37, 123.4567):
            scales = torch.full((2, heads), scale)
            got, want = (torch.zeros(pages, 2, page, heads, dim, dtype=fp8) for _ in range(2))
            kernels.write_kv(x, x.flip(0), got, slots, kv_scales=scales)
            kernels.write_kv_fp8_reference(x, x.flip(0), want, slots, scales)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (fp8, scale)


def test_the_fp8_kv_write_kernel_gives_torchs_bytes_for_fp32_values_at_every_rounding_edge():
    """fp32 rows (what an AVX2 CPU serves) through pm_write_kv_fp8's bit-level rounding: every fp8
    value and every midpoint between neighbours (the ties of round-to-nearest-even), each with the
    fp32 values up to 3 ulp either side, fp32 subnormals, signed zeros and random fp32 bit
    patterns, over a scale of 1 (the values themselves) and two others."""
    import pagemesh.kernels.cpu as kernels

    heads, dim, page = 2, 64, 16
    gen = torch.Generator().manual_seed(5)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
        values = codes[torch.isfinite(codes)].unique()  # sorted, -max .. max
        edges = torch.cat([values, (values[1:] + values[:-1]) / 2])  # midpoints: exact in fp32
        bits = edges.view(torch.int32)
        near = torch.cat([(bits + i).view(torch.float32) for i in range(-3, 4)])
        tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.17e-38])
        random = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=gen, dtype=torch.int32).view(torch.float32)
        x = torch.cat([near, tiny, random])
        x = x[torch.isfinite(x)]
        x = torch.cat([x, x[: -x.numel() % (heads * dim)]]).view(-1, heads, dim)
        slots = torch.arange(x.shape[0], dtype=torch.int64)
        pages = -(-x.shape[0] // page)
        for scale in (1.0, 0.37, 123.4567):
            scales = torch.full((2, heads), scale)
            got, want = (torch.zeros(pages, 2, page, heads, dim, dtype=fp8) for _ in range(2))
            kernels.write_kv(x, x.flip(0), got, slots, kv_scales=scales)
            kernels.write_kv_fp8_reference(x, x.flip(0), want, slots, scales)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (fp8, scale)


@pytest.mark.parametrize("tiled", [True, False])
def test_fused_decode_step_equals_the_python_layers_over_many_rows(tiled):
    """11 rows: the tiled GEMM in two row chunks; without tiles, the plain kernel (as
    layers.quantized_linear picks for a weight that has none). fp32: bf16 outputs can round two
    kernels' different sums to the same values."""
    from pagemesh.kernels.quantized import QuantizedWeight, row_codes
    from pagemesh.workers.model.quantization import _linears

    model = quantized_model(torch.float32, "q4_1")
    for _, m in _linears(model):
        assert m.packed.tiles is not None
        if not tiled:
            m.packed = QuantizedWeight(
                m.packed.format, row_codes(m.packed, slice(None)), m.packed.scale, m.packed.offset
            )
    runner = ModelRunner(model, 48, PAGE, CPU, cuda_graphs=False)
    tables = prefill(runner, MANY_PROMPTS)
    before = runner.kv_cache.clone()
    python = decode(runner, tables, None, MANY_PROMPTS)
    after_python = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    fused = decode(runner, tables, runner.decode_layers, MANY_PROMPTS)
    assert torch.equal(fused, python)
    assert torch.equal(runner.kv_cache, after_python)


def test_only_decode_steps_of_quantized_models_take_it():
    model = quantized_model(torch.bfloat16, "int8")
    runner = ModelRunner(model, 16, PAGE, CPU, cuda_graphs=False)
    x = torch.empty(2, 64, dtype=torch.bfloat16)
    mixed = AttentionMetadata.build([1, 3], [4, 3], [[1], [2]], PAGE, CPU, for_cpu=True, decode_gather=False)
    assert not runner.decode_layers.can_run(mixed, x)
    from pagemesh.workers.model.loader import build_random_model

    dense = build_random_model(model.config, torch.bfloat16, CPU)
    assert ModelRunner(dense, 16, PAGE, CPU, cuda_graphs=False).decode_layers is None


def test_fused_decode_step_honours_each_layers_sliding_window():
    """Layer 0 sees the last 3 positions, layer 1 the last 6: the C call passes each layer's window
    to the attention kernel as the Python layers do (and the windows change the logits)."""
    logits = {}
    for windows in ((3, 6), None):
        runner = ModelRunner(quantized_model(torch.float32, "int8", windows), 16, PAGE, CPU, cuda_graphs=False)
        assert [layer.window for layer in runner.decode_layers.layers] == list(windows or (0, 0))
        tables = prefill(runner)
        before = runner.kv_cache.clone()
        python = decode(runner, tables, None)
        runner.kv_cache.copy_(before)
        assert torch.equal(decode(runner, tables, runner.decode_layers), python)
        logits[windows] = python
    assert not torch.allclose(logits[(3, 6)][:2], logits[None][:2])  # 6 and 13 positions: past the windows
