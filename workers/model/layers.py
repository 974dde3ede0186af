"""Tensor-parallel building blocks (Megatron-style), written so the collective is visible.

    ColumnParallelLinear: W split by output rows; each rank computes its slice; no communication.
    RowParallelLinear:    W split by input columns; each rank computes a partial sum; all-reduce.

A column-parallel projection followed by a row-parallel one (attention: qkv -> o; MLP:
gate_up -> down) needs exactly one all-reduce per block. With world size 1 the all-reduce is a
no-op and the code path is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagemesh.kernels.quantized import QuantizedWeight, is_quantized
from pagemesh.workers.model.shm_allreduce import SharedMemoryAllReduce


@dataclass
class StageGroup:
    """The torch.distributed group of one pipeline stage's tensor-parallel ranks (global `ranks`).
    The model is built before the worker's process group is up, so `group` is filled in later
    (`pagemesh.workers.engine.tensor_parallel.init_group`)."""

    ranks: tuple[int, ...]
    group: object = None


@dataclass(frozen=True)
class ParallelContext:
    """Which shard of the weights and KV heads this process holds, and how its all-reduces
    travel: through `shared` memory where it was set up and the tensor fits (CPU ranks of one
    host: `pagemesh.workers.model.shm_allreduce`), else torch.distributed: the default group, or the
    stage's `group` in a pipeline-parallel worker (whose default group spans every stage)."""

    rank: int = 0
    world_size: int = 1
    shared: SharedMemoryAllReduce | None = field(default=None, compare=False)
    group: StageGroup | None = field(default=None, compare=False)
    # mixture-of-experts layers place whole experts on ranks instead of sharding each one
    # (`--enable-expert-parallel`; `pagemesh.workers.model.moe`); nothing else reads it
    expert_parallel: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            if self.shared is not None and self.shared.fits(x):
                self.shared.all_reduce(x)
            else:
                torch.distributed.all_reduce(x, group=None if self.group is None else self.group.group)
        return x

    def shard(self, size: int, name: str) -> tuple[int, int]:
        if size % self.world_size:
            raise ValueError(f"{name}={size} is not divisible by tensor-parallel size {self.world_size}")
        part = size // self.world_size
        return self.rank * part, part


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) for this rank's slice of W's rows. `output_sizes` lists fused sub-matrices
    (q, k, v or gate, up): each is sharded on its own and the shards are concatenated."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: ParallelContext):
        super().__init__()
        self.tp = tp
        self.output_sizes = output_sizes
        self.local_sizes = [tp.shard(size, "output")[1] for size in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False) if bias else None
        self.packed: PackedWeight | QuantizedWeight | None = None  # see pack_linear_weights, quantization.py
        self.lora = None  # LoRAWeights (pagemesh.workers.model.lora) where adapters are served
        self.batch_invariant = False  # each row's product independent of the others (make_batch_invariant)

    def load_part(self, part: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of full sub-matrix `part` into place."""
        start, size = self.tp.shard(self.output_sizes[part], "output")
        offset = sum(self.local_sizes[:part])
        self.weight.data[offset : offset + size].copy_(weight[start : start + size])
        if bias is not None:
            self.bias.data[offset : offset + size].copy_(bias[start : start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed, invariant=self.batch_invariant)
        return y if self.lora is None else self.lora.add_to(y, x)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T): the input arrives sharded by the column-parallel layer."""

    def __init__(self, in_features: int, out_features: int, tp: ParallelContext):
        super().__init__()
        self.tp = tp
        self.in_start, local_in = tp.shard(in_features, "input")
        self.weight = nn.Parameter(torch.empty(out_features, local_in), requires_grad=False)
        self.packed: PackedWeight | QuantizedWeight | None = None  # see pack_linear_weights, quantization.py
        self.lora = None  # LoRAWeights (pagemesh.workers.model.lora): a partial sum, like the base output
        self.batch_invariant = False  # as ColumnParallelLinear's

    def load(self, weight: torch.Tensor) -> None:
        self.weight.data.copy_(weight[:, self.in_start : self.in_start + self.weight.shape[1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.packed, invariant=self.batch_invariant)
        return self.tp.all_reduce(y if self.lora is None else self.lora.add_to(y, x))


@dataclass(frozen=True)
class PackedWeight:
    """A CPU bf16 weight repacked once (see pack_linear_weights): oneDNN's blocked layout, and
    the AMX tile layout of `pagemesh.kernels.cpu.amx_linear` where the CPU has AMX."""

    onednn: torch.Tensor
    amx: torch.Tensor | None = None


AMX_MAX_ROWS = 64  # up to here (decode steps) the AMX kernel streams each weight once; above, oneDNN


def rows_independent(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `linear` gives each row of `x` through `module` (a Column/RowParallelLinear) the same
    bits whatever rows come with it: on a CPU, its row-invariant kernels, and the quantized C
    kernels on fp32 rows (integer dot products per row, scaled in K's order; the bf16 rows of a
    prefill take oneDNN's GEMM, whose blocking may follow the row count)."""
    if x.device.type != "cpu":
        return False
    return module.batch_invariant or (is_quantized(module.packed) and x.dtype == torch.float32)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: PackedWeight | QuantizedWeight | None,
    out_dtype: torch.dtype | None = None,
    *,
    invariant: bool = False,
) -> torch.Tensor:
    """x W^T (+ b) in x's dtype, then cast to out_dtype if given; through a packed copy of W when
    there is one (the AMX kernel writes the widened values itself, no second pass), or the
    quantized matmul when W is held quantized (`pagemesh.workers.model.quantization`).
    `invariant`: each row's result is the same bits whatever rows come with it (`row_invariant_linear`)."""
    if invariant and x.device.type == "cpu":
        return row_invariant_linear(x, weight, bias, packed, out_dtype)
    if is_quantized(packed):
        return quantized_linear(x, packed, bias, out_dtype)
    if packed is not None and packed.amx is not None and x.shape[0] <= AMX_MAX_ROWS:
        import pagemesh.kernels.cpu

        return pagemesh.kernels.cpu.amx_linear(x, packed.amx, bias, out_dtype or x.dtype)
    if packed is None:
        y = F.linear(x, weight, bias)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return y if out_dtype is None else y.to(out_dtype)


def row_invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: PackedWeight | QuantizedWeight | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`linear` through one kernel at every row count, one whose sums for a row do not depend on
    the other rows (checked bit for bit, tests/unit/test_batch_invariance.py): the quantized
    GEMM (never the widened bf16 weight that `quantized_linear` takes from DEQUANTIZE_MIN_ROWS),
    the AMX kernel for a packed bf16 weight (never oneDNN, whose large-N products change with
    the row count). Anything else (fp32's MKL GEMM, bf16 without AMX tiles) runs row by row: the
    same one-row call for every row, slow but exact. The batch-invariant mode's linears
    (docs/perf/batch_invariance.md)."""
    import pagemesh.kernels.cpu

    if is_quantized(packed):
        import pagemesh.kernels.cpu.quant

        if packed.tiles is not None:
            return pagemesh.kernels.cpu.quant.quant_gemm(x, packed, bias, out_dtype)
        return pagemesh.kernels.cpu.quant.quant_linear(x, packed, bias, out_dtype)
    if packed is not None and packed.amx is not None:
        return pagemesh.kernels.cpu.amx_linear(x, packed.amx, bias, out_dtype or x.dtype)
    rows = [linear(x[i : i + 1], weight, bias, packed, out_dtype) for i in range(x.shape[0])]
    return torch.cat(rows) if rows else linear(x, weight, bias, packed, out_dtype)


def make_batch_invariant(model: nn.Module) -> int:
    """Turn every linear of `model` (and its LM head) to `row_invariant_linear`; returns how many."""
    count = 0
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabEmbedding)):
            m.batch_invariant = True
            count += 1
    return count


def pack_linear_weights(model: nn.Module, batch_hint: int = 32, *, amx: bool = False) -> bool:
    """On a CPU, repack every bf16 linear weight (and the LM head) once: for oneDNN's blocked
    layout, so that a matmul no longer reorders its weight on every call (~1.6x faster at decode
    batch sizes here), and, with `amx` (the backend's choice: the CPU has AMX), for
    `pagemesh.kernels.cpu.amx_linear`, which streams each weight once per decode step (~1.3x faster than
    oneDNN at 1-32 rows). oneDNN's results are bit-identical to F.linear; the AMX kernel's differ
    by one bf16 step in a rare value (<1%).
    The dense weights are released: call after loading; a model already packed (a second engine
    on it) is left as it is. fp32 keeps the dense path (its packed matmuls round differently from
    the HF reference). Returns whether the model's linears are packed."""
    modules = [
        m
        for m in model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and not is_quantized(m.packed)
    ]
    if modules and modules[0].packed is not None:
        return True
    if not modules or modules[0].weight.dtype != torch.bfloat16 or modules[0].weight.device.type != "cpu":
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(modules[0].weight.detach(), batch_hint)
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(1, probe.shape[1], dtype=torch.bfloat16), probe, None, "none", [], ""
        )
    except (RuntimeError, AttributeError):
        return False
    import pagemesh.kernels.cpu

    def pack(w: torch.Tensor) -> PackedWeight:
        tiles = pagemesh.kernels.cpu.amx_pack(w) if amx and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0 else None
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, batch_hint), tiles)

    for m in modules:
        m.packed = pack(m.weight.detach())
        m.weight.data = m.weight.data.new_empty(0)
    head = getattr(model, "lm_head", None)
    if head is not None and head.packed is None:
        head.packed = pack(head.weight.detach())
    return True


# From this many rows of bf16 activations (a prefill chunk, a batch of more than 64 sequences) a
# CPU quantized linear widens W to bf16 and runs the bf16 GEMM (oneDNN), whose results are the
# dense model's bit for bit; fewer rows (decode batches) take the integer kernels, with int8
# activations. With the weights streaming from memory the tiled integer GEMM is faster than
# widening at every row count measured (1.7x at 128-256 rows; the plain kernel only below ~24;
# docs/perf/quantization.md): the line is drawn at 64 sequences so that prompts keep the dense
# model's numbers.
DEQUANTIZE_MIN_ROWS = 65
# From this many rows a weight with tiles takes the tiled GEMM (pm_quant_gemm_tiles), below it the
# plain kernel (pm_quant_matmul): the tiled one was 1.2-1.35x faster even at one row here
TILED_MIN_ROWS = 1


def quantized_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype | None
) -> torch.Tensor:
    """x W^T (+ b) with W quantized: the C kernels on a CPU (below DEQUANTIZE_MIN_ROWS rows or for
    fp32 x: int8-rounded activations, through the tiled GEMM where the weight has its tiles; else
    W widened to bf16, exactly `dequantize`'s values, and the dense bf16 GEMM, so prefill matches
    the dense model's path), the Triton kernel on CUDA."""
    if x.device.type == "cuda":
        import pagemesh.kernels.quant_matmul

        return pagemesh.kernels.quant_matmul.quant_linear(x, qw, bias, out_dtype)
    import pagemesh.kernels.cpu.quant

    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] >= DEQUANTIZE_MIN_ROWS:
        y = _dequantized_linear(x, qw, None if bias is None else bias.to(x.dtype))
        return y if out_dtype is None else y.to(out_dtype)
    if qw.tiles is not None and (x.shape[0] >= TILED_MIN_ROWS or not qw.has_row_codes):
        return pagemesh.kernels.cpu.quant.quant_gemm(x, qw, bias, out_dtype)
    return pagemesh.kernels.cpu.quant.quant_linear(x, qw, bias, out_dtype)


DEQUANTIZE_TILE = 1 << 23  # weights widened at most this many values at a time (16 MB of bf16)


def _dequantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) through W widened to bf16; a large W (an LM head) in row tiles, so that the
    widened copy stays small."""
    import pagemesh.kernels.cpu.quant

    n, k = qw.shape
    if n * k <= DEQUANTIZE_TILE:
        return F.linear(x, pagemesh.kernels.cpu.quant.dequantize_bf16(qw), bias)
    step = max(1, DEQUANTIZE_TILE // k)
    y = x.new_empty(x.shape[0], n)
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = None if bias is None else bias[start:stop]
        y[:, start:stop] = F.linear(x, pagemesh.kernels.cpu.quant.dequantize_bf16(qw, start, stop), part)
    return y


class VocabEmbedding(nn.Module):
    """Token embedding; replicated on every rank (the vocabulary of small models is cheap)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)
        self.packed: PackedWeight | QuantizedWeight | None = None  # as the LM head: see pack_linear_weights
        self.batch_invariant = False  # as a linear's, for the LM head (make_batch_invariant)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.numel() == 0 and self.packed is not None:  # looked up in the quantized blocks
            return embedding_from_blocks(self.packed, ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def look_up_in_blocks(self) -> bool:
        """Drop the dense table where the LM head's quantized blocks (a tied GGUF head on a CPU)
        widen to exactly its values: each lookup then widens only its rows
        (`embedding_from_blocks`). Checked at load on EMBEDDING_CHECK_ROWS rows spread over the
        table (the widening is exact arithmetic, the same for every row: a different formula shows
        in nearly every row; tests/unit/test_quantized_model.py checks every row); False (the dense
        table kept) where any value differs."""
        qw, dense = self.packed, self.weight
        if not getattr(qw, "is_quantized_weight", False) or dense.device.type != "cpu":
            return False
        if tuple(dense.shape) != qw.shape or not dense.dtype.is_floating_point:
            return False
        rows = torch.arange(0, qw.shape[0], max(1, qw.shape[0] // EMBEDDING_CHECK_ROWS))
        rows[-1] = qw.shape[0] - 1  # the last row (a padded tile's) among them
        if not torch.equal(embedding_from_blocks(qw, rows, dense.dtype), dense[rows]):
            return False
        self.weight.data = dense.data.new_empty(0)  # its dtype stays: the KV pool's sizing reads it
        return True


EMBEDDING_CHECK_ROWS = 1024  # rows of a quantized embedding compared with its dense table at load


def embedding_from_blocks(qw, ids: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
    """The rows `ids` (token ids, or a run of rows) of a quantized table, widened in fp32
    (`kernels.quantized.dequantize`, the kernels' reference) and rounded to `dtype`: the values
    `VocabEmbedding.look_up_in_blocks` checked against the dense table."""
    from pagemesh.kernels.quantized import QuantizedWeight, dequantize, row_codes

    if isinstance(ids, slice):
        rows, shape = ids, (len(range(*ids.indices(qw.shape[0]))),)
    else:
        rows, shape = ids.reshape(-1), tuple(ids.shape)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= qw.shape[0]):  # as F.embedding: no wrap
            raise IndexError(f"embedding: ids outside 0..{qw.shape[0] - 1}")
    picked = QuantizedWeight(qw.format, row_codes(qw, rows), qw.scale[rows], qw.offset[rows])
    return dequantize(picked).to(dtype).view(*shape, qw.shape[1])


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused in: (x, residual) -> (norm(x + residual), x + residual).
    The math is the device's (`pagemesh.workers.model.ops`)."""

    identity_weight = 1.0  # the weight that leaves the normalised input as it is

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ops) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, residual, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: weights stored as w and applied as (1 + w), all of it in fp32 and rounded
    to the input's dtype once at the end, as Hugging Face's Gemma2RMSNorm/Gemma3RMSNorm; the same
    (x, residual) contract as RMSNorm. Plain torch on every device (its own numerics, not Llama's)."""

    identity_weight = 0.0

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype), x


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU over a fused [gate | up] row: gelu_tanh(gate) * up (HF's `gelu_pytorch_tanh`)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
