"""The engine: `step()` = schedule → execute → update, over paged KV memory.

Usable as a library:

    engine = Engine(EngineConfig())
    [result] = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

or incrementally with `add_request` / `step` / `abort`, which is what a worker process drives.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.json_schema import compile_schema
from common.model_files import resolve_model_path
from common.sampling import SamplingParams
from workers.engine.beam import BeamState, expand
from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.json_mode import JsonMasks
from workers.engine.model_input import build_model_input
from workers.engine.model_runner import ModelRunner
from workers.engine.outputs import CompletionResult, PrefillResult, RequestOutput, SeqOutput
from workers.engine.sampler import SampleRow, add_logit_bias, prompt_token_logprobs, sample
from workers.engine.scheduler import Scheduler, StepPlan, StepSchedulerConfig
from workers.engine.sequence import Sequence
from workers.engine.stats import EngineStats
from workers.model.llama import LlamaForCausalLM
from workers.model.loader import load_model

DEFAULT_CPU_KV_GB = 2.0
GPU_FREE_SHARE = 0.9  # of the memory free when the pool is sized: the rest is for activations
MAX_DEFAULT_MODEL_LEN = 8192
SCHEMA_MASKS = 16  # JSON schemas whose token masks are kept (a schema's masks are rebuilt when needed again)


def gpu_kv_budget(free: int, total: int, reserved: int, fraction: float) -> float:
    """Bytes for the KV pool of a worker on a GPU, sized after its weights are loaded: its share
    of the GPU (`fraction` of `total`) less what it holds already (`reserved`: the weights), and
    never more than GPU_FREE_SHARE of what is free now (other processes, activations)."""
    return max(0.0, min(fraction * total - reserved, GPU_FREE_SHARE * free))


@dataclass
class _Request:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    num_prompt_tokens: int
    finished_sent: set[int] = field(default_factory=set)
    prefill_only: bool = False  # disaggregated prefill: keep the pages after the first token
    reported_queue_time: bool = False
    sent_prompt_logprobs: bool = False
    beam: BeamState | None = None  # beam search: finished hypotheses
    next_index: int = 1  # choice index of the next forked sequence

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs) and not any(s.pending_forks for s in self.seqs)


class Engine:
    """One model, one KV pool, one local scheduler."""

    def __init__(self, config: EngineConfig = EngineConfig(), model: LlamaForCausalLM | None = None, tokenizer=None):
        self.config = config
        self.device = config.resolve_device()
        self.model_path: Path | None = None
        if model is None:
            self.model_path = resolve_model_path(config.model)
            model = load_model(self.model_path, config.resolve_dtype(self.device), self.device)
        self.model_config = model.config
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.max_model_len = min(
            config.max_model_len or MAX_DEFAULT_MODEL_LEN, self.model_config.max_position_embeddings
        )
        num_pages = config.num_pages or self._pages_from_budget(model)
        self.blocks = BlockManager(num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            StepSchedulerConfig.for_engine(config, self.max_model_len, self._page_bytes(model)), self.blocks
        )
        self.runner = ModelRunner(
            model, num_pages, config.page_size, self.device,
            cuda_graphs=config.cuda_graphs, max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
        )
        self.eos_token_ids = frozenset(
            self.tokenizer.eos_token_ids if self.tokenizer is not None else [self.model_config.eos_token_id]
        ) - {None}
        self.requests: dict[str, _Request] = {}
        self.generators: dict[int, torch.Generator] = {}
        # unseeded rows draw from this one, on the device the sampler runs on
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.stats = EngineStats()
        self.prefilled: dict[str, PrefillResult] = {}  # prefill-only requests awaiting transfer
        self.schema_masks: dict[str, JsonMasks] = {}  # JSON Schema text -> its masks, least recent first
        self.stalled = False

    # ---- set-up ---------------------------------------------------------------------------
    def _load_tokenizer(self):
        """The model's tokenizer; a folder without tokenizer files serves token ids only."""
        if self.model_path is None or (self.model_path.is_dir() and not (self.model_path / "tokenizer.json").exists()):
            return None
        from common.tokenizer import Tokenizer

        return Tokenizer.from_path(self.model_path)

    def _page_bytes(self, model: LlamaForCausalLM) -> int:
        dtype_bytes = model.embed_tokens.weight.element_size()
        return self.model_config.kv_bytes_per_token(dtype_bytes, model.tp.world_size) * self.config.page_size

    def _pages_from_budget(self, model: LlamaForCausalLM) -> int:
        page_bytes = self._page_bytes(model)
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = gpu_kv_budget(free, total, torch.cuda.memory_reserved(self.device), self.config.gpu_memory_fraction)
        else:
            budget = DEFAULT_CPU_KV_GB * 2**30
        return max(2, int(budget // page_bytes))

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, prefill_only: bool = False) -> None:
        """Queue a request. Raises ValueError naming the field if anything is invalid.
        `prefill_only`: stop after the first token(s) and hold the pages (see `take_prefilled`)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        params.validate()
        token_ids = self._prompt_ids(prompt)
        vocab = self.model_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [i for i, _ in params.logit_bias])):
            for t in ids:
                if t >= vocab:
                    raise ValueError(f"{name}: token id {t} outside vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room in the context length {self.max_model_len}"
            )
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the context length {self.max_model_len}"
            )
        masks = self._json_masks_for(params)
        forks = 0 if params.use_beam_search else params.num_sequences - 1
        seq = Sequence(request_id, 0, token_ids, len(token_ids), params, pending_forks=forks,
                       json=masks.start() if masks is not None else None, json_masks=masks)
        self._make_generator(seq)
        beam = BeamState(params.num_sequences, params.length_penalty) if params.use_beam_search else None
        self.requests[request_id] = _Request(request_id, params, [seq], len(token_ids), prefill_only=prefill_only, beam=beam)
        self.scheduler.add(seq)

    @functools.cached_property
    def json_masks(self) -> JsonMasks | None:
        """JSON mode's token masks for any object, built at its first use (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return JsonMasks.for_tokenizer(self.tokenizer, self.model_config.vocab_size, set(self.eos_token_ids))

    def _json_masks_for(self, params: SamplingParams) -> JsonMasks | None:
        """The masks of a new request's JSON mode (its sequences keep them; the last SCHEMA_MASKS
        schemas' are kept here for the next requests); None when it has none. ValueError when its
        schema cannot be enforced."""
        if not params.constrained:
            return None
        if self.json_masks is None:
            raise ValueError("response_format: JSON mode needs the model's tokenizer")
        if params.json_schema is None:
            return self.json_masks
        masks = self.schema_masks.pop(params.json_schema, None)
        if masks is None:
            try:
                masks = self.json_masks.for_grammar(compile_schema(json.loads(params.json_schema)))
            except (ValueError, RecursionError) as e:
                raise ValueError(f"response_format: {e}") from None
        self.schema_masks[params.json_schema] = masks  # most recently used last
        while len(self.schema_masks) > SCHEMA_MASKS:
            self.schema_masks.pop(next(iter(self.schema_masks)))
        return masks

    def _prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt: token id {t!r} outside vocabulary [0, {vocab})")
        return ids

    def _make_generator(self, seq: Sequence) -> None:
        gen = self._new_generator(seq.sampling, seq.index)
        if gen is not None:
            self.generators[seq.seq_id] = gen

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages. Returns False if it was unknown or already done."""
        self.release_prefilled(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
            self.generators.pop(seq.seq_id, None)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self.stalled = plan.empty  # work is queued but nothing fits (pages held elsewhere)
        if plan.empty:
            return []
        started = time.perf_counter()
        logits = self.runner.execute(build_model_input(plan))
        touched = self._update(plan, logits)
        self.stats.record_step(plan, self.scheduler, self.blocks, time.perf_counter() - started)
        return self._outputs(touched)

    def _update(self, plan: StepPlan, logits: torch.Tensor) -> list[_Request]:
        rows: list[SampleRow] = []
        logit_index: list[int] = []
        owners: list[tuple[Sequence, int, torch.Generator | None]] = []  # (sequence, fork k, generator)
        beam_rows: dict[str, list[tuple[Sequence, int]]] = {}
        row = -1
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            seq.num_cached_pages = self.blocks.cache_full_pages(
                seq.block_table, seq.token_ids, seq.num_cached_pages, seq.num_computed
            )
            if not chunk.samples:
                continue
            row += 1
            if seq.sampling.use_beam_search:
                beam_rows.setdefault(seq.request_id, []).append((seq, row))
                continue
            # n > 1: the prompt ran once; its last logits row is sampled once per choice
            for k in range(seq.pending_forks + 1):
                gen = self.generators.get(seq.seq_id) if k == 0 else self._new_generator(seq.sampling, seq.index + k)
                rows.append(self._sample_row(seq, gen))
                logit_index.append(row)
                owners.append((seq, k, gen))
            seq.pending_forks = 0
        touched: dict[str, _Request] = {}
        num_sampled = row + 1  # rows after these are prompt positions (prompt logprobs)
        if num_sampled < logits.shape[0]:
            with torch.inference_mode():
                self._collect_prompt_logprobs(plan, logits[num_sampled:])
        if logit_index != list(range(num_sampled)):
            logits_for_rows = logits[logit_index]
        else:  # each row sampled once (the usual step): no [rows, vocab] copy
            logits_for_rows = logits[:num_sampled]
        with torch.inference_mode():  # the model's logits are inference tensors; sampling edits them
            results = sample(logits_for_rows, rows, self.default_generator) if rows else []
        # fork every sibling before any of them takes its token: a fork copies the parent's tokens
        targets = [seq if k == 0 else self._fork(seq, seq.index + k, gen) for seq, k, gen in owners]
        for (seq, _, _), target, (token, lp) in zip(owners, targets, results):
            req = self.requests[seq.request_id]
            if lp is not None:
                target.cumulative_logprob += lp.logprob
            target.append_token(token, lp if seq.sampling.logprobs is not None else None)
            if target.json is not None:
                target.json = target.json_masks.advance(target.json, token)
            self._check_stop(target)
            touched[seq.request_id] = req
        for request_id, items in beam_rows.items():
            req = touched[request_id] = self.requests[request_id]
            self._beam_step(req, [s for s, _ in items], logits[[r for _, r in items]].cpu())
        for req in touched.values():
            if req.prefill_only:
                self._hold_prefilled(req)
        return list(touched.values())

    def _collect_prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor) -> None:
        """The prompt logprobs of this step's chunks, from their rows after the sampled ones;
        they go out with the request's first token."""
        at = 0
        for chunk in plan.chunks:
            seq = chunk.seq
            positions = seq.prompt_logprob_positions(chunk.start, chunk.num_tokens)
            if positions:
                targets = seq.token_ids[positions.start + 1 : positions.stop + 1]
                seq.prompt_logprobs += prompt_token_logprobs(logits[at : at + len(positions)], targets, seq.sampling.prompt_logprobs)
                at += len(positions)

    def _hold_prefilled(self, req: _Request) -> None:
        """Prefill-only: every choice has its first token. Unless all already stopped, keep the
        prompt's pages for the transfer and take the choices out of scheduling."""
        if all(s.finished for s in req.seqs):
            return
        first = req.seqs[0]
        table = self.blocks.fork(first.block_table[: -(-req.num_prompt_tokens // self.blocks.page_size)])
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "prefilled")
        self.prefilled[req.request_id] = PrefillResult(
            req.request_id, first.token_ids[: req.num_prompt_tokens], table, [s.token_ids[-1] for s in sorted(req.seqs, key=lambda s: s.index)]
        )

    def take_prefilled(self, request_id: str) -> PrefillResult | None:
        return self.prefilled.get(request_id)

    def release_prefilled(self, request_id: str) -> None:
        """The transfer is over (acknowledged, failed or timed out): free the held pages."""
        held = self.prefilled.pop(request_id, None)
        if held is not None:
            self.blocks.free_table(held.block_table)

    def import_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token_ids: list[int],
        write_pages,
        prefix_pages: Seq[int] = (),
    ) -> None:
        """Decode side: continue a request prefilled elsewhere. `prefix_pages` are leading
        prompt pages this pool already holds (references taken with `match_prefix`; the engine
        owns them from here on, also when this raises). Allocates the rest of the prompt's pages,
        calls `write_pages(new_pages)` to fill them, publishes the prompt's full pages to the
        prefix cache, and starts every choice whose first token did not already end it.
        Raises OutOfPages if the pool cannot hold the prompt."""
        table = list(prefix_pages)
        try:
            params.validate()
            masks = self._json_masks_for(params)
            if request_id in self.requests:
                raise ValueError(f"request_id: {request_id!r} is already running")
            prompt = self._prompt_ids(prompt_token_ids)
            self.blocks.grow(table, len(prompt))
            write_pages(table[len(prefix_pages):])
        except Exception:
            self.blocks.free_table(table)
            raise
        cached = self.blocks.cache_full_pages(table, prompt, 0, len(prompt))
        params = dataclasses.replace(params, prompt_logprobs=None)  # the prefill worker sent them
        req = _Request(request_id, params, [], len(prompt))
        self.requests[request_id] = req
        for index, token in enumerate(first_token_ids):
            seq = Sequence(
                request_id, index, prompt + [token], len(prompt), params, block_table=self.blocks.fork(table),
                num_computed=len(prompt), num_cached_pages=cached,
                json=masks.advance(masks.start(), token) if masks is not None else None, json_masks=masks,
            )
            gen = self._new_generator(params, index)
            if gen is not None:  # the prefill worker drew the first token from this stream
                torch.empty(self.model_config.vocab_size).exponential_(generator=gen)
                self.generators[seq.seq_id] = gen
            req.seqs.append(seq)
            req.finished_sent.add(index)  # the prefill worker reported the first token
            self._check_stop(seq)
            if not seq.finished:
                req.finished_sent.discard(index)
                self.scheduler.add_running(seq)
        self.blocks.free_table(table)
        if all(s.finished for s in req.seqs):
            self.requests.pop(request_id)

    def _new_generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator().manual_seed((params.seed + index) % 2**63)

    def _sample_row(self, seq: Sequence, generator: torch.Generator | None) -> SampleRow:
        p = seq.sampling
        banned: tuple[int, ...] = ()
        allowed = None if seq.json is None else seq.json_masks.allowed(seq.json, self.device)
        if seq.num_output_tokens < p.min_tokens and not (seq.json is not None and seq.json.complete):
            banned = tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))))
        # the token lists only feed penalties: no copies of long contexts per row and step without them
        repetition = p.repetition_penalty != 1.0
        prompt_ids = seq.token_ids[: seq.num_prompt_tokens] if repetition else []
        output_ids = seq.output_token_ids if repetition or p.frequency_penalty or p.presence_penalty else []
        return SampleRow(p, prompt_ids, output_ids, generator, banned, allowed, want_logprob=not p.streams)

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))

    def _beam_step(self, req: _Request, beams: list[Sequence], logits: torch.Tensor) -> None:
        """Extend a beam-search request by one token (see workers/engine/beam.py)."""
        p, state = req.params, req.beam
        stop = self._stop_ids(p)
        banned = stop if beams[0].num_output_tokens < p.min_tokens else set()
        if p.logit_bias:  # the search scores the biased distribution
            add_logit_bias(logits, p.logit_bias)
        live, ended = expand(beams, logits, state.width, stop, banned)
        for c in ended:
            state.add(c.parent.output_token_ids + [c.token], c.cumulative, "stop")
        by_parent: dict[int, list] = {}
        for c in live:
            by_parent.setdefault(c.parent.seq_id, []).append(c)
        for parent in beams:
            continuations = by_parent.get(parent.seq_id)
            if not continuations:
                self.scheduler.finish(parent, "pruned")
                continue
            for c in continuations[1:]:  # siblings share the parent's pages copy-on-write
                child = self._fork(parent, req.next_index, None)
                req.next_index += 1
                child.append_token(c.token, None)
                child.cumulative_logprob = c.cumulative
            parent.append_token(continuations[0].token, None)
            parent.cumulative_logprob = continuations[0].cumulative
        alive = [s for s in req.seqs if not s.finished]
        if alive and (alive[0].num_output_tokens >= p.max_tokens or alive[0].num_tokens >= self.max_model_len):
            for s in alive:
                state.add(s.output_token_ids, s.cumulative_logprob, "length")
                self.scheduler.finish(s, "length")
        elif state.done(max((state.score(s.cumulative_logprob, s.num_output_tokens) for s in alive), default=None)):
            for s in alive:
                self.scheduler.finish(s, "pruned")

    def _fork(self, parent: Sequence, index: int, generator: torch.Generator | None) -> Sequence:
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
            json=parent.json,
            json_masks=parent.json_masks,
        )
        if generator is not None:
            self.generators[child.seq_id] = generator
        self.requests[parent.request_id].seqs.append(child)
        self.scheduler.add_running(child)
        return child

    def _check_stop(self, seq: Sequence) -> None:
        token = seq.token_ids[-1]
        p = seq.sampling
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _outputs(self, touched: list[_Request]) -> list[RequestOutput]:
        outputs = []
        for req in touched:
            done = req.done
            if req.params.streams:
                seq_outputs = self._stream_outputs(req)
            else:  # best_of > n or beam search: the n choices are known only at the end
                for seq in req.seqs:
                    seq.take_new_tokens()
                seq_outputs = self._final_choices(req) if done else []
            if done:
                self.requests.pop(req.request_id, None)
                for seq in req.seqs:
                    self.generators.pop(seq.seq_id, None)
            first = req.seqs[0]
            queue_time = None
            if not req.reported_queue_time and first.first_scheduled is not None:
                queue_time, req.reported_queue_time = first.first_scheduled - first.arrival_time, True
            prompt_logprobs = None
            if req.params.prompt_logprobs is not None and not req.sent_prompt_logprobs and seq_outputs \
                    and not first.needs_prompt_logprobs:
                prompt_logprobs, req.sent_prompt_logprobs = first.prompt_logprobs, True
            outputs.append(RequestOutput(req.request_id, seq_outputs, done, req.num_prompt_tokens, first.num_prefix_hit_tokens,
                                         queue_time, prompt_logprobs))
        return outputs

    def _stream_outputs(self, req: _Request) -> list[SeqOutput]:
        seq_outputs = []
        for seq in req.seqs:
            ids, lps = seq.take_new_tokens()
            if ids or (seq.finished and seq.index not in req.finished_sent):
                reason = None if seq.finish_reason == "prefilled" else seq.finish_reason
                seq_outputs.append(SeqOutput(seq.index, ids, lps, reason))
                if seq.finished:
                    req.finished_sent.add(seq.index)
        return seq_outputs

    def _final_choices(self, req: _Request) -> list[SeqOutput]:
        n = req.params.n
        if req.beam is not None:
            return [SeqOutput(i, h.output_ids, [], h.finish_reason) for i, h in enumerate(req.beam.best(n))]
        best = sorted(req.seqs, key=lambda s: -s.cumulative_logprob)[:n]
        return [SeqOutput(i, s.output_token_ids, [], s.finish_reason) for i, s in enumerate(best)]

    # ---- offline --------------------------------------------------------------------------
    def generate(
        self, prompts: Seq[str | Seq[int]], sampling_params: SamplingParams | Seq[SamplingParams]
    ) -> list[CompletionResult]:
        """Run prompts to completion together; results in prompt order."""
        from workers.engine.offline import generate

        return generate(self, prompts, sampling_params)
