"""The default model with `--quantization int8` and `gguf` picks the dense (bf16) model's greedy
next token at nearly every position of a short fixed set (bench/quantized.py measures the full
set, KL divergence and perplexity: docs/perf/quantization.md)."""

import argparse
import dataclasses

import pytest
import torch

from pagemesh.bench.quantized import PAGE, prompt_logits, quality_texts
from pagemesh.common.model_files import default_model_path
from pagemesh.common.quantization import resolve_quantization
from pagemesh.common.sampling import SamplingParams
from pagemesh.kernels.cpu import quant
from pagemesh.kernels.quantized import row_codes
from pagemesh.tests.default_model import tokenizer
from pagemesh.workers.engine.backend import select_backend
from pagemesh.workers.engine.config import (
    EngineConfig,
    add_engine_arguments,
    engine_args_to_argv,
    engine_config_from_args,
)
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.model import layers
from pagemesh.workers.model.layers import ColumnParallelLinear, RowParallelLinear
from pagemesh.workers.model.loader import load_model
from pagemesh.workers.model.quantization import quantize_int8_model

pytestmark = pytest.mark.skipif(not quant.available(), reason=f"quantized C kernel did not build: {quant.load_error()}")
POSITIONS = 96  # per text, four texts
# on the full set (2,776 positions) int8 agrees at 96.2%, gguf at 96.6%; on this short set (384)
# int8 at 93.5%, gguf at 94.3%: the floors leave room for a different CPU's rounding, not for a broken kernel (~0%)
FLOOR = {"int8": 0.88, "gguf": 0.88}
CPU = torch.device("cpu")
ALL = slice(None)  # every row (a weight keeps its codes in its tiles only: kernels.quantized.row_codes)


def _logits(model, integer_kernel: bool = True) -> torch.Tensor:
    """Every position's logits, teacher-forced in one forward per text; with `integer_kernel`
    every quantized linear takes the int8-activation kernel (the decode path: the prefill rows
    would otherwise widen W to bf16, `layers.DEQUANTIZE_MIN_ROWS`)."""
    # unpacked linears: the dense reference's weights stay readable for int8 rounding afterwards
    backend = dataclasses.replace(select_backend(CPU, torch.bfloat16), pack_linears=False)
    runner = ModelRunner(model, POSITIONS // PAGE + 2, PAGE, CPU, cuda_graphs=False, backend=backend)
    tok = tokenizer()
    with pytest.MonkeyPatch.context() as patch:
        if integer_kernel:
            patch.setattr(layers, "DEQUANTIZE_MIN_ROWS", 1 << 30)
        return torch.cat([prompt_logits(runner, tok.encode(t)[:POSITIONS]) for t in quality_texts().values()])


@pytest.fixture(scope="module")
def dense_model_and_logits():
    model = load_model(default_model_path(), torch.bfloat16, CPU)
    return model, _logits(model)


@pytest.mark.slow
def test_gguf_blocks_agree_with_the_dense_model(dense_model_and_logits):
    _, reference = dense_model_and_logits
    model = load_model(default_model_path(), torch.bfloat16, CPU, quantization="gguf")
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert all(m.packed is not None and m.packed.format == "q4_1" for m in linears)
    assert model.lm_head.packed.format == "q8_0" and all(m.weight.numel() == 0 for m in linears)
    # with their tiles: the agreement below is the tiled GEMM's (the decode-batch kernel)
    assert all(m.packed.tiles is not None for m in [*linears, model.lm_head])
    agreement = (_logits(model).argmax(-1) == reference.argmax(-1)).float().mean()
    print(f"gguf greedy agreement {agreement:.4f}")
    assert agreement >= FLOOR["gguf"], agreement
    # prefill rows widen the same blocks to bf16: the dense model's numbers, bit for bit (the
    # dense model is the GGUF dequantized at load, and both run F.linear on those bf16 weights)
    assert torch.equal(_logits(model, integer_kernel=False), reference)


@pytest.mark.slow
def test_int8_agrees_with_the_dense_model(dense_model_and_logits):
    model, reference = dense_model_and_logits
    assert quantize_int8_model(model) == 2 * len(model.layers) * 2 + 1  # qkv, o, gate_up, down; the head
    agreement = (_logits(model).argmax(-1) == reference.argmax(-1)).float().mean()
    print(f"int8 greedy agreement {agreement:.4f}")
    assert agreement >= FLOOR["int8"], agreement


def test_quantization_is_checked_where_it_is_configured():
    assert EngineConfig().quantization == "auto"  # resolved by the engine against its model: below
    with pytest.raises(ValueError, match="quantization: must be one of auto, none, int8, gguf"):
        EngineConfig(quantization="int4")
    # each rank holds its shard quantized (tests/integration/test_parallel_quantized.py)
    assert EngineConfig(quantization="gguf", tensor_parallel_size=3, pipeline_parallel_size=2).quantization == "gguf"
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--quantization", "gguf"])
    assert engine_config_from_args(args).quantization == "gguf"
    argv = engine_args_to_argv(args)  # what `pagemesh up` hands each worker
    assert argv[argv.index("--quantization") + 1] == "gguf"


def test_a_gguf_file_serves_its_own_blocks_unless_a_dtype_is_named(tmp_path):
    gguf, folder = default_model_path(), tmp_path
    assert resolve_quantization("auto", "auto", gguf) == "gguf"
    assert resolve_quantization("auto", "float32", gguf) == "none"  # the parity tests' exact fp32 weights
    assert resolve_quantization("auto", "bfloat16", gguf) == "none"  # the dense bf16 model: a flag away
    assert resolve_quantization("auto", "auto", folder) == "none"  # an HF folder: dense
    assert resolve_quantization("gguf", "float32", gguf) == "gguf"  # named: as given (fp32 activations)
    assert resolve_quantization("none", "auto", gguf) == "none"
    (tmp_path / "model.gguf").write_bytes(b"GGML")  # by its magic bytes, not its name
    assert resolve_quantization("auto", "auto", tmp_path / "model.gguf") == "none"


def test_the_default_engine_serves_the_embedded_gguf_quantized():
    engine = Engine(EngineConfig(num_pages=16))
    assert engine.config.quantization == "gguf"
    model = engine.runner.model
    assert model.lm_head.packed is not None and model.lm_head.packed.format == "q8_0"
    [out] = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3))
    assert len(out.token_ids[0]) == 3


