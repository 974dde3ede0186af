"""Embedding requests in the engine: a prompt that runs as a prefill and ends as one vector.

    Engine.admit_embedding ──▶ Sequence(pooling) ──▶ prefill chunks, batched with anything else
      ──▶ each chunk's rows to pool (model_input.pooled_rows: a mean's every row, the last
          token's final row) ──▶ the model sums them after its final norm (workers/model/pooling.py)
      ──▶ `take_pooled`: last = that row; mean = the sum over every chunk / the prompt's length
      ──▶ L2-normalised into `seq.embedding`; the sequence ends ("pooled") and its pages go back

Nothing is sampled and no KV is kept for it past its step (its full pages stay in the prefix
cache, unreferenced, as any prompt's do). `embed` runs prompts to their vectors offline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from pagemesh.common.messages import Pooling
from pagemesh.workers.engine.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from pagemesh.workers.engine.engine import Engine


def take_pooled(chunk: ScheduledChunk, row: torch.Tensor) -> bool:
    """Add one chunk's pooled row ([hidden] fp32) to its sequence; True once its prompt has run
    whole, with `seq.embedding` set. A mean restarts at a chunk from position 0 (the sequence
    was preempted and is recomputed)."""
    seq = chunk.seq
    if seq.pooling is Pooling.MEAN:
        seq.pooled = row if chunk.start == 0 or seq.pooled is None else seq.pooled + row
        if not chunk.samples:
            return False
        row = seq.pooled / seq.num_prompt_tokens
    seq.embedding = torch.nn.functional.normalize(row, dim=0).tolist()
    seq.pooled = None
    return True


def embed(engine: Engine, prompts: Seq[str | Seq[int]], pooling: Pooling = Pooling.LAST) -> list[list[float]]:
    """Each prompt's embedding (text goes through the engine's tokenizer), run together."""
    ids = [f"embed-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        token_ids = engine.validator.prompt_ids(prompt)
        if len(token_ids) > engine.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens exceed the context length {engine.max_model_len}")
        engine.admit_embedding(rid, token_ids, pooling)
    vectors: dict[str, list[float]] = {}
    while len(vectors) < len(ids):
        vectors.update((out.request_id, out.embedding) for out in engine.step() if out.embedding is not None)
    return [vectors[rid] for rid in ids]
