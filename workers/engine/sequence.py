"""A sequence: one stream of tokens being generated, and the request that owns its siblings
(`EngineRequest`).

Pure Python (no torch, no zmq), as the scheduler that reads it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagemesh.common.messages import ImageInput, Pooling, TokenLogprob
from pagemesh.common.multimodal import MRopePositions, hash_token_ids
from pagemesh.common.sampling import SamplingParams

if TYPE_CHECKING:  # beam search's scores are torch code, a grammar's matcher llguidance's; here they are only carried
    from llguidance import LLMatcher

    from pagemesh.workers.engine.beam import BeamState

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens, KV pages and progress of one generated stream.

    `num_computed` tokens have their K/V in `block_table`'s pages; the rest of `token_ids` still
    has to run through the model. A sequence needs a sampled token when every known token is
    computed; decoding then means one new token per step.
    """

    request_id: str
    index: int  # choice index within the request (n > 1)
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_pages: int = 0  # leading pages published to the prefix cache
    num_prefix_hit_tokens: int = 0
    finish_reason: str | None = None
    pending_forks: int = 0  # siblings still to be forked off after the prompt (n > 1)
    new_token_ids: list[int] = field(default_factory=list)  # sampled since the last output
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled: float | None = None  # monotonic time of its first step
    swapped_computed: int | None = None  # swapped to host: num_computed to restore
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' logprobs (best_of, beams)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1, 2, ... so far
    grammar: LLMatcher | None = None  # structured outputs: where the output is in its grammar (grammar_masks.py)
    spec_misses: int = 0  # speculative decoding: verifying passes in a row that kept no draft
    spec_cooldown: int = 0  # decode steps to run without drafts before proposing again
    draft_kv: tuple[int, int] = (0, 0)  # draft model: (positions written to its pool, num_preemptions then)
    pooling: Pooling | None = None  # an embedding request: its prompt runs and is pooled, nothing is sampled
    pooled: object = None  # mean pooling: the fp32 sum of the hidden states so far (a torch tensor)
    embedding: list[float] | None = None  # the L2-normalised vector, once the prompt has run
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)
    lora_slot: int = -1  # the adapter's slot while it runs (workers/engine/lora_slots.py), else -1
    prefix_root: int | None = None  # its pages' root key in the prefix cache (an adapter's: page_hash.root_hash)
    images: list[ImageInput] = field(default_factory=list)  # a multimodal prompt's images, in order
    mrope: MRopePositions | None = None  # an M-RoPE model's image prompt (Qwen2-VL): its positions
    images_pending: set[str] = field(default_factory=set)  # digests whose rows an encoder worker sends: it waits
    images_wait_until: float = 0.0  # monotonic time after which it stops waiting and encodes them here
    # a migrated request's tokens still to decode again (an exact resume): each decode step
    # takes the next as its sampled token and reports nothing, so the K/V of each is computed by
    # a decode step as when it was first made (`StepUpdate`; no drafts meanwhile)
    replay: list[int] = field(default_factory=list)
    _prompt_hash_ids: list[int] | None = None

    @property
    def hash_token_ids(self) -> list[int]:
        """The ids its prefix-cache keys are computed over: its token ids, with each image's
        placeholders standing for the image's content (common/multimodal.py)."""
        if not self.images:
            return self.token_ids
        if self._prompt_hash_ids is None:
            self._prompt_hash_ids = hash_token_ids(self.token_ids[: self.num_prompt_tokens], self.images)
        return self._prompt_hash_ids + self.token_ids[self.num_prompt_tokens :]

    def prompt_logprob_positions(self, start: int, num_tokens: int) -> range:
        """Positions of a chunk [start, start + num_tokens) whose logits give a prompt token's
        logprob not collected yet (position p predicts prompt token p + 1)."""
        if self.sampling.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(start + num_tokens, self.num_prompt_tokens - 1))

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all collected: its prompt must run, not come from
        the prefix cache."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def skips_prefix_cache(self) -> bool:
        """Every prompt position must run here, none may come from the prefix cache (which
        keeps K/V only): its prompt logprobs are asked for, or it pools the mean."""
        return self.needs_prompt_logprobs or self.pooling is Pooling.MEAN

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """More than one token still to compute: a prompt (or a recompute after preemption)."""
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(self, token_id: int, logprobs: TokenLogprob | None) -> None:
        self.token_ids.append(token_id)
        self.new_token_ids.append(token_id)
        if logprobs is not None:
            self.new_logprobs.append(logprobs)

    def replay_token(self) -> int:
        """The next token to decode again, appended as given: streamed already, not reported."""
        token = self.replay.pop(0)
        self.token_ids.append(token)
        return token

    def take_new_tokens(self) -> tuple[list[int], list[TokenLogprob]]:
        ids, lps = self.new_token_ids, self.new_logprobs
        self.new_token_ids, self.new_logprobs = [], []
        return ids, lps


@dataclass
class EngineRequest:
    """One request inside the engine: its sequences (one per choice, or per live beam) and what
    has been reported of it. Sequences are appended as they fork (n > 1, best_of, beams)."""

    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    num_prompt_tokens: int
    finished_sent: set[int] = field(default_factory=set)  # choices whose finish was reported
    prefill_only: bool = False  # disaggregated prefill: keep the pages after the first token
    reported_queue_time: bool = False
    sent_prompt_logprobs: bool = False
    beam: BeamState | None = None  # beam search: finished hypotheses
    next_index: int = 1  # choice index of the next forked sequence

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs) and not any(s.pending_forks for s in self.seqs)