def test_gguf_quantization_needs_a_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="must be a GGUF file"):
        load_model(tmp_path, torch.bfloat16, CPU, quantization="gguf")
    with pytest.raises(ValueError, match="quantization: must be one of"):
        load_model(default_model_path(), torch.bfloat16, CPU, quantization="int4")


def _shard(cfg, rank: int, size: int):
    from pagemesh.workers.model.layers import ParallelContext
    from pagemesh.workers.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM(cfg, ParallelContext(rank, size))
    model.init_random(0)
    return model


def test_a_pipeline_stage_takes_its_own_layers_gguf_blocks():
    """Stage 1 of 2 (layer 1 and the LM head) installs layer 1's blocks, not layer 0's: the GGUF's
    names are the model's, a stage's `layers[0]` is layer 1; tp rank 1 of 2 takes its shards."""
    from pagemesh.kernels.quantized import quantize_int8
    from pagemesh.workers.model.layers import ParallelContext
    from pagemesh.workers.model.llama import LlamaForCausalLM
    from pagemesh.workers.model.quantization import install_gguf_weights

    cfg = dataclasses.replace(_config(), num_layers=2, tie_word_embeddings=False)
    whole = LlamaForCausalLM(cfg)
    whole.init_random(0)
    blocks = {}
    for i, layer in enumerate(whole.layers):
        p = f"model.layers.{i}."
        w = layer.self_attn.qkv_proj.weight.detach()
        q, k, v = w.split([cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2)
        blocks |= {p + "self_attn.q_proj.weight": quantize_int8(q), p + "self_attn.k_proj.weight": quantize_int8(k)}
        blocks |= {p + "self_attn.v_proj.weight": quantize_int8(v)}
        blocks[p + "self_attn.o_proj.weight"] = quantize_int8(layer.self_attn.o_proj.weight.detach())
        blocks[p + "mlp.down_proj.weight"] = quantize_int8(layer.mlp.down_proj.weight.detach())
    blocks["lm_head.weight"] = quantize_int8(whole.lm_head.weight.detach())
    stage = LlamaForCausalLM(cfg, ParallelContext(1, 2), range(1, 2))
    assert install_gguf_weights(stage, blocks) == 4  # layer 1: qkv, o_proj, down_proj (no gate/up given); LM head
    o_proj = stage.layers[0].self_attn.o_proj.packed
    assert torch.equal(row_codes(o_proj, ALL), blocks["model.layers.1.self_attn.o_proj.weight"].codes[:, 64:])
    qkv = stage.layers[0].self_attn.qkv_proj.packed
    assert torch.equal(row_codes(qkv, slice(0, 64)), blocks["model.layers.1.self_attn.q_proj.weight"].codes[64:])
    assert stage.lm_head.packed is not None


def _config():
    from pagemesh.common.model_config import ModelConfig

    return ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=128,
        intermediate_size=192,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=32,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )


