"""Runs one step plan through the model: builds the flat batch, owns the KV pool tensor.

It decides nothing: which tokens run is the scheduler's call, what to do with logits is the
engine's.
"""

from __future__ import annotations

import logging

import torch

from kernels.cpu.memory import keep_freed_memory_for_reuse
from workers.engine.attention import (
    AttentionMetadata,
    paged_attention_torch,
    prefill_attention_torch,
    write_kv_torch,
)
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.scheduler import StepPlan
from workers.model.llama import ForwardContext, LlamaForCausalLM
from workers.model.layers import pack_linear_weights
from workers.model.ops import cpu_kernels_usable, ops_for

DEFAULT_MAX_GRAPH_BATCH = 256
log = logging.getLogger(__name__)  # stdlib: the engine imports without the mesh's packages


class TorchAttentionBackend:
    """The CPU path without a C compiler: gather pages with index ops, attend with torch SDPA."""

    builds_cpu_indices = True
    decode_gather = True

    def write_kv(self, k, v, kv_layer, md):
        write_kv_torch(k, v, kv_layer, md)

    def attend(self, q, kv_layer, md, scale, k=None, v=None):
        return paged_attention_torch(q, kv_layer, md, scale, k, v)


class CpuKernelAttentionBackend:
    """The CPU path: the C kernels of `kernels.cpu` write K/V into their slots and attend the
    decodes reading pages in place; prefill chunks (long query runs, where a matmul-based SDPA
    wins) gather their pages and use torch SDPA."""

    builds_cpu_indices = True
    decode_gather = False

    def __init__(self) -> None:
        import kernels.cpu

        self.kernels = kernels.cpu

    def write_kv(self, k, v, kv_layer, md):
        self.kernels.write_kv(k, v, kv_layer, md.slot_mapping)

    def attend(self, q, kv_layer, md, scale, k=None, v=None):
        nd = md.num_decodes
        if nd == q.shape[0]:
            return self.kernels.paged_attention(
                q, kv_layer, md.block_tables, md.seq_lens, md.query_start_loc, scale
            )
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.kernels.paged_attention(
                q[:nd], kv_layer, md.block_tables[:nd], md.seq_lens[:nd], md.query_start_loc[: nd + 1], scale
            )
        prefill_attention_torch(q, kv_layer, md, scale, out, k, v)
        return out


class TritonAttentionBackend:
    """The GPU path: the Triton kernels of `kernels/` read pages through block tables."""

    builds_cpu_indices = False
    decode_gather = False

    def __init__(self) -> None:
        import kernels

        self.kernels = kernels

    def write_kv(self, k, v, kv_layer, md):
        self.kernels.write_kv(k, v, kv_layer, md.slot_mapping)

    def attend(self, q, kv_layer, md, scale, k=None, v=None):  # reads K/V from the pages
        return self.kernels.paged_attention(
            q, kv_layer, md.block_tables, md.seq_lens, md.query_start_loc, scale, md.max_query_len, md.max_seq_len
        )


def make_attention_backend(device: torch.device, dtype: torch.dtype):
    if device.type == "cuda":
        return TritonAttentionBackend()
    if cpu_kernels_usable(dtype):
        return CpuKernelAttentionBackend()
    import kernels.cpu

    reason = kernels.cpu.load_error() or f"no C kernels for {dtype}"
    log.warning("cpu_kernels_unavailable (%s): attention falls back to torch SDPA over gathered pages", reason)
    return TorchAttentionBackend()


class ModelRunner:
    """Holds the model and the KV pool `[layers, pages, 2, page_size, kv_heads, head_dim]`.

    The device picks, once, the attention backend and the ops: Triton on CUDA; on a CPU the C
    kernels of `kernels.cpu` where they build (plain torch where they do not), linear
    weights repacked once (`pack_linear_weights`), and glibc told to keep freed activations
    (`keep_freed_memory_for_reuse`). On CUDA with `cuda_graphs`, decode-only steps of up to
    `max_num_seqs` sequences replay CUDA graphs (`DecodeGraphs`), everything else runs eagerly. `max_model_len` (default: the
    model's) sizes the graphs' block tables and fixes their attention split count.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_pages: int,
        page_size: int,
        device: torch.device,
        *,
        cuda_graphs: bool = True,
        max_num_seqs: int = DEFAULT_MAX_GRAPH_BATCH,
        max_model_len: int | None = None,
    ):
        cfg = model.config
        self.model = model
        self.device = device
        self.page_size = page_size
        self.dtype = model.embed_tokens.weight.dtype
        kv_heads = cfg.num_kv_heads // model.tp.world_size
        self.kv_cache = torch.zeros(
            cfg.num_layers, num_pages, 2, page_size, kv_heads, cfg.head_dim, dtype=self.dtype, device=device
        )
        self.host_pages: dict[int, torch.Tensor] = {}  # swapped-out sequences' pages
        self.backend = make_attention_backend(device, self.dtype)
        self.ops = ops_for(device, self.dtype)
        if device.type == "cpu":
            pack_linear_weights(model)
            keep_freed_memory_for_reuse()
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda":
            self.graphs = DecodeGraphs(
                model, self.kv_cache, self.backend, self.ops, page_size, max_num_seqs,
                max_model_len or cfg.max_position_embeddings,
            )

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        return self.kv_cache[:, 0].numel() * self.kv_cache.element_size()

    def move_pages(self, plan: StepPlan) -> None:
        """Before the forward pass: swap preempted pages out to host memory (their page ids may
        be reused by this very step), bring resumed ones back, copy pages for copy-on-write."""
        for seq_id in plan.swap_discard:
            self.host_pages.pop(seq_id, None)
        for seq_id, pages in plan.swap_out:
            self.host_pages[seq_id] = self.kv_cache[:, pages].to("cpu", copy=True)
        for seq_id, pages in plan.swap_in:
            self.kv_cache[:, pages] = self.host_pages.pop(seq_id).to(self.device)
        for src, dst in plan.page_copies:
            self.kv_cache[:, dst].copy_(self.kv_cache[:, src])

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the plan; return fp32 logits for each chunk that samples, in plan order, on the
        model's device (on CUDA a replayed graph's output buffer: read it before the next step).
        After them come the rows of prompt positions whose logprobs are asked for
        (`Sequence.prompt_logprob_positions`), chunk by chunk in plan order."""
        self.move_pages(plan)
        token_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        prompt_rows: list[int] = []
        for chunk in plan.chunks:
            first = len(token_ids)
            token_ids.extend(chunk.seq.token_ids[chunk.start : chunk.start + chunk.num_tokens])
            query_lens.append(chunk.num_tokens)
            seq_lens.append(chunk.start + chunk.num_tokens)
            if chunk.samples:
                logit_rows.append(len(token_ids) - 1)
            prompt_rows.extend(first + p - chunk.start for p in chunk.seq.prompt_logprob_positions(chunk.start, chunk.num_tokens))
        block_tables = [c.seq.block_table for c in plan.chunks]
        logit_rows += prompt_rows
        if self.graphs is not None and not prompt_rows and self.graphs.can_run(query_lens, block_tables, len(logit_rows)):
            return self.graphs.run(token_ids, seq_lens, block_tables)
        md = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, self.page_size, self.device,
            for_cpu=self.backend.builds_cpu_indices, decode_gather=self.backend.decode_gather,
        )
        ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        rows = torch.tensor(logit_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        ctx = ForwardContext(self.kv_cache, md, self.backend, self.ops)
        return self.model(ids, ctx, rows)
