"""When a sequence stops: a stop token (EOS unless ignored, or one of `stop_token_ids`), or its
length (max_tokens, or the context length); an embedding request once its prompt is pooled. Stop
strings are the tokenizer service's."""

from __future__ import annotations

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.scheduler import Scheduler
from pagemesh.workers.engine.sequence import Sequence


class StopRules:
    """The model's end tokens and context length; `check` finishes a sequence through the
    scheduler (which frees its pages)."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))

    def check(self, seq: Sequence) -> None:
        """Finish `seq` if its last token ends it."""
        token = seq.token_ids[-1]
        p = seq.sampling
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def pooled(self, seq: Sequence) -> None:
        """An embedding request's prompt has run and is pooled: it ends there."""
        self.scheduler.finish(seq, "pooled")
