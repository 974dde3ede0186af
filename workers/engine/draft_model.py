"""Self-speculation: the served model's quantized weights propose, the full model verifies.

The draft has the target's architecture, so its KV cache is a second pool of the same shape
indexed by the same page ids: one block table per sequence addresses both.

    block_table  [ 7, 3, 12 ]                    (the scheduler's, the block manager's)
    target pool  kv[layer, page, ...]            written by the verifying step (ModelRunner)
    draft pool   draft_kv[layer, page, ...]      written here, by the draft's forwards

Allocation, copy-on-write, prefix sharing, freeing and rollback (`BlockManager.truncate`) are
the block manager's, for both pools at once: nothing here allocates or frees a page. A
copy-on-write is mirrored into the draft pool before the draft runs (`ModelInput.page_copies`).

The draft's pool is filled lazily, only for sequences that speculate: `Sequence.draft_kv` says
how many leading positions of the draft pool hold this sequence's K/V. When a sequence
speculates, the draft first runs the positions it has not seen (its whole prompt the first
time, the tokens the target emitted since then after that) as one chunk, then its K-1 draft
tokens one position at a time; every sequence of the step goes in one batch per round. Why
lazily rather than alongside every prefill chunk: a sequence that never speculates (a big
batch, a request that opted out, beam search, a prefill-only worker) costs the draft nothing,
the verifying step's batch is left as it is, and preemption, swap and a KV import from a
prefill worker need no draft counterpart: the count is dropped and the draft catches up.

A draft position is valid while the target agrees with it: after verification the target
keeps `num_computed` positions, so the draft's count is clamped to that (the first rejected
draft's K/V is overwritten by the catch-up of the token that replaced it). Pages the target
frees on rollback lie beyond the clamp, so the draft never reads a page it does not own.

Proposals are the draft's greedy tokens (argmax). The verifier treats them as point-mass
drafts (workers/engine/update.py), which keeps the target's distribution for sampled rows too.
"""

from __future__ import annotations

import copy
import logging

import torch

from pagemesh.workers.engine.backend import Backend
from pagemesh.workers.engine.model_input import ModelInput
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.engine.scheduler import ScheduledChunk, StepPlan
from pagemesh.workers.engine.sequence import Sequence
from pagemesh.workers.engine.speculative import PENDING_DRAFT, SpeculativeConfig
from pagemesh.workers.model.llama import LlamaForCausalLM
from pagemesh.workers.model.quantization import quantize_int8_model

log = logging.getLogger(__name__)


def draft_positions(seq: Sequence) -> int:
    """Leading positions of `seq` whose K/V in the draft pool is valid now: what the draft wrote,
    no further than the target kept, and nothing from before a preemption (its pages are gone)."""
    written, preemptions = seq.draft_kv
    return min(written, seq.num_computed) if preemptions == seq.num_preemptions else 0


class DraftProposer:
    """Runs the quantized draft over its own pool and fills the step plan's placeholder drafts.

    `model`: the draft (the target's architecture, quantized linears); `num_pages`, `page_size`:
    the target pool's; `backend`: the target's (same device and dtype)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        quantization: str,
        num_pages: int,
        page_size: int,
        device: torch.device,
        backend: Backend,
        max_model_len: int,
    ) -> None:
        self.quantization = quantization
        self.backend = backend
        self.runner = ModelRunner(
            model, num_pages, page_size, device, backend=backend, cuda_graphs=False, max_model_len=max_model_len
        )
        self.forwards = 0  # draft forward passes run (a round of a step is one)

    def propose(self, plan: StepPlan) -> None:
        """Replace the PENDING_DRAFT placeholders of the plan's speculating decodes by the draft's
        tokens, in place. Runs before the target's forward pass of the same plan: the scheduler
        has reserved every page the draft writes (the verifying chunk covers its positions)."""
        chunks = [c for c in plan.chunks if c.drafts and c.drafts[0] == PENDING_DRAFT]
        if not chunks:
            return
        # single-position catch-ups first: the attention backends take the leading decodes apart
        chunks.sort(key=lambda c: c.start + 1 - draft_positions(c.seq) > 1)
        tokens = self._run([(c, draft_positions(c.seq), c.start + 1) for c in chunks], page_copies=plan.page_copies)
        for c, token in zip(chunks, tokens):
            c.drafts[0] = token
        for j in range(1, max(len(c.drafts) for c in chunks)):
            # round j: draft j-1 (position start + j) proposes draft j
            live = [c for c in chunks if len(c.drafts) > j]
            tokens = self._run([(c, c.start + j, c.start + j + 1) for c in live], ahead=j)
            for c, token in zip(live, tokens):
                c.drafts[j] = token
        for c in chunks:  # positions start .. start + K - 1 written (the last draft's is not)
            c.seq.draft_kv = (c.start + len(c.drafts), c.seq.num_preemptions)

    def _run(
        self, rows: list[tuple[ScheduledChunk, int, int]], ahead: int = 0, page_copies: list | None = None
    ) -> list[int]:
        """One draft forward: for each (chunk, first, end), the sequence's positions first..end-1
        (a decode's known tokens, then its drafts so far: `ahead` of them); returns each row's
        greedy next token."""
        token_ids: list[int] = []
        query_lens, seq_lens, tables, sample_rows = [], [], [], []
        for chunk, first, end in rows:
            seq = chunk.seq
            known = seq.token_ids[first : min(end, seq.num_tokens)]
            drafted = chunk.drafts[max(0, first - seq.num_tokens) : end - seq.num_tokens] if ahead else []
            token_ids += known + drafted
            query_lens.append(end - first)
            seq_lens.append(end)
            tables.append(seq.block_table)
            sample_rows.append(len(token_ids) - 1)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        step = ModelInput(
            token_ids, query_lens, seq_lens, tables, sample_rows, [], num_decodes, list(page_copies or [])
        )
        with torch.inference_mode():
            logits = self.runner.execute(step)
            self.forwards += 1
            return self.backend.first_max(logits).tolist()


def load_draft_model(engine, config: SpeculativeConfig) -> LlamaForCausalLM:
    """The engine's model again, its linears quantized as `config.quantization` says: loaded from
    the engine's model file (a GGUF's own blocks for `gguf`), or, for an engine built around a
    model object (no path: tests), a copy of it rounded to int8."""
    from pagemesh.workers.model.loader import load_model

    if engine.model_path is not None:
        return load_model(engine.model_path, engine.runner.dtype, engine.device, quantization=config.quantization)
    if config.quantization != "int8":
        raise ValueError(
            "speculative_config: a draft_quantized engine built without a model path can only make an int8 draft"
        )
    model = copy.deepcopy(engine.runner.model)
    quantize_int8_model(model)
    return model


def attach_drafter(engine, config: SpeculativeConfig) -> DraftProposer:
    """The engine's `DraftProposer` for `config`, made (the draft loaded, its pool allocated) on
    first use and kept while the quantization stays the same."""
    drafter = getattr(engine, "drafter", None)
    if drafter is None or drafter.quantization != config.quantization:
        engine.drafter = None  # free the old pool before the new one is allocated
        model = load_draft_model(engine, config)
        pool = engine.runner.kv_cache.shape
        drafter = DraftProposer(
            model, config.quantization, pool[1], pool[3], engine.device, engine.backend, engine.max_model_len
        )
        log.info("speculative: draft_quantized, %s draft, K=%d", config.quantization, config.num_speculative_tokens)
    engine.drafter = drafter
    return drafter
