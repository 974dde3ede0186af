"""Disaggregated prefill: both ends of handing a request's KV pages from a prefill worker to a
decode worker (docs/design.md §1). The transfer itself is the worker's (workers/llm/handoff_out.py and
handoff_in.py, through the Engine's handoff API: kv_handoff.py).

    prefill side:  admit(prefill_only) → first token(s) sampled → `hold`: the prompt's pages
                   are kept (one reference) and the choices leave scheduling → `take` → transfer →
                   acknowledged: `keep` (the pages stay until the scheduler says the request
                   ended, or the oldest go past `max_kept_pages`), else `release`
                   a migrated request: `resend` holds its kept pages again → `take` → transfer
    decode side:   `import_request`: take pages, have the caller write them, start every choice
                   from its first token
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Container
from collections.abc import Sequence as Seq

from pagemesh.common.messages import ImageInput
from pagemesh.common.multimodal import MRopePositions, hash_token_ids
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.forks import SeqGenerators, skip_draws
from pagemesh.workers.engine.grammar_masks import GrammarMasks
from pagemesh.workers.engine.outputs import PrefillResult
from pagemesh.workers.engine.scheduler import Scheduler
from pagemesh.workers.engine.sequence import EngineRequest, Sequence
from pagemesh.workers.engine.stopping import StopRules
from pagemesh.workers.engine.validation import RequestValidator

# at most this share of a prefill worker's pool is kept for the resume of handed-off requests
KEPT_POOL_FRACTION = 0.25


class PrefillHandoff:
    """The prefilled requests this engine holds pages for (prefill side), and the import of
    requests prefilled elsewhere (decode side)."""

    def __init__(
        self,
        blocks: BlockManager,
        scheduler: Scheduler,
        validator: RequestValidator,
        grammar_masks: GrammarMasks,
        generators: SeqGenerators,
        stops: StopRules,
    ) -> None:
        self.blocks = blocks
        self.scheduler = scheduler
        self.validator = validator
        self.grammar_masks = grammar_masks
        self.generators = generators
        self.stops = stops
        self.held: dict[str, PrefillResult] = {}  # prefill-only requests awaiting transfer
        # handed off and acknowledged, kept for an exact resume should the decode worker die (the
        # scheduler aborts them here when the request ends), oldest first; at most `max_kept_pages`
        self.kept: OrderedDict[str, PrefillResult] = OrderedDict()
        self.kept_pages = 0
        self.max_kept_pages = int(blocks.num_usable_pages * KEPT_POOL_FRACTION)

    # ---- prefill side ---------------------------------------------------------------------
    def hold(self, req: EngineRequest) -> None:
        """Prefill-only: every choice has its first token. Unless all already stopped, keep the
        prompt's pages for the transfer and take the choices out of scheduling."""
        if all(s.finished for s in req.seqs):
            return
        first = req.seqs[0]
        table = self.blocks.fork(first.block_table[: -(-req.num_prompt_tokens // self.blocks.page_size)])
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "prefilled")
        self.held[req.request_id] = PrefillResult(
            req.request_id,
            first.token_ids[: req.num_prompt_tokens],
            table,
            [s.token_ids[-1] for s in sorted(req.seqs, key=lambda s: s.index)],
        )

    def take(self, request_id: str) -> PrefillResult | None:
        return self.held.get(request_id)

    def release(self, request_id: str) -> None:
        """The transfer is over (failed or timed out) or the request ended: free its pages,
        held or kept."""
        held = self.held.pop(request_id, None) or self._unkeep(request_id)
        if held is not None:
            self.blocks.free_table(held.block_table)

    def keep(self, request_id: str) -> None:
        """The transfer was acknowledged: the pages stay, as the decode worker first read them,
        for `resend`; the oldest kept are freed past `max_kept_pages` (none kept if that is 0)."""
        held = self.held.pop(request_id, None)
        if held is None:
            return
        self.kept[request_id] = held
        self.kept_pages += len(held.block_table)
        while self.kept and self.kept_pages > self.max_kept_pages:
            self.blocks.free_table(self._unkeep(next(iter(self.kept))).block_table)

    def resend(self, request_id: str, prompt_token_ids: Seq[int], kept_id: str = "") -> bool:
        """A migrated request: hold its kept pages (kept under `kept_id`, if it moved to this id)
        again for a transfer (`take`), as after its prefill; False (and nothing kept any more)
        unless they are of the same prompt."""
        kept = self._unkeep(kept_id or request_id)
        if kept is not None and list(kept.prompt_token_ids) == list(prompt_token_ids):
            self.held[request_id] = dataclasses.replace(kept, request_id=request_id)
            return True
        if kept is not None:
            self.blocks.free_table(kept.block_table)
        return False

    def release_kept(self) -> int:
        """Free every kept request's pages (a scheduler that does not know them: it restarted, or
        counted this worker lost); returns how many requests."""
        n = len(self.kept)
        while self.kept:
            self.blocks.free_table(self._unkeep(next(iter(self.kept))).block_table)
        return n

    def _unkeep(self, request_id: str) -> PrefillResult | None:
        kept = self.kept.pop(request_id, None)
        if kept is not None:
            self.kept_pages -= len(kept.block_table)
        return kept

    # ---- decode side ----------------------------------------------------------------------
    def import_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token_ids: list[int],
        write_pages: Callable[[list[int]], None],
        prefix_pages: Seq[int],
        running: Container[str],
        prefix_root: int | None = None,
        images: Seq[ImageInput] = (),
        mrope: MRopePositions | None = None,
        resumed: Seq[tuple[int, Seq[int]]] = (),
    ) -> EngineRequest | None:
        """See `Engine.import_prefilled`. Returns the new request, or None when every choice's
        first token already ended it (`running`: the ids of the engine's live requests;
        `prefix_root`: its LoRA adapter's prefix-cache root, as `Sequence.prefix_root`)."""
        table = list(prefix_pages)
        try:
            if any(not tokens for _, tokens in resumed):
                raise ValueError("kv: a resumed choice without tokens")
            if params.lora is not None and not self.scheduler.loras.has_room(params.lora):
                raise ValueError(f"lora: every one of the {self.scheduler.loras.max_loras} adapter slots is in use")
            self.grammar_masks.start(params)  # the grammar compiles (the gateway checked it; cached here)
            self.validator.not_running(request_id, running)
            prompt = list(prompt_token_ids)
            params = self.validator.fit_pool(len(prompt), params)
            self.blocks.grow(table, len(prompt))
            write_pages(table[len(prefix_pages) :])
        except Exception:
            self.blocks.free_table(table)
            raise
        cached = self.blocks.cache_full_pages(table, hash_token_ids(prompt, images), 0, len(prompt), prefix_root)
        params = dataclasses.replace(params, prompt_logprobs=None)  # the prefill worker sent them
        req = EngineRequest(request_id, params, [], len(prompt))
        # each choice from its first token (a resumed one's own, its other tokens replayed)
        starts = [(i, [t]) for i, t in enumerate(first_token_ids)] if not resumed else resumed
        for index, (token, *replay) in starts:
            seq = Sequence(
                request_id,
                index,
                prompt + [token],
                len(prompt),
                params,
                block_table=self.blocks.fork(table),
                num_computed=len(prompt),
                num_cached_pages=cached,
                grammar=self.grammar_masks.start(params, [token]),  # past the prefill worker's first token
                lora=params.lora,
                prefix_root=prefix_root,
                images=list(images),
                mrope=mrope,
                replay=replay,
            )
            gen = self.generators.new(params, index)
            if gen is not None:  # the prefill worker drew the first token from this stream
                skip_draws(gen, 1, self.validator.vocab_size)
                self.generators.adopt(seq, gen)
            req.seqs.append(seq)
            req.finished_sent.add(index)  # the prefill worker reported the first token
            self.stops.check(seq)
            if not seq.finished:
                req.finished_sent.discard(index)
                self.scheduler.add_running(seq)
        self.blocks.free_table(table)
        if all(s.finished for s in req.seqs):
            self.generators.drop(req.seqs)
            return None
        return req