def test_a_row_parallel_shard_off_the_blocks_is_refused_naming_the_layer():
    """MLP of 192: tp 2 cuts down_proj's inputs into 96 (three blocks of 32) a rank, tp 4 into 48
    (a block and a half): refused, for int8 and for a GGUF's blocks, naming the layer."""
    from pagemesh.kernels.quantized import quantize_int8
    from pagemesh.workers.model.quantization import install_gguf_weights

    cfg = _config()
    whole = _shard(cfg, 0, 1)
    ok = _shard(cfg, 1, 2)
    assert quantize_int8_model(ok) == 5  # qkv, o, gate_up, down, the LM head
    assert ok.layers[0].mlp.down_proj.packed.shape == (128, 96)
    with pytest.raises(ValueError, match=r"int8: layers.0.mlp.down_proj has 192 inputs.*size 4.*48 a rank"):
        quantize_int8_model(_shard(cfg, 1, 4))
    blocks = {
        "model.layers.0.mlp.down_proj.weight": quantize_int8(whole.layers[0].mlp.down_proj.weight.detach()),
    }
    part = _shard(cfg, 2, 4)
    with pytest.raises(ValueError, match=r"gguf: model.layers.0.mlp.down_proj has 192 inputs.*columns 96:144"):
        install_gguf_weights(part, blocks)
    half = _shard(cfg, 1, 2)
    assert install_gguf_weights(half, blocks) == 1  # whole blocks: the second rank's are columns 96:192
    assert torch.equal(
        row_codes(half.layers[0].mlp.down_proj.packed, ALL), blocks["model.layers.0.mlp.down_proj.weight"].codes[:, 96:]
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: what a CPU without AMX serves
def test_a_tied_gguf_embedding_is_looked_up_in_the_heads_blocks_with_the_dense_tables_values(dtype):
    dense = load_model(default_model_path(), dtype, CPU).embed_tokens.weight  # the GGUF widened at load
    model = load_model(default_model_path(), dtype, CPU, quantization="gguf")
    embed = model.embed_tokens
    assert embed is model.lm_head and embed.weight.numel() == 0  # one copy of the table: the head's blocks
    assert embed.weight.dtype == dtype  # what the KV pool's sizing reads
    vocab = dense.shape[0]
    ids = torch.tensor([[0, 1, vocab - 1], [17, 17, 4242]])
    assert torch.equal(embed(ids), torch.nn.functional.embedding(ids, dense))
    assert torch.equal(embed(torch.arange(vocab)), dense)  # every row, bit for bit
    for bad in (torch.tensor([vocab]), torch.tensor([-1])):  # no wrap-around, as F.embedding
        with pytest.raises(IndexError):
            embed(bad)
    kept = load_model(default_model_path(), dtype, CPU)  # dense (no blocks): nothing to look up in
    assert kept.embed_tokens.look_up_in_blocks() is False and kept.embed_tokens.weight.shape == dense.shape
    kept.embed_tokens.packed = model.lm_head.packed  # blocks whose values differ from the table somewhere
    kept.embed_tokens.weight.data[0, 0] += 1.0
    assert kept.embed_tokens.look_up_in_blocks() is False and kept.embed_tokens.weight.shape == dense.shape
