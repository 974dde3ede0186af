"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode-only step (every sequence has one query token) of n sequences runs as the graph of the
smallest captured size b >= n. All sizes are captured when the runner is built (largest first,
so the smaller ones reuse its memory), never while serving, when other threads use the GPU too.
The n real rows come first; the b - n padding rows are dummy sequences on the null page (token
0 at position 0, seq_len 1, block table [0]): they write their K/V into page 0 slot 0, attend
to that one key, and their logits are dropped. Steps with prefill chunks, and batches larger
than the largest size, run eagerly.

    static inputs, allocated once (B = largest size)          one graph per size b
    input_ids, positions, slot_mapping  [B] int64       -->  model(input_ids[:b], ctx_b,
    seq_lens [B] int32, query_start_loc [B+1] = 0..B           logit_rows[:b]) -> logits [b, V]
    block_tables [B, pages of max_model_len] int32

A step copies its padded inputs into the first b rows (and the first `width` block-table
columns: stale columns past a sequence's length are never read) and replays. Attention in a
graph is launched with max_seq_len = max_model_len, so its split count, hence its grid, is the
same at every replay.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.model.llama import AttentionBackend, ForwardContext, LlamaForCausalLM
from pagemesh.workers.model.ops import ModelOps

NULL_PAGE = 0
PAD_TOKEN = 0

# capture(fn) -> (replay, out): after each replay(), `out` holds what fn() would have returned.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then every 8 up to 32, every 16 up to 128, every 32 beyond; max_batch included."""
    sizes = [1, 2, 4, *range(8, 32, 8), *range(32, 128, 16), *range(128, max_batch, 32)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows (None: too many for any graph)."""
    return next((s for s in sizes if s >= n), None)


@dataclass
class PaddedDecode:
    """A decode batch padded to a captured size: real rows first, then null-page rows."""

    token_ids: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]


def pad_decode_batch(
    token_ids: list[int], seq_lens: list[int], block_tables: list[list[int]], size: int
) -> PaddedDecode:
    pad = size - len(token_ids)
    if pad < 0:
        raise ValueError(f"{len(token_ids)} rows do not fit a graph of {size}")
    return PaddedDecode(
        token_ids + [PAD_TOKEN] * pad,
        seq_lens + [1] * pad,
        block_tables + [[NULL_PAGE]] * pad,
    )


class CudaGraphCapture:
    """`Capture` with real CUDA graphs; every size shares one memory pool (replays never overlap
    and each output is consumed before the next replay)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        fn()  # compiles the Triton kernels and sets up cuBLAS outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


class DecodeGraphs:
    """Runs decode-only steps from captured graphs. `run` returns fp32 logits [n, vocab] on the
    device, one row per sequence, in input order."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        ops: ModelOps,
        page_size: int,
        max_batch: int,
        max_model_len: int,
        capture: Capture | None = None,
    ):
        self.model, self.kv_cache, self.backend, self.ops = model, kv_cache, backend, ops
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.max_pages = -(-max_model_len // page_size)
        self.capture = capture or CudaGraphCapture()
        rows, device = self.sizes[-1], kv_cache.device
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, self.max_pages, dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(rows, dtype=torch.int64, device=device)
        self.replays: Counter[int] = Counter()  # steps run per size
        # The inputs now are all padding rows: capturing writes nothing but the null page.
        self.graphs = {size: self.capture(self._forward_fn(size)) for size in reversed(self.sizes)}

    def can_run(self, query_lens: list[int], block_tables: list[list[int]], num_logit_rows: int) -> bool:
        return (
            len(query_lens) <= self.sizes[-1]
            and num_logit_rows == len(query_lens)
            and all(q == 1 for q in query_lens)
            and max(len(t) for t in block_tables) <= self.max_pages
        )

    def run(self, token_ids: list[int], seq_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        n = len(token_ids)
        size = bucket_for(n, self.sizes)
        batch = pad_decode_batch(token_ids, seq_lens, block_tables, size)
        self._load(batch)
        replay, logits = self.graphs[size]
        replay()
        self.replays[size] += 1
        return logits[:n]

    def _load(self, batch: PaddedDecode) -> None:
        """Copy a padded batch into the first rows of the static inputs."""
        size = len(batch.token_ids)
        md = AttentionMetadata.build(
            [1] * size, batch.seq_lens, batch.block_tables, self.page_size, torch.device("cpu"), for_cpu=False
        )
        self.input_ids[:size].copy_(torch.tensor(batch.token_ids, dtype=torch.int64), non_blocking=True)
        self.positions[:size].copy_(md.positions, non_blocking=True)
        self.slot_mapping[:size].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:size].copy_(md.seq_lens, non_blocking=True)
        self.block_tables[:size, : md.block_tables.shape[1]].copy_(md.block_tables, non_blocking=True)

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        md = AttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_decodes=size,
            page_size=self.page_size,
        )
        ctx = ForwardContext(self.kv_cache, md, self.backend, self.ops)
        ids, rows = self.input_ids[:size], self.logit_rows[:size]
        return lambda: self.model(ids, ctx, rows)
