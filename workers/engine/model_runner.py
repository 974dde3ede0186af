"""Runs one step through the model and owns the KV pool tensor.

Its input is a `ModelInput` (workers/engine/model_input.py): plain data built from the step plan,
no `Sequence` crosses into here. It decides nothing: which tokens run is the scheduler's call,
what to do with logits is the engine's.
"""

from __future__ import annotations

import torch

from pagemesh.common.gguf_file import drop_resident_pages
from pagemesh.kernels.cpu.memory import keep_freed_memory_for_reuse, release_freed_memory, zeroed_tensor
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.backend import Backend, select_backend
from pagemesh.workers.engine.cuda_graphs import DecodeGraphs
from pagemesh.workers.engine.fp8_attention import Fp8KVAttention, fp8_kernels_for
from pagemesh.workers.engine.kv_quant import AmaxRecorder, calibration_token_ids, is_fp8, scales_from_amax
from pagemesh.workers.engine.model_input import ModelInput
from pagemesh.workers.engine.pipeline_parallel import InFlightStep, StagePipe
from pagemesh.workers.engine.tensor_parallel import FollowerRanks
from pagemesh.workers.model.decode_layers import DecodeLayers
from pagemesh.workers.model.layers import make_batch_invariant, pack_linear_weights
from pagemesh.workers.model.llama import ForwardContext, LlamaForCausalLM
from pagemesh.workers.model.lora import ServedAdapters
from pagemesh.workers.model.pooling import PoolSpans

DEFAULT_MAX_GRAPH_BATCH = 256


