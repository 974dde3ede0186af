"""`--quantization none|int8|gguf`: which linear weights the model keeps quantized, and how.

    none   the dense weights as loaded (a GGUF is dequantized at load): today's path
    int8   every linear weight and the LM head rounded at load to int8 blocks of 32 with an fp16
           scale each (`pagemesh.kernels.quantized.quantize_int8`), from any checkpoint
    gguf   a GGUF's own Q4_0 / Q4_1 / Q8_0 blocks kept bit for bit; Q5_0, Q5_1 and the K-quants
           converted (kernels/gguf_conversions.py, one log line per route); a tensor of another
           type stays dense (bf16/fp32, dequantized as today), with a log line

The names themselves are `pagemesh.common.quantization.QUANTIZATIONS` (torch-free: the engine's
flags are parsed where no model is loaded).

The quantized weight sits in the linear's `packed` slot (`pagemesh.workers.model.layers.linear` runs the
quantized matmul for it) and the dense one is released; the token embedding keeps its dense
rows for the lookup (tied LM heads read the quantized copy).

Tensor and pipeline parallel: each rank quantizes (int8) or takes (gguf) its own shard, the
same blocks one rank would hold. A column-parallel linear (qkv, gate_up) holds rows of W, any
count; a row-parallel one (o_proj, down_proj) holds input columns, which must fall on blocks of
32 (else the load is refused naming the layer and the sizes: a block cannot be split); the LM
head is whole on every rank of the last stage, as the dense path's; a pipeline stage holds its
own layers' weights only.
"""

from __future__ import annotations

import logging

import torch

from pagemesh.kernels.gguf_conversions import fusable
from pagemesh.kernels.quantized import BLOCK, QuantizedWeight, concat_rows, quantize_int8, with_tiles, without_row_codes
from pagemesh.workers.model.layers import ColumnParallelLinear, RowParallelLinear, VocabEmbedding

log = logging.getLogger(__name__)


def quantize_int8_model(model) -> int:
    """Replace every linear weight (and the LM head) by its int8 blocks; returns how many.
    Weights whose input size is not a multiple of 32 stay dense."""
    done = 0
    for name, m in _linears(model):
        weight = m.weight.detach()
        if (
            isinstance(m, RowParallelLinear)
            and m.tp.world_size > 1
            and (weight.shape[1] * m.tp.world_size) % BLOCK == 0
        ):
            _check_row_shard("int8", name, m)
        if weight.shape[1] % BLOCK:
            log.info("quantization: %s stays dense (%d inputs, not a multiple of %d)", name, weight.shape[1], BLOCK)
            continue
        _install(m, quantize_int8(weight.cpu()).to(weight.device), release=not isinstance(m, VocabEmbedding))
        done += 1
    for m in model.modules():  # a mixture of experts' experts (workers/model/moe.py)
        if hasattr(m, "quantize_int8"):
            done += m.quantize_int8()
    return done


def install_gguf_weights(model, blocks: dict[str, QuantizedWeight]) -> int:
    """Put a GGUF's quantized tensors (by Hugging Face name, rows already in HF order) in place
    of the dense copies, sharded as the layers are. Returns how many linears run quantized."""
    done = 0
    for i, layer in zip(model.layer_range, model.layers, strict=True):  # a pipeline stage's layers
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        done += _install_column(attn.qkv_proj, [blocks.get(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        done += _install_row(p + "self_attn.o_proj", attn.o_proj, blocks.get(p + "self_attn.o_proj.weight"))
        if hasattr(mlp, "install_gguf"):  # a mixture of experts (workers/model/moe.py)
            done += mlp.install_gguf(blocks, p + "mlp.")
            continue
        done += _install_column(mlp.gate_up_proj, [blocks.get(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
        done += _install_row(p + "mlp.down_proj", mlp.down_proj, blocks.get(p + "mlp.down_proj.weight"))
    head_name = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    head = blocks.get(head_name)
    if head is not None and model.lm_head is not None:
        _install(model.lm_head, head.to(model.lm_head.weight.device), release=False)
        done += 1
        if model.lm_head is model.embed_tokens and model.embed_tokens.look_up_in_blocks():  # tied: one copy
            log.info("quantization gguf: the embedding is looked up in the LM head's blocks")
    return done


def _install_column(m: ColumnParallelLinear, parts: list[QuantizedWeight | None]) -> int:
    if any(p is None for p in parts):
        return 0
    parts = fusable(parts)  # a K-quant file mixes types within one fused weight
    shards = [p.rows(*m.tp.shard(size, "output")) for p, size in zip(parts, m.output_sizes)]
    _install(m, concat_rows(shards).to(m.weight.device), release=True)
    return 1


def _install_row(name: str, m: RowParallelLinear, weight: QuantizedWeight | None) -> int:
    if weight is None:
        return 0
    _check_row_shard("gguf", name, m)
    _install(m, weight.columns(m.in_start, m.weight.shape[1]).to(m.weight.device), release=True)
    return 1


def _check_row_shard(quantization: str, name: str, m: RowParallelLinear) -> None:
    """A row-parallel shard's input columns must fall on blocks of 32: ValueError naming the
    layer and the sizes otherwise (one block's codes share a scale and cannot be split)."""
    start, size = m.in_start, m.weight.shape[1]
    if start % BLOCK or size % BLOCK:
        full = size * m.tp.world_size
        raise ValueError(
            f"quantization {quantization}: {name} has {full} inputs, which tensor-parallel size "
            f"{m.tp.world_size} splits into {size} a rank (rank {m.tp.rank}: columns {start}:{start + size}), "
            f"not whole blocks of {BLOCK}; choose a size that divides {full} into multiples of {BLOCK}"
        )


def _install(m, qw: QuantizedWeight, release: bool) -> None:
    # a CPU weight also gets its copy tiled for the decode-batch GEMM (kernels.quantized.with_tiles)
    # and holds its codes there only (the row-major copy rebuilt from the tiles where read)
    m.packed = without_row_codes(with_tiles(qw)) if qw.codes.device.type == "cpu" else qw
    if release:
        m.weight.data = m.weight.data.new_empty(0)


def _linears(model):
    """(name, module) of every linear, named by the model's layer index (a pipeline stage's
    `layers[0]` is layer `layer_range.start`)."""
    for i, layer in zip(model.layer_range, model.layers, strict=True):
        for name, m in layer.named_modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                yield f"layers.{i}.{name}", m
    if model.lm_head is not None:  # a pipeline stage before the last has none
        yield "lm_head", model.lm_head


def permute_rows(qw: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    """Rows in `order` (the GGUF converter's Q/K row order undone)."""
    return QuantizedWeight(qw.format, qw.codes[order], qw.scale[order], qw.offset[order])
