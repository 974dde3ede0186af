"""Sibling sequences and their random streams: n > 1 and best_of (the prompt runs once, then each
choice is a copy-on-write fork of it), and beam search's forks (workers/engine/beam.py).

A seeded request draws choice i's tokens from its own generator, seeded `seed + i`, so its tokens
do not depend on what else is in the batch; unseeded rows draw from one default generator on
the sampler's device."""

from __future__ import annotations

import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.scheduler import Scheduler
from pagemesh.workers.engine.sequence import EngineRequest, Sequence


class SeqGenerators:
    """The default generator (on `device`) and each seeded sequence's own (on the host)."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.default = torch.Generator(device=device).manual_seed(seed)
        self.by_seq: dict[int, torch.Generator] = {}

    @staticmethod
    def new(params: SamplingParams, index: int) -> torch.Generator | None:
        """Choice `index`'s generator; None when the request has no seed."""
        if params.seed is None:
            return None
        return torch.Generator().manual_seed((params.seed + index) % 2**63)

    def start(self, seq: Sequence, draws_done: int = 0, vocab_size: int = 0) -> None:
        """Give `seq` its generator. `draws_done`: tokens it sampled before, elsewhere (a
        resumed request): the generator skips their draws (one vocabulary-wide row of
        exponentials each, as the sampler makes), so the next token is drawn as it would have
        been there. Only sampled (temperature > 0) tokens drew."""
        generator = self.new(seq.sampling, seq.index)
        if generator is not None and not seq.sampling.greedy:
            skip_draws(generator, draws_done, vocab_size)
        self.adopt(seq, generator)

    def adopt(self, seq: Sequence, generator: torch.Generator | None) -> None:
        if generator is not None:
            self.by_seq[seq.seq_id] = generator

    def get(self, seq: Sequence) -> torch.Generator | None:
        return self.by_seq.get(seq.seq_id)

    def drop(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.by_seq.pop(seq.seq_id, None)


class Forks:
    """Forks sequences over shared pages (the block manager's copy-on-write)."""

    def __init__(self, blocks: BlockManager, scheduler: Scheduler, generators: SeqGenerators) -> None:
        self.blocks = blocks
        self.scheduler = scheduler
        self.generators = generators

    def choices(self, seq: Sequence) -> list[tuple[int, torch.Generator | None]]:
        """Who samples from `seq`'s logits row this step, as (k, generator): `seq` itself (k = 0)
        and, right after the prompt of an n > 1 request, the siblings still to fork (k = 1..)."""
        out = [(0, self.generators.get(seq))]
        out += [(k, self.generators.new(seq.sampling, seq.index + k)) for k in range(1, seq.pending_forks + 1)]
        seq.pending_forks = 0
        return out

    def fork(self, req: EngineRequest, parent: Sequence, index: int, generator: torch.Generator | None) -> Sequence:
        """A sibling sharing every page of `parent` (copy-on-write); it diverges from here."""
        child = Sequence(
            parent.request_id,
            index,
            list(parent.token_ids),
            parent.num_prompt_tokens,
            parent.sampling,
            arrival_time=parent.arrival_time,
            block_table=self.blocks.fork(parent.block_table),
            num_computed=parent.num_computed,
            num_cached_pages=parent.num_cached_pages,
            num_prefix_hit_tokens=parent.num_prefix_hit_tokens,
            cumulative_logprob=parent.cumulative_logprob,
            prompt_logprobs=parent.prompt_logprobs,  # collected: a recompute does not redo them
            grammar=parent.grammar.deep_copy() if parent.grammar is not None else None,  # before the parent moves on
            lora=parent.lora,
            lora_slot=parent.lora_slot,  # add_running pins it once more
            prefix_root=parent.prefix_root,
            images=parent.images,
            mrope=parent.mrope,
        )
        self.generators.adopt(child, generator)
        req.seqs.append(child)
        self.scheduler.add_running(child)
        return child


def skip_draws(generator: torch.Generator, draws: int, vocab_size: int) -> None:
    """Advance a seeded row's host generator past `draws` sampled tokens: the sampler's race
    draws one fp32 row of `vocab_size` exponentials per token (workers/engine/sampler.py). Drawn
    row by row, as the sampler did, so the generator's state matches exactly."""
    row = torch.empty(vocab_size)
    for _ in range(draws):
        row.exponential_(generator=generator)
