"""A sparse mixture-of-experts block: a router picks each token's top-k experts, the experts run
grouped by expert, and the weighted sum of their outputs is the block's output.

    x [T, H] ──router──▶ logits [T, E] ──route()──▶ weights [T, k] (fp32), ids [T, k]
      │                                                   │
      └── rows sorted by expert id: x[token of row] ──▶ one gate_up GEMM, SiLU·up, one down GEMM
          per expert that has rows ──▶ × weight ──▶ summed back into each token's row ──▶ y [T, H]

Parallel ranks (`ParallelContext`):
  tensor parallel (default): every rank holds every expert, sharded as the dense MLP is
      (gate_up by output rows, down by input columns); each rank's y is a partial sum.
  expert parallel (`ParallelContext.expert_parallel`): rank r holds experts
      [r·E/N, (r+1)·E/N) whole and computes only the rows routed to them; its y is the
      contribution of its experts.
Either way one all-reduce of y, in `SparseMoE.forward`, completes every token's output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagemesh.kernels.quantized import BLOCK, QuantizedWeight, concat_rows, quantize_int8, with_tiles
from pagemesh.workers.model.layers import ParallelContext, RMSNorm, linear

Activation = Callable[[torch.Tensor], torch.Tensor]  # [R, 2I] (gate | up) -> silu(gate) * up [R, I]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top_k experts: (weights [T, k] fp32, ids [T, k] int64), heaviest first.

    The softmax is over all experts, in fp32 (as transformers' routers); `renormalize` divides
    the chosen k by their sum, which is the softmax over the top-k logits (Mixtral always;
    Qwen3-MoE when `norm_topk_prob`)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


ExpertWeights = torch.Tensor | Sequence[QuantizedWeight]  # [E_local, N, K] dense, or one quantized W per expert


def _expert_linear(rows: torch.Tensor, w: ExpertWeights, expert: int) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(rows, w[expert])
    return linear(rows, None, None, w[expert])  # the quantized matmul (workers/model/layers.py)


def grouped_experts(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
    act: Activation = silu_and_mul,
) -> torch.Tensor:
    """sum over each token's routes (expert e = ids - first_expert held here) of
    weight · down_e(act(gate_up_e(x))), [T, H] in x's dtype; routes to experts not held here
    (expert parallelism: another rank's) add nothing.

    x [T, H]; w13 [E_local, 2I, H] (gate rows, then up rows); w2 [E_local, H, I] (or, for
    quantized experts, one QuantizedWeight of those shapes per expert); weights [T, k] fp32;
    ids [T, k] int64 (global expert ids).

    The T·k routes are sorted by expert once; each expert that has routes runs one GEMM over its
    contiguous rows (one host read of the per-expert counts)."""
    num_tokens, top_k = ids.shape
    num_local = len(w13)
    local = (ids - first_expert).flatten()
    held = (local >= 0) & (local < num_local)
    order = torch.argsort(torch.where(held, local, num_local), stable=True)  # by expert, others last
    counts = torch.bincount(local[held], minlength=num_local).tolist()
    routes = order[: sum(counts)]
    token = routes // top_k
    rows = x[token]
    out = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            part = rows[start : start + count]
            out[start : start + count] = _expert_linear(act(_expert_linear(part, w13, expert)), w2, expert)
            start += count
    weighted = (out.float() * weights.flatten()[routes, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, weighted)


def every_expert(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
    act: Activation = silu_and_mul,
) -> torch.Tensor:
    """`grouped_experts`' result with no host synchronisation: every local expert over every
    row, each row weighted by its route to that expert (0 where it has none). E_local/k times the
    FLOPs, so only where a host read cannot be (a CUDA graph's capture: quantized experts in
    decode steps); the dense CUDA path is `kernels/fused_moe.py`, synchronisation-free itself."""
    y = torch.zeros_like(x)
    for expert in range(len(w13)):
        weight = (weights * (ids == expert + first_expert)).sum(dim=-1, keepdim=True)  # [T, 1]
        h = _expert_linear(act(_expert_linear(x, w13, expert)), w2, expert)
        y += (h.float() * weight).to(x.dtype)
    return y


def per_expert_loop(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
    act: Activation = silu_and_mul,
) -> torch.Tensor:
    """`grouped_experts`' result the way transformers computes it: for every expert, find its
    routes by comparing all T·k ids (no sort). The reference the grouped paths are measured and
    tested against."""
    y = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(ids == expert + first_expert)
        if token.numel():
            h = F.linear(act(F.linear(x[token], w13[expert])), w2[expert])
            y.index_add_(0, token, (h.float() * weights[token, slot, None]).to(x.dtype))
    return y


def expert_range(num_experts: int, tp: ParallelContext) -> range:
    """The experts this rank holds: all of them under tensor parallelism, its 1/N under expert
    parallelism."""
    if not tp.expert_parallel:
        return range(num_experts)
    start, count = tp.shard(num_experts, "num_experts")
    return range(start, start + count)


class SparseMoE(nn.Module):
    """forward(x [T, H], ctx) -> [T, H]: the routed experts' weighted sum, all-reduced over the
    tensor-parallel group (so every rank returns the whole output, as RowParallelLinear does).

    Weights as Hugging Face names them, stacked: `gate.weight` [E, H] (replicated),
    `w13` [E_local, 2·I_local, H] and `w2` [E_local, H, I_local]; `load_expert` takes one
    expert's full gate/up/down matrices and keeps this rank's part."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: ParallelContext,
    ):
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.num_experts = num_experts
        self.experts = expert_range(num_experts, tp)
        sharded = 1 if tp.expert_parallel else tp.world_size
        if intermediate_size % sharded:
            raise ValueError(
                f"expert intermediate size {intermediate_size} is not divisible by tensor-parallel size {sharded}"
            )
        self.local_intermediate = intermediate_size // sharded
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        n = len(self.experts)
        self.w13 = nn.Parameter(torch.empty(n, 2 * self.local_intermediate, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden_size, self.local_intermediate), requires_grad=False)
        # quantized experts in place of w13/w2 (`--quantization`): one weight per local expert
        self.quantized: tuple[list[QuantizedWeight], list[QuantizedWeight]] | None = None

    def load_expert(self, expert: int, part: str, weight: torch.Tensor) -> None:
        """Expert `expert`'s full `part` ('gate' [I, H], 'up' [I, H] or 'down' [H, I]); a rank
        keeps its slice of it, or nothing where expert parallelism puts the expert elsewhere."""
        if expert not in self.experts:
            return
        e, inter = expert - self.experts.start, self.local_intermediate
        start = 0 if self.tp.expert_parallel else self.tp.rank * inter
        if part == "down":
            self.w2.data[e].copy_(weight[:, start : start + inter])
        else:
            offset = 0 if part == "gate" else inter
            self.w13.data[e, offset : offset + inter].copy_(weight[start : start + inter])

    def load_stacked(self, name: str, weight: torch.Tensor) -> None:
        """transformers' in-memory layout (its modules' parameters, not a checkpoint's names):
        'gate_up_proj' [E, 2I, H] or 'down_proj' [E, H, I]."""
        inter = weight.shape[-1] if name == "down_proj" else weight.shape[1] // 2
        for expert in self.experts:
            if name == "down_proj":
                self.load_expert(expert, "down", weight[expert])
            else:
                self.load_expert(expert, "gate", weight[expert, :inter])
                self.load_expert(expert, "up", weight[expert, inter:])

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate), self.top_k, self.renormalize)
        if self.quantized is not None:  # a quantized matmul per expert (the C or Triton kernel)
            capturing = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            path = every_expert if capturing else grouped_experts
            y = path(x, *self.quantized, weights, ids, self.experts.start, ctx.ops.silu_and_mul)
        elif x.device.type == "cuda":
            from pagemesh.kernels.fused_moe import fused_moe

            y = fused_moe(x, self.w13, self.w2, weights, ids, self.experts.start)
        else:
            y = grouped_experts(x, self.w13, self.w2, weights, ids, self.experts.start, ctx.ops.silu_and_mul)
        # tensor parallel: partial sums over the expert's intermediate shards; expert parallel:
        # the contributions of this rank's experts. One all-reduce completes each token either way.
        return self.tp.all_reduce(y)

    # ---- quantized experts (workers/model/quantization.py) -------------------------------------
    def quantize_int8(self) -> int:
        """`--quantization int8`: every local expert's matrices rounded to int8 blocks of 32;
        returns how many (0, dense, where an input size is not a multiple of 32)."""
        if self.w13.shape[2] % BLOCK or self.w2.shape[2] % BLOCK:
            return 0
        self._install([quantize_int8(w.cpu()) for w in self.w13], [quantize_int8(w.cpu()) for w in self.w2])
        return 2 * len(self.experts)

    def install_gguf(self, blocks: dict[str, QuantizedWeight], prefix: str) -> int:
        """`--quantization gguf`: a GGUF's expert blocks, by the names the loader gives them
        (`{prefix}experts.{e}.{gate,up,down}_proj.weight`), this rank's part of each; returns how
        many matrices (0, dense, where the file holds some expert's matrix unquantized). A
        tensor-parallel shard of down_proj must fall on blocks of 32 (ValueError otherwise)."""
        from pagemesh.kernels.gguf_conversions import fusable

        inter = self.local_intermediate
        start = 0 if self.tp.expert_parallel else self.tp.rank * inter
        w13, w2 = [], []
        for expert in self.experts:
            gate, up, down = (blocks.get(f"{prefix}experts.{expert}.{p}_proj.weight") for p in ("gate", "up", "down"))
            if gate is None or up is None or down is None:
                return 0
            w13.append(concat_rows(fusable([gate.rows(start, inter), up.rows(start, inter)])))
            w2.append(down.columns(start, inter))
        self._install(w13, w2)
        return 2 * len(w13)

    def _install(self, w13: list[QuantizedWeight], w2: list[QuantizedWeight]) -> None:
        device = self.w13.device

        def placed(qw: QuantizedWeight) -> QuantizedWeight:  # a CPU weight gets its decode-GEMM tiles
            return with_tiles(qw) if device.type == "cpu" else qw.to(device)

        self.quantized = ([placed(q) for q in w13], [placed(q) for q in w2])
        self.w13.data = self.w13.data.new_empty(0)
        self.w2.data = self.w2.data.new_empty(0)

    # ---- checkpoint tensors -------------------------------------------------------------------
    def tensor_names(self, parts: dict[str, str]) -> set[str]:
        """The block's tensors in a checkpoint, relative to the block: `gate.weight` and, for every
        expert e and each HF name p of `parts` (HF name -> 'gate' | 'up' | 'down'),
        `experts.{e}.{p}.weight`."""
        names = {"gate.weight"}
        for expert in range(self.num_experts):
            names |= {f"experts.{expert}.{p}.weight" for p in parts}
        return names

    def load_tensor(self, name: str, t: torch.Tensor, parts: dict[str, str]) -> bool:
        """One of `tensor_names(parts)` into place (a checkpoint's per-expert tensors, as
        transformers' save_pretrained writes them); False: not one of this block's."""
        if name == "gate.weight":
            self.gate.data.copy_(t)
            return True
        pieces = name.split(".")
        if len(pieces) != 4 or pieces[0] != "experts" or pieces[2] not in parts or pieces[3] != "weight":
            return False
        expert = int(pieces[1])
        if expert >= self.num_experts:
            return False
        self.load_expert(expert, parts[pieces[2]], t)
        return True


class MoEDecoderLayer(nn.Module):
    """A pre-norm decoder layer whose MLP is `mlp` (a SparseMoE, or a dense MLP on the layers a
    family keeps dense): the `(x, residual, ctx) -> (x, residual)` contract of `causal_lm`."""

    def __init__(self, hidden_size: int, eps: float, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(self, x, residual, ctx):
        x, residual = self.input_layernorm(x, residual, ctx.ops)
        x = self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, residual, ctx.ops)
        return self.mlp(x, ctx), residual