class ModelRunner:
    """Holds the model and the KV pool `[layers, pages, 2, page_size, kv_heads, head_dim]`.

    The pool is in the model dtype, or in `kv_dtype` fp8 (`--kv-cache-dtype`): then its scales
    come from one calibration pass over `kv_calibration_ids` (`calibrate_kv_scales`) and attention
    goes through `Fp8KVAttention` (workers/engine/kv_quant.py, fp8_attention.py).

    `backend` (default: `select_backend` for the model's device and dtype) gives the attention
    backend and the ops (`self.attention`, `self.ops`) and says whether the linear weights are
    repacked once (`pack_linear_weights`); on a CPU glibc is told to keep freed activations
    (`keep_freed_memory_for_reuse`). On CUDA with `cuda_graphs`, decode-only steps of up to
    `max_num_seqs` sequences replay CUDA graphs (`DecodeGraphs`), everything else runs eagerly.
    `max_model_len` (default: the model's) sizes the graphs' block tables and fixes their attention split count.

    In a tensor-parallel worker the model holds this rank's shard and the pool this rank's KV
    heads; on rank 0, `followers` gets every step before it runs here, so that all ranks make
    the same page moves and meet in the same all-reduces (no CUDA graphs then).
    In a pipeline stage (`pipe`) the model and the pool hold the stage's layers only; activations
    come from the previous stage and go to the next, and rank 0 gets the logits back
    (workers/engine/pipeline_parallel.py).
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
        backend: Backend | None = None,
        followers: FollowerRanks | None = None,
        pipe: StagePipe | None = None,
        kv_dtype: torch.dtype | None = None,
        kv_calibration_ids: list[int] | None = None,
        lora: tuple[int, int, int] | None = None,
    ):
        """`lora`: (max_loras, max_lora_rank, max_cpu_loras) where LoRA adapters are served
        (workers/model/lora.py): a step's `lora_loads` fill slots, its `lora_rows` pick them."""
        cfg = model.config
        self.model = model
        self.followers = followers
        self.pipe = pipe
        self.device = device
        self.page_size = page_size
        self.dtype = model.dtype
        kv_heads = cfg.num_kv_heads // model.tp.world_size
        self.kv_dtype = kv_dtype or self.dtype
        kv_shape = (len(model.layers), num_pages, 2, page_size, kv_heads, cfg.head_dim)
        # on a CPU the pool's pages are zeroed by the kernel as they are first written, not all at start
        self.kv_cache = (
            zeroed_tensor(kv_shape, self.kv_dtype)
            if device.type == "cpu"
            else torch.zeros(kv_shape, dtype=self.kv_dtype, device=device)
        )
        self.kv_scales: torch.Tensor | None = None  # [layers, 2, kv_heads] fp32: an fp8 pool's scales
        # rank 0 of a parallel worker: every rank's scales, rank by rank (kv_relay.gather_kv_scales)
        self.rank_kv_scales: list[torch.Tensor] | None = None
        self.host_pages: dict[int, torch.Tensor] = {}  # swapped-out sequences' pages
        self.backend = backend or select_backend(device, self.dtype)
        self.attention, self.ops = self.backend.attention, self.backend.ops
        if self.backend.pack_linears:
            pack_linear_weights(model, amx=self.backend.amx)
        if self.backend.batch_invariant:
            make_batch_invariant(model)
        if device.type == "cpu":
            keep_freed_memory_for_reuse()
        if is_fp8(self.kv_dtype):
            ids = kv_calibration_ids or calibration_token_ids(None, cfg.vocab_size)
            self.kv_scales = self.calibrate_kv_scales(ids)
            self.attention = Fp8KVAttention(
                self.kv_cache, self.kv_scales, fp8_kernels_for(self.backend), self.backend.batch_invariant
            )
            self.rank_kv_scales = self._gather_rank_scales()
        # decode-only steps of a quantized model on a CPU: every layer in one C call
        self.decode_layers = (
            DecodeLayers.for_model(model, self.kv_cache, self.ops, self.attention, self.backend.batch_invariant)
            if device.type == "cpu" and followers is None and pipe is None
            else None
        )
        self.adapters = ServedAdapters(model, *lora) if lora is not None else None
        self.image_encoder = model.image_encoder  # a multimodal model's first stage: its vision side
        self.image_embeds: dict[str, torch.Tensor] = {}  # digest -> [placeholders, hidden]: the encoder cache
        drop_resident_pages()  # the GGUF file's pages loading touched: the weights are in tensors now
        if device.type == "cpu":
            release_freed_memory()  # what loading and repacking the model freed (kernels/cpu/memory.py)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda" and model.tp.world_size == 1 and pipe is None:
            self.graphs = DecodeGraphs(
                model,
                self.kv_cache,
                self.attention,
                self.ops,
                page_size,
                max_num_seqs,
                max_model_len or cfg.max_position_embeddings,
            )

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        return self.kv_cache[:, 0].numel() * self.kv_cache.element_size()

    def calibrate_kv_scales(self, token_ids: list[int]) -> torch.Tensor:
        """One forward pass of `token_ids` over a scratch pool of the model dtype, recording each
        head's K and V amax: the fp8 pool's scales [layers, 2, kv_heads] (kv_quant.py).
        In a parallel worker every rank runs it at once, after the worker's group is up: the
        pass meets the same all-reduces as a step, and a pipeline stage takes the previous
        stage's activations and sends its own on, so each rank gets its heads' scales of its
        layers, the values one rank would record for them."""
        num_layers, size, n = len(self.model.layers), self.page_size, len(token_ids)
        pages = -(-n // size)
        scratch = torch.zeros(
            num_layers, pages + 1, 2, size, *self.kv_cache.shape[-2:], dtype=self.dtype, device=self.device
        )
        md = AttentionMetadata.build(
            [n],
            [n],
            [list(range(1, pages + 1))],
            size,
            self.device,
            for_cpu=self.attention.builds_cpu_indices,
            decode_gather=self.attention.decode_gather,
        )
        recorder = AmaxRecorder(self.attention, num_layers, self.kv_cache.shape[-2])
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pipe = self.pipe
        with torch.inference_mode():
            hidden = None if pipe is None or pipe.first else pipe.receive_hidden(n)
            ctx = ForwardContext(scratch, md, recorder, self.ops)
            out = self.model(ids, ctx, torch.tensor([n - 1], device=self.device), hidden)
            if pipe is not None and not pipe.last:
                pipe.send_hidden(out)
        return scales_from_amax(recorder.amax, self.kv_dtype).to(self.device)

    def _gather_rank_scales(self) -> list[torch.Tensor] | None:
        """Every rank's fp8 scales on rank 0 (each rank calls this right after calibrating; the
        KV transfer sends and converts each rank's pages with that rank's scales); a single
        rank: its own. Followers get None."""
        tp, pp = self.model.tp.world_size, 1 if self.pipe is None else self.pipe.pp_size
        if tp * pp == 1:
            return [self.kv_scales]
        from pagemesh.workers.engine.kv_relay import gather_kv_scales

        return gather_kv_scales(self.kv_scales, self.model.config.num_layers, tp, pp)

    def move_pages(self, step: ModelInput) -> None:
        """Before the forward pass: swap preempted pages out to host memory (their page ids may
        be reused by this very step), bring resumed ones back, copy pages for copy-on-write."""
        for seq_id in step.swap_discard:
            self.host_pages.pop(seq_id, None)
        for seq_id, pages in step.swap_out:
            self.host_pages[seq_id] = self.kv_cache[:, pages].to("cpu", copy=True)
        for seq_id, pages in step.swap_in:
            self.kv_cache[:, pages] = self.host_pages.pop(seq_id).to(self.device)
        for src, dst in step.page_copies:
            self.kv_cache[:, dst].copy_(self.kv_cache[:, src])

    def execute(self, step: ModelInput) -> torch.Tensor:
        """Run one step (`build_model_input(plan)`); return fp32 logits for `step.logit_rows`:
        each sampled row in plan order, then the prompt-logprob rows, on the model's device (on
        CUDA a replayed graph's output buffer: read it before the next step). An embedding
        request's pooled rows come with `launch(step).pooled`."""
        return self.launch(step).result()

    def launch(self, step: ModelInput) -> InFlightStep:
        """Start one step. With pipeline stages, rank 0 returns once its stage is done and the
        activations are on their way; the logits follow from the last stage (`result()`), so
        that up to M steps can be in flight, each stage running a different one. Steps finish
        in launch order. (A stage that is not rank 0 gets no logits: an empty result.)"""
        if self.followers is not None:
            self.followers.send_step(step)
        self.move_pages(step)
        # adapter rows run the Python layers, eagerly: the fused C decode and CUDA graphs have no LoRA
        adapted = self.adapters is not None and self.adapters.prepare(step.lora_loads, step.lora_rows, self.device)
        if not step.token_ids:  # page moves only (a pipeline's preemption with nothing to run): on every rank
            return InFlightStep(torch.empty(0, 0))
        logit_rows = step.logit_rows
        images = bool(step.image_rows or step.mrope_positions)
        if (
            not adapted
            and not images
            and self.graphs is not None
            and not step.prompt_logprob_rows
            and not step.pool_spans
            and self.graphs.can_run(step.query_lens, step.block_tables, len(logit_rows))
        ):
            return InFlightStep(self.graphs.run(step.token_ids, step.seq_lens, step.block_tables))
        md = AttentionMetadata.build(
            step.query_lens,
            step.seq_lens,
            step.block_tables,
            self.page_size,
            self.device,
            for_cpu=self.attention.builds_cpu_indices,
            decode_gather=self.attention.decode_gather,
        )
        ids = torch.tensor(step.token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        rows = torch.tensor(logit_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        pool = PoolSpans.build(step.pool_spans, self.device) if step.pool_spans else None
        fused = None if adapted or images else self.decode_layers
        ctx = ForwardContext(self.kv_cache, md, self.attention, self.ops, decode_layers=fused, pool=pool)
        if images:
            self._place_images(step, ctx)
        pipe = self.pipe
        if pipe is None:
            return InFlightStep(self.model(ids, ctx, rows), pooled=ctx.pooled)
        hidden = None if pipe.first else pipe.receive_hidden(len(step.token_ids))
        out = self.model(ids, ctx, rows, hidden)
        if pipe.last:
            if pipe.sends_logits:
                pipe.send_logits(out)
            return InFlightStep(out)
        pipe.send_hidden(out)
        return pipe.expect_logits(len(logit_rows)) if pipe.rank == 0 else InFlightStep(out[:0, 0])

    def image_drop(self, digests: list[str]) -> None:
        for digest in digests:
            self.image_embeds.pop(digest, None)

    def _place_images(self, step: ModelInput, ctx: ForwardContext) -> None:
        """The encoder step: forget the images the engine's cache dropped, encode the new ones in
        one batched call, and give the forward pass each placeholder row's embedding (and an
        M-RoPE model's positions). Every rank does the same (the plan is in the step)."""
        for digest in step.image_drop:
            self.image_embeds.pop(digest, None)
        if step.image_encode and self.image_encoder is not None:
            rows = self.image_encoder.encode([(data, grid) for _, data, grid in step.image_encode])
            for (digest, _, _), embeds in zip(step.image_encode, rows, strict=True):
                self.image_embeds[digest] = embeds
        if step.image_rows and self.image_encoder is not None:
            index, values = [], []
            for row, digest, first, count in step.image_rows:
                index.extend(range(row, row + count))
                values.append(self.image_embeds[digest][first : first + count])
            ctx.image_rows = (torch.tensor(index, device=self.device), torch.cat(values))
        if step.mrope_positions:
            ctx.mrope_positions = torch.tensor(step.mrope_positions, dtype=torch.int64, device=self.device)
