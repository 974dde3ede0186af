"""The executor boundary: what the model runner is told to do in one step, as plain data.

`build_model_input(plan)` flattens a `StepPlan` into a `ModelInput`: Python ints and lists only
(no `Sequence`, no tensors), so it can be sent as it is (msgpack) to the other ranks of a
tensor-parallel group or the next pipeline stage, and a speculative verifier can build one too.
Pure Python (no torch, no zmq: tests/unit/test_purity.py).

    plan.chunks  (seq, start, n)          ModelInput
    ─────────────────────────────         ──────────────────────────────────────────────────
    A decode   (A, 40, 1)         ──▶     token_ids    [a40 | b7 | c0 c1 c2 c3]
    B decode   (B, 7, 1)                  query_lens   [1, 1, 4]      seq_lens [41, 8, 4]
    C prompt   (C, 0, 4), samples         block_tables [A's, B's, C's pages]
                                          sample_rows  [0, 1, 5]      (then prompt-logprob rows)

An embedding request's chunk samples nothing: its rows' final-norm hidden states are summed
instead (`pool_spans`), its last row when it pools the last token, every row when it pools the mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import msgpack

from pagemesh.common.messages import Pooling

if TYPE_CHECKING:
    from pagemesh.workers.engine.scheduler import ScheduledChunk, StepPlan


@dataclass(frozen=True, slots=True)
class ModelInput:
    """One step of the model, in plan order (decodes first). Page moves run before the forward
    pass: swap_discard, swap_out, swap_in, then page_copies (see `ModelRunner.move_pages`).

    `block_tables` are the sequences' own lists, not copies (building this costs no more than
    the loop it replaces): a ModelInput is consumed within its step, before the engine's update
    grows or forks a table. Serialize it to keep it longer."""

    token_ids: list[int]  # [T] every chunk's tokens back to back
    query_lens: list[int]  # [S] tokens of each chunk
    seq_lens: list[int]  # [S] the sequence's context length after this step
    block_tables: list[list[int]]  # [S][pages] each sequence's pages
    sample_rows: list[int]  # rows of token_ids whose logits are sampled: the last of each sampling chunk,
    # every row of a speculating decode's chunk (its last token and K drafts: K+1 rows)
    prompt_logprob_rows: list[int]  # rows whose logits score a prompt token, chunk by chunk
    num_decodes: int = 0  # the first num_decodes rows are single-token decodes (verifying rows included)
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy-on-write before running
    swap_out: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq_id, pages) to host memory
    swap_in: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq_id, new pages) from host memory
    swap_discard: list[int] = field(default_factory=list)  # seq_ids whose host copy is no longer needed
    pool_spans: list[tuple[int, int]] = field(default_factory=list)  # [a, b) rows summed: one pooled row each
    lora_rows: list[int] = field(default_factory=list)  # [T] each row's LoRA slot (-1: base); []: no adapter rows
    lora_loads: list[tuple[int, str]] = field(default_factory=list)  # (slot, adapter folder) loaded before running
    # Images (workers/engine/encoder_cache.py): forgotten, then encoded, before the forward pass;
    # then rows [row, row + count) of token_ids take the image's embedding rows [first, first + count)
    image_drop: list[str] = field(default_factory=list)  # digests
    image_encode: list[tuple[str, bytes, list[int]]] = field(default_factory=list)  # (digest, file, grid)
    image_rows: list[tuple[int, str, int, int]] = field(default_factory=list)  # (row, digest, first, count)
    mrope_positions: list[list[int]] = field(default_factory=list)  # [3][T] (M-RoPE models' image steps); []: none

    @property
    def logit_rows(self) -> list[int]:
        """The rows the model returns logits for: sampled rows, then prompt-logprob rows."""
        return self.sample_rows + self.prompt_logprob_rows


def build_model_input(plan: StepPlan) -> ModelInput:
    """The plan's work for the runner: its tokens, lengths, block tables and logit rows (the
    prompt positions whose logprobs are asked for: `Sequence.prompt_logprob_positions`)."""
    token_ids: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    block_tables: list[list[int]] = []
    sample_rows: list[int] = []
    prompt_rows: list[int] = []
    pool_spans: list[tuple[int, int]] = []
    for chunk in plan.chunks:
        seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
        first = len(token_ids)
        if chunk.drafts:  # speculating decode: see `_verify_rows`
            _verify_rows(chunk, token_ids, query_lens, seq_lens, block_tables, sample_rows)
            continue
        query_lens.append(n)
        seq_lens.append(start + n)
        block_tables.append(seq.block_table)
        token_ids += seq.token_ids[start : start + n]
        if seq.pooling is not None:  # an embedding: pooled, never sampled
            pooled = pooled_rows(chunk)
            if pooled is not None:
                pool_spans.append((first + pooled.start, first + pooled.stop))
            continue
        if start + n == seq.num_tokens:  # chunk.samples
            sample_rows.append(first + n - 1)
        if seq.sampling.prompt_logprobs is not None:
            prompt_rows.extend(first + p - start for p in seq.prompt_logprob_positions(start, n))
    image_rows, needed = _image_rows(plan)
    verify_rows = sum(c.num_tokens for c in plan.chunks if c.drafts)  # right after the plain decodes
    lora_rows = []  # rows come chunk by chunk in plan order, a verifying chunk's too (num_tokens rows)
    if any(c.seq.lora_slot >= 0 for c in plan.chunks):
        lora_rows = [c.seq.lora_slot for c in plan.chunks for _ in range(c.num_tokens)]
    return ModelInput(
        token_ids,
        query_lens,
        seq_lens,
        block_tables,
        sample_rows,
        prompt_rows,
        plan.num_decodes + verify_rows,
        plan.page_copies,
        plan.swap_out,
        plan.swap_in,
        plan.swap_discard,
        pool_spans,
        lora_rows,
        plan.lora_loads,
        image_rows=image_rows,
        image_encode=needed,  # what the rows need; the engine keeps what its encoder cache holds
        mrope_positions=_mrope_rows(plan) if any(c.seq.mrope is not None for c in plan.chunks) else [],
    )


def _image_rows(plan: StepPlan) -> tuple[list[tuple[int, str, int, int]], list]:
    """Where this step's rows are an image's placeholders: (row, digest, the image's first
    embedding row there, count), and the images they need (ImageInput, once each, in order)."""
    rows: list[tuple[int, str, int, int]] = []
    needed: dict[str, object] = {}
    first = 0
    for chunk in plan.chunks:
        start, end = chunk.start, chunk.start + chunk.num_tokens
        for image in chunk.seq.images if not chunk.drafts else ():
            lo, hi = max(start, image.offset), min(end, image.offset + image.length)
            if lo < hi:
                rows.append((first + lo - start, image.digest, lo - image.offset, hi - lo))
                needed.setdefault(image.digest, image)
        first += chunk.num_tokens
    return rows, list(needed.values())


def _mrope_rows(plan: StepPlan) -> list[list[int]]:
    """Every row's (temporal, height, width) positions, chunk by chunk: an image prompt's own
    (common/multimodal.py MRopePositions), a text position p everywhere else (p on all three)."""
    out: list[list[int]] = [[], [], []]
    for chunk in plan.chunks:
        start, n = chunk.start, chunk.num_tokens
        if chunk.drafts:  # a verifying chunk's K+1 rows sit at start .. start + K
            n = len(chunk.drafts) + 1
        streams = chunk.seq.mrope.rows(start, n) if chunk.seq.mrope is not None else [list(range(start, start + n))] * 3
        for k in range(3):
            out[k] += streams[k]
    return out


def pooled_rows(chunk: ScheduledChunk) -> range | None:
    """The rows of an embedding request's chunk (counted from the chunk's first) whose hidden
    states it pools: a mean's every row, a last token's final row (in its prompt's last chunk);
    None when this chunk gives it nothing."""
    if chunk.seq.pooling is Pooling.MEAN:
        return range(chunk.num_tokens)
    return range(chunk.num_tokens - 1, chunk.num_tokens) if chunk.samples else None


def _verify_rows(
    chunk: ScheduledChunk,
    token_ids: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    sample_rows: list[int],
) -> None:
    """A speculating decode's last token and K drafts, as K+1 single-token rows over the same
    block table with context lengths start+1 .. start+K+1: the attention writes every row's K/V
    before any row reads, so row j sees the drafts before it and none after (causal), and the
    rows take the decode kernels' path (pages read in place) rather than a prefill chunk's.
    Every row is sampled."""
    seq, start = chunk.seq, chunk.start
    for j, token in enumerate([seq.token_ids[start], *chunk.drafts]):
        sample_rows.append(len(token_ids))
        token_ids.append(token)
        query_lens.append(1)
        seq_lens.append(start + j + 1)
        block_tables.append(seq.block_table)


_FIELDS = tuple(f.name for f in fields(ModelInput))


def encode_model_input(step: ModelInput) -> bytes:
    """The step as msgpack (a list of its fields in declaration order): what rank 0 of a
    tensor-parallel group broadcasts to the other ranks. No pickle: ints and lists only."""
    return msgpack.packb([getattr(step, name) for name in _FIELDS], use_bin_type=True)  # no deep copy


def decode_model_input(data: bytes) -> ModelInput:
    """Inverse of `encode_model_input` (pairs come back as 2-lists, which unpack the same way).
    Raises ValueError on anything that is not a ModelInput's shape: the bytes come from rank 0
    of the same worker, so this guards against a version skew, not a hostile peer."""
    values = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(values, list) or len(values) != len(_FIELDS):
        raise ValueError(f"model input: expected {len(_FIELDS)} fields, got {type(values).__name__}")
    return ModelInput(*values)
