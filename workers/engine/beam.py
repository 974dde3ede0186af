"""Beam search over the engine's sequences: every live beam is a Sequence; beams that continue
the same parent share its pages copy-on-write (`Forks.fork`).

One step of a request:  cumulative logprob of each beam + log_softmax of its next-token logits
→ the best 2W continuations overall → those ending in EOS become finished hypotheses, the best W
others become the next beams. The request ends when W hypotheses are finished and no live beam
can still beat the worst of them (or at max_tokens); the n best hypotheses are its choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagemesh.workers.engine.sampler import add_logit_bias
from pagemesh.workers.engine.sequence import EngineRequest, Sequence

if TYPE_CHECKING:
    from pagemesh.workers.engine.forks import Forks
    from pagemesh.workers.engine.scheduler import Scheduler
    from pagemesh.workers.engine.stopping import StopRules


@dataclass
class Hypothesis:
    score: float  # cumulative logprob / length ** length_penalty
    output_ids: list[int]
    cumulative_logprob: float
    finish_reason: str


@dataclass
class BeamState:
    """A beam-search request's finished hypotheses."""

    width: int
    length_penalty: float
    finished: list[Hypothesis] = field(default_factory=list)

    def score(self, cumulative: float, length: int) -> float:
        return cumulative / (max(length, 1) ** self.length_penalty)

    def add(self, output_ids: list[int], cumulative: float, reason: str) -> None:
        self.finished.append(Hypothesis(self.score(cumulative, len(output_ids)), output_ids, cumulative, reason))
        self.finished.sort(key=lambda h: -h.score)

    def done(self, live_best: float | None) -> bool:
        """W hypotheses finished and the best live beam's current score does not beat the worst
        of the best W (Hugging Face's `early_stopping=False` rule)."""
        if len(self.finished) < self.width:
            return False
        return live_best is None or live_best <= self.finished[self.width - 1].score

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]


@dataclass(frozen=True)
class Continuation:
    parent: Sequence
    token: int
    cumulative: float


def expand(
    beams: list[Sequence], logits: torch.Tensor, width: int, stop_ids: set[int], banned: set[int]
) -> tuple[list[Continuation], list[Continuation]]:
    """The next live beams (at most `width`) and the continuations that end (a stop token),
    best first. logits: [len(beams), vocab] fp32."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if banned:
        logprobs[:, sorted(banned)] = float("-inf")
    cumulative = torch.tensor([b.cumulative_logprob for b in beams], dtype=logprobs.dtype).unsqueeze(1) + logprobs
    k = min(2 * width, cumulative.numel())
    values, flat = cumulative.view(-1).topk(k)
    vocab = logprobs.shape[1]
    live: list[Continuation] = []
    ended: list[Continuation] = []
    for rank, (value, index) in enumerate(zip(values.tolist(), flat.tolist())):
        if value == float("-inf"):
            break
        c = Continuation(beams[index // vocab], index % vocab, value)
        if c.token in stop_ids:
            if rank < width:  # an ending only counts if it ranks among the best W
                ended.append(c)
        elif len(live) < width:
            live.append(c)
    return live, ended


class BeamSearch:
    """Extends beam-search requests by one token a step: forks the continuing beams, finishes
    the pruned ones, and ends the request as `BeamState.done` says (or at its length limit)."""

    def __init__(self, scheduler: Scheduler, forks: Forks, stops: StopRules) -> None:
        self.scheduler = scheduler
        self.forks = forks
        self.stops = stops

    def step(self, req: EngineRequest, beams: list[Sequence], logits: torch.Tensor) -> None:
        """logits: [len(beams), vocab] fp32 on the host, the beams' next-token rows."""
        p, state = req.params, req.beam
        stop = self.stops.stop_ids(p)
        banned = stop if beams[0].num_output_tokens < p.min_tokens else set()
        if p.logit_bias:  # the search scores the biased distribution
            add_logit_bias(logits, p.logit_bias)
        live, ended = expand(beams, logits, state.width, stop, banned)
        for c in ended:
            state.add(c.parent.output_token_ids + [c.token], c.cumulative, "stop")
        by_parent: dict[int, list[Continuation]] = {}
        for c in live:
            by_parent.setdefault(c.parent.seq_id, []).append(c)
        for parent in beams:
            continuations = by_parent.get(parent.seq_id)
            if not continuations:
                self.scheduler.finish(parent, "pruned")
                continue
            for c in continuations[1:]:  # siblings share the parent's pages copy-on-write
                child = self.forks.fork(req, parent, req.next_index, None)
                req.next_index += 1
                child.append_token(c.token, None)
                child.cumulative_logprob = c.cumulative
            parent.append_token(continuations[0].token, None)
            parent.cumulative_logprob = continuations[0].cumulative
        alive = [s for s in req.seqs if not s.finished]
        if alive and (alive[0].num_output_tokens >= p.max_tokens or alive[0].num_tokens >= self.stops.max_model_len):
            for s in alive:
                state.add(s.output_token_ids, s.cumulative_logprob, "length")
                self.scheduler.finish(s, "length")
        elif state.done(max((state.score(s.cumulative_logprob, s.num_output_tokens) for s in alive), default=None)):
            for s in alive:
                self.scheduler.finish(s, "pruned")
