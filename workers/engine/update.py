"""The update after a forward pass: sequences advance by the tokens that ran, sample their next
token from the logits (each row under its own sampling parameters), and stop when they should.

    logits rows: [ sampled rows, one per chunk that reaches its sequence's end ][ prompt-logprob rows ]
                   │ n > 1 after the prompt: the row is sampled once per choice (forks)
                   │ beam search: a request's rows go to `BeamSearch.step` together
    pooled rows: one per chunk of an embedding request that pools (workers/engine/pooling.py)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pagemesh.workers.engine.backend import Backend
from pagemesh.workers.engine.beam import BeamSearch
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.forks import Forks, SeqGenerators, skip_draws
from pagemesh.workers.engine.grammar_masks import GrammarMasks, PendingMasks, StepMasks
from pagemesh.workers.engine.model_input import pooled_rows
from pagemesh.workers.engine.pooling import take_pooled
from pagemesh.workers.engine.sampler import SampleRow, prompt_token_logprobs, sample
from pagemesh.workers.engine.scheduler import StepPlan
from pagemesh.workers.engine.sequence import EngineRequest, Sequence
from pagemesh.workers.engine.speculative import SpeculationStats
from pagemesh.workers.engine.stopping import StopRules

MAX_SPEC_COOLDOWN = 16  # decode steps a sequence whose drafts keep missing waits between proposals
Owner = tuple[Sequence, int, "torch.Generator | None"]  # (sequence, fork k, generator) of a sampled row


@dataclass
class Verification:
    """A speculating decode's K+1 sampled rows (`first` .. `first + K` in the step's sample
    list): row j samples the token after drafts[:j]. `generator_state`: a seeded sampled row's
    generator before its K+1 draws, rewound to after the draws of the tokens it keeps."""

    seq: Sequence
    first: int
    drafts: list[int]
    generator: torch.Generator | None
    generator_state: torch.Tensor | None


class StepUpdate:
    """Applies one step's logits to the plan's sequences. `requests` is the engine's table of live
    requests (read here, to find a sequence's request)."""

    def __init__(
        self,
        requests: dict[str, EngineRequest],
        blocks: BlockManager,
        backend: Backend,
        generators: SeqGenerators,
        forks: Forks,
        beams: BeamSearch,
        stops: StopRules,
        grammar_masks: GrammarMasks,
        speculation: SpeculationStats | None = None,
    ) -> None:
        self.speculation = speculation if speculation is not None else SpeculationStats()
        self.requests = requests
        self.blocks = blocks
        self.backend = backend
        self.generators = generators
        self.forks = forks
        self.beams = beams
        self.stops = stops
        self.grammar_masks = grammar_masks

    def apply(
        self,
        plan: StepPlan,
        logits: torch.Tensor,
        pooled: torch.Tensor | None = None,
        masks: PendingMasks | None = None,
    ) -> list[EngineRequest]:
        """logits: `ModelRunner.execute`'s rows for this plan; `pooled`: its embedding requests'
        rows (`launch(...).pooled`); `masks`: the grammar masks of its constrained rows, launched
        beside the forward pass (`GrammarMasks.launch`; None: filled here). Returns the requests
        that got tokens (or ended), in the order of their first sampled row, then the embedding
        requests that ended."""
        if masks is None:
            masks = self.grammar_masks.launch(plan, overlap=False)
        step_masks = masks.result() if masks is not None else None  # before any matcher moves on
        rows, logit_index, owners, beam_rows, num_sampled, verifications = self._advance(plan, step_masks)
        if num_sampled < logits.shape[0]:  # rows after the sampled ones are prompt positions
            with torch.inference_mode():
                self._collect_prompt_logprobs(plan, logits[num_sampled:])
        if logit_index != list(range(num_sampled)):
            logits_for_rows = logits[logit_index]
        else:  # each row sampled once (the usual step): no [rows, vocab] copy
            logits_for_rows = logits[:num_sampled]
        with torch.inference_mode():  # the model's logits are inference tensors; sampling edits them
            results = sample(logits_for_rows, rows, self.generators.default, self.backend) if rows else []
        touched: dict[str, EngineRequest] = {}
        # fork every sibling before any of them takes its token: a fork copies the parent's tokens
        targets = [
            seq if k == 0 else self.forks.fork(self.requests[seq.request_id], seq, seq.index + k, gen)
            for seq, k, gen in owners
        ]
        for (seq, _, _), target, (token, lp) in zip(owners, targets, results):
            if target.replay:  # a migrated request's token, made before: its draw is spent, the token given
                token = target.replay_token()
            else:
                if lp is not None:
                    target.cumulative_logprob += lp.logprob
                target.append_token(token, lp if seq.sampling.logprobs is not None else None)
            if target.grammar is not None:
                target.grammar.consume_token(token)
            self.stops.check(target)
            touched[seq.request_id] = self.requests[seq.request_id]
        for v in verifications:
            self._accept(v, results[v.first : v.first + len(v.drafts) + 1], logits.shape[1])
            touched[v.seq.request_id] = self.requests[v.seq.request_id]
        for request_id, items in beam_rows.items():
            req = touched[request_id] = self.requests[request_id]
            self.beams.step(req, [s for s, _ in items], logits[[r for _, r in items]].cpu())
        if pooled is not None:
            self._pool(plan, pooled, touched)
        return list(touched.values())

    def _pool(self, plan: StepPlan, pooled: torch.Tensor, touched: dict[str, EngineRequest]) -> None:
        """Each pooling chunk takes its row (in plan order); a request whose prompt has run ends.
        The rows come to the host at once: one copy a step, not one a request."""
        rows = iter(pooled.cpu())
        for chunk in plan.chunks:
            if chunk.seq.pooling is None or pooled_rows(chunk) is None:
                continue
            if take_pooled(chunk, next(rows)):
                self.stops.pooled(chunk.seq)
                touched[chunk.seq.request_id] = self.requests[chunk.seq.request_id]

    def _advance(self, plan: StepPlan, masks: StepMasks | None):
        """Mark the plan's tokens computed (publishing full pages to the prefix cache) and list
        the rows to sample: (rows, their logits row, owners, beam rows by request, sampled rows)."""
        rows: list[SampleRow] = []
        logit_index: list[int] = []
        owners: list[Owner] = []
        beam_rows: dict[str, list[tuple[Sequence, int]]] = {}
        verifications: list[tuple[Sequence, list[int], list[int]]] = []  # (seq, drafts, logits rows)
        row = -1
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens - len(chunk.drafts)  # drafts count once accepted
            seq.num_cached_pages = self.blocks.cache_full_pages(
                seq.block_table, seq.hash_token_ids, seq.num_cached_pages, seq.num_computed, seq.prefix_root
            )
            req = self.requests.get(seq.request_id)
            if req is not None and not req.prefill_only:  # a prefill hands every prompt page on
                self.blocks.free_passed(seq.block_table, seq.num_computed, seq.num_cached_pages)  # sliding windows
            if not chunk.samples or seq.pooling is not None:  # an embedding samples nothing: `_pool`
                continue
            if chunk.drafts:
                verifications.append((seq, chunk.drafts, list(range(row + 1, row + 2 + len(chunk.drafts)))))
                row += 1 + len(chunk.drafts)
                continue
            row += 1
            if seq.sampling.use_beam_search:
                beam_rows.setdefault(seq.request_id, []).append((seq, row))
                continue
            choices = self.forks.choices(seq) if seq.pending_forks else ((0, self.generators.get(seq)),)
            mask = masks.row(seq) if masks is not None else None  # (n > 1: every choice's, after the prompt)
            for k, gen in choices:
                rows.append(self.sample_row(seq, gen, mask=mask))
                logit_index.append(row)
                owners.append((seq, k, gen))
        # speculating rows go after the plain ones, so results[:len(owners)] stay the owners'
        planned: list[Verification] = []
        for seq, drafts, logit_rows in verifications:
            gen = self.generators.get(seq)
            state = gen.get_state() if gen is not None and not seq.sampling.greedy else None
            planned.append(Verification(seq, len(rows), drafts, gen, state))
            rows += [
                self.sample_row(seq, gen, drafts[:j], masks.row(seq, j) if masks is not None else None)
                for j in range(len(drafts) + 1)
            ]  # row j as `seq` samples after drafts[:j]: penalties count them, the grammar's mask follows them
            logit_index += logit_rows
        return rows, logit_index, owners, beam_rows, row + 1, planned

    def _accept(self, v: Verification, results: list, vocab_size: int) -> None:
        """Keep the drafts that equal what their row sampled, then the first sampled token that
        differs (or the bonus after the last draft).

        Exact for sampled rows too: row j draws its token t_j from the target distribution p_j
        (the sampler's race, with that position's own noise), and the draft d_j is kept iff
        t_j == d_j, which happens with probability p_j(d_j); when it is not, t_j is a draw from
        p_j without d_j, renormalised: the rejection sampler for a point-mass draft. A seeded
        row's generator is rewound to just after the draws of the tokens kept, so its tokens are
        those it draws without speculation, whatever the batch."""
        seq, drafts = v.seq, v.drafts
        accepted = 0
        while accepted < len(drafts) and results[accepted][0] == drafts[accepted]:
            accepted += 1
        self.speculation.record(len(drafts), accepted, seq.seq_id)  # and its acceptance estimate
        # a row whose drafts keep missing (free text) waits 1, 2, 4 .. 16 steps before the next
        # proposal, so it stops paying for verification where lookup does not work
        seq.spec_misses = 0 if accepted else seq.spec_misses + 1
        seq.spec_cooldown = min(MAX_SPEC_COOLDOWN, 1 << (seq.spec_misses - 1)) if seq.spec_misses else 0
        for token, lp in results[: accepted + 1]:
            if lp is not None:
                seq.cumulative_logprob += lp.logprob
            seq.append_token(token, lp if seq.sampling.logprobs is not None else None)
            if seq.grammar is not None:
                seq.grammar.consume_token(token)
            self.stops.check(seq)
            if seq.finished:  # a stop token or max_tokens mid-draft: what follows is dropped (pages freed)
                return
        seq.num_computed += accepted  # the accepted drafts' K/V is written; the rejected positions' is not ours
        self.blocks.truncate(seq.block_table, seq.num_computed)
        seq.num_cached_pages = self.blocks.cache_full_pages(
            seq.block_table, seq.hash_token_ids, seq.num_cached_pages, seq.num_computed, seq.prefix_root
        )
        if v.generator_state is not None and accepted < len(drafts):
            v.generator.set_state(v.generator_state)
            skip_draws(v.generator, accepted + 1, vocab_size)

    def _collect_prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor) -> None:
        """The prompt logprobs of this step's chunks, from their rows after the sampled ones;
        they go out with the request's first token."""
        at = 0
        for chunk in plan.chunks:
            seq = chunk.seq
            positions = seq.prompt_logprob_positions(chunk.start, chunk.num_tokens)
            if positions:
                targets = seq.token_ids[positions.start + 1 : positions.stop + 1]
                seq.prompt_logprobs += prompt_token_logprobs(
                    logits[at : at + len(positions)], targets, seq.sampling.prompt_logprobs
                )
                at += len(positions)

    def sample_row(
        self,
        seq: Sequence,
        generator: torch.Generator | None,
        ahead: Seq[int] = (),
        mask: tuple[torch.Tensor, bool] | None = None,
    ) -> SampleRow:
        """What the sampler needs to know to pick `seq`'s next token; with `ahead` (draft tokens
        not appended yet), the token after them. `mask`: its grammar's bitmask there and whether
        the grammar is done (`StepMasks.row`; then only an end token may come, min_tokens or not)."""
        p = seq.sampling
        allowed, done = mask if mask is not None else (None, False)
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens + len(ahead) < p.min_tokens and not done:
            banned = tuple(sorted(self.stops.stop_ids(p)))
        # the token lists only feed penalties: no copies of long contexts per row and step without them
        repetition = p.repetition_penalty != 1.0
        prompt_ids = seq.token_ids[: seq.num_prompt_tokens] if repetition else []
        output_ids = seq.output_token_ids if repetition or p.frequency_penalty or p.presence_penalty else []
        if ahead and (repetition or p.frequency_penalty or p.presence_penalty):
            output_ids = output_ids + list(ahead)
        return SampleRow(p, prompt_ids, output_ids, generator, banned, allowed, want_logprob=not p.streams)
