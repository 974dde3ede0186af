"""The engine: `step()` = schedule → execute → update, over paged KV memory.

Usable as a library:

    engine = Engine(EngineConfig())
    [result] = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

or incrementally with `add_request` / `step` / `abort`, which is what a worker process drives.

The engine composes one object per job, each holding its own state:

    RequestValidator   prompt ids and parameters against the vocabulary and context length
    GrammarMasks       structured outputs: each constrained sequence's grammar matcher, a
                       step's token bitmask filled while the forward pass runs
    Scheduler          which tokens of which sequences run this step (pure Python)
    ModelRunner        the forward pass of a `ModelInput` (plain data built from the plan)
    StepUpdate         logits → sampled tokens → sequences advanced or stopped (StopRules),
                       n > 1 / best_of forks (Forks, SeqGenerators), beam steps (BeamSearch)
    PrefillHandoff     pages held for a transfer (prefill side), requests imported (decode side)
    HandoffPages       the handoff's pages in and out of every rank's pool (kv_handoff.py)
    build_outputs      what each touched request reports this step
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from pagemesh.common.messages import ImageInput, Pooling
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.backend import select_backend
from pagemesh.workers.engine.beam import BeamSearch, BeamState
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.draft_model import attach_drafter
from pagemesh.workers.engine.engine_images import EngineImages
from pagemesh.workers.engine.engine_setup import FirstRank, load_first_rank, model_tokenizer
from pagemesh.workers.engine.forks import Forks, SeqGenerators
from pagemesh.workers.engine.grammar_masks import GrammarMasks, PendingMasks
from pagemesh.workers.engine.in_flight import pipelined_step
from pagemesh.workers.engine.kv_handoff import HandoffPages, KVLayout, PageExport
from pagemesh.workers.engine.kv_offload import offload_for_engine
from pagemesh.workers.engine.kv_pool_size import kv_dtype, page_bytes, pages_from_budget
from pagemesh.workers.engine.kv_quant import calibration_token_ids
from pagemesh.workers.engine.lora_adapters import EngineAdapters, lora_runner_args
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.engine.output_builder import build_outputs
from pagemesh.workers.engine.outputs import CompletionResult, PrefillResult, RequestOutput
from pagemesh.workers.engine.prefilled import PrefillHandoff
from pagemesh.workers.engine.scheduler import Scheduler, StepPlan, StepSchedulerConfig
from pagemesh.workers.engine.sequence import EngineRequest, Sequence
from pagemesh.workers.engine.speculative import Speculator
from pagemesh.workers.engine.stats import EngineStats
from pagemesh.workers.engine.step_trace import StepTrace
from pagemesh.workers.engine.stopping import StopRules
from pagemesh.workers.engine.update import StepUpdate
from pagemesh.workers.engine.validation import RequestValidator
from pagemesh.workers.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
MAX_DEFAULT_MODEL_LEN = 8192
DEFAULT_CONFIG = EngineConfig()


class Engine:
    """One model, one KV pool, one local scheduler.

    Its contract with the worker process: `add_request` / `import_prefilled` / `abort` change
    what runs, `step` runs one iteration and returns each touched request's `RequestOutput`,
    `stalled` says the last step found work it could not place (pages held elsewhere), and a
    prefill-only request's pages wait in `take_prefilled` until `keep_prefilled` (handed off:
    kept for a migrated request's `resend_prefilled`) or `release_prefilled`. The KV handoff uses
    only its handoff API: `export_prefilled`, `keep_prefilled`, `resend_prefilled`,
    `release_prefilled` (prefill side);
    `kv_layout`, `pin_prefix_pages`, `import_pages`, `free_pages` (decode side).

    With `tensor_parallel_size` N > 1 this engine is rank 0: it loads its shard, starts the other
    N-1 ranks (`FollowerRanks`) and the runner sends them each step; `close()` stops them.
    With `pipeline_parallel_size` M > 1 it is also stage 0 of M (the first layers; the logits
    come back from the last stage): N×M ranks in all, and `step` keeps up to M steps in flight
    (`max_steps_in_flight`; workers/engine/in_flight.py): a call may launch a step and return
    nothing, the outputs of each step come out in launch order."""

    def __init__(self, config: EngineConfig = DEFAULT_CONFIG, model: LlamaForCausalLM | None = None, tokenizer=None):
        self.config = config
        self.device = config.resolve_device()
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        if model is None:  # from a path: rank 0's shard and stage (engine_setup.py)
            first = load_first_rank(config, self.device)
            config = self.config = first.config
        elif model.tp.world_size != tp_size or pp_size > 1:
            raise ValueError(
                f"engine: the model is sharded {model.tp.world_size} ways, tensor_parallel_size={tp_size} "
                f"(and pipeline stages load from a path: pipeline_parallel_size={pp_size})"
            )
        else:
            first = FirstRank(config, None, model)
        model, pipe, self.model_path = first.model, first.pipe, first.model_path
        self.model_config = model.config
        self.tokenizer = tokenizer if tokenizer is not None else model_tokenizer(self.model_path)
        self.max_model_len = min(
            config.max_model_len or MAX_DEFAULT_MODEL_LEN, self.model_config.max_position_embeddings
        )
        self.eos_token_ids = frozenset(
            self.tokenizer.eos_token_ids if self.tokenizer is not None else [self.model_config.eos_token_id]
        ) - {None}
        num_pages = config.num_pages or pages_from_budget(config, self.model_config, model, self.device)
        speculator = Speculator(config.speculative_config, self.max_model_len) if config.speculative_config else None
        # pages every layer's window has passed are freed as sequences run (a draft model keeps
        # them: it catches up over whole prompts, workers/engine/draft_model.py)
        window = None if speculator and speculator.uses_draft_model else self.model_config.kv_window
        self.blocks = BlockManager(num_pages, config.page_size, config.enable_prefix_caching, window)
        # LoRA: the adapters (checked against the model before anything else is built) and their slots
        self.adapters = (
            EngineAdapters(model, config.max_loras, config.max_lora_rank, config.lora_modules)
            if config.enable_lora
            else None
        )
        self.scheduler = Scheduler(
            StepSchedulerConfig.for_engine(config, self.max_model_len, page_bytes(config, self.model_config, model)),
            self.blocks,
            speculator,
            self.adapters.slots if self.adapters is not None else None,
        )
        self.backend = select_backend(self.device, model.dtype, config.batch_invariant)
        try:
            self.followers = (
                first.start_followers(num_pages, self.tokenizer, self.device) if tp_size * pp_size > 1 else None
            )
        finally:
            first.unlink_shared_file()  # every rank has mapped it (or none will)
        self.runner = ModelRunner(
            model,
            num_pages,
            config.page_size,
            self.device,
            backend=self.backend,
            cuda_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            followers=self.followers,
            pipe=pipe,
            kv_dtype=kv_dtype(config, model),
            kv_calibration_ids=calibration_token_ids(self.tokenizer, self.model_config.vocab_size),
            lora=lora_runner_args(config),
        )
        if config.kv_offload:  # evicted prefix pages to host memory, then disk (kv_offload.py)
            self.blocks.attach_offload(
                offload_for_engine(config, self.runner.kv_cache, self.model_path, self.runner.kv_scales)
            )
        self.drafter = (
            attach_drafter(self, config.speculative_config) if speculator and speculator.uses_draft_model else None
        )
        self.requests: dict[str, EngineRequest] = {}
        self.images = EngineImages(self.runner, self.model_config)  # encoder step, rows from encoder workers
        self.encoder_cache = self.images.cache  # which images' rows the runner holds
        self.validator = RequestValidator(
            self.model_config.vocab_size,
            self.max_model_len,
            self.tokenizer,
            self.blocks.num_usable_pages,
            config.page_size,
        )
        self.grammar_masks = GrammarMasks(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        # unseeded rows draw from the default generator, on the device the sampler runs on
        self.generators = SeqGenerators(self.device, config.seed)
        self.stops = StopRules(self.scheduler, self.eos_token_ids, self.max_model_len)
        self.forks = Forks(self.blocks, self.scheduler, self.generators)
        self.updater = StepUpdate(
            self.requests,
            self.blocks,
            self.backend,
            self.generators,
            self.forks,
            BeamSearch(self.scheduler, self.forks, self.stops),
            self.stops,
            self.grammar_masks,
            speculator.stats if speculator else None,
        )
        self.handoff = PrefillHandoff(
            self.blocks, self.scheduler, self.validator, self.grammar_masks, self.generators, self.stops
        )
        layout = KVLayout(self.model_config.num_layers, tp_size, pp_size, tuple(self.runner.kv_cache.shape))
        self.handoff_pages = HandoffPages(self.blocks, layout, self.runner, self.followers)
        self.stats = EngineStats(speculation=self.updater.speculation)
        self.step_trace = StepTrace.from_env()  # None unless a bench asks (PAGEMESH_STEP_TRACE)
        self.stalled = False

    def close(self) -> None:
        """Stop the other ranks; with a disk offload tier, write the prefix pages held in the pool
        and in host memory to it first (a worker stopped on purpose keeps its whole prefix cache)."""
        if self.blocks.offload is not None:
            self.blocks.offload.persist(self.blocks.published_pages())
        if self.followers is not None:
            self.followers.close()

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        prefill_only: bool = False,
        output_token_ids: Seq[int] = (),
        resumed_choices: Seq[tuple[int, Seq[int]]] = (),
    ) -> None:
        """Queue a library caller's request (offline use, benches), checked first as the gateway
        and the tokenizer check a mesh's: parameters, token ids, context length (max_tokens None:
        what the context leaves). Raises ValueError naming the field. The rest is `admit`'s."""
        token_ids, params = self.validator.new_request(request_id, prompt, params)
        for ids in (output_token_ids, *(tokens for _, tokens in resumed_choices)):
            self.validator.check_output_ids(ids, params)
        self.admit(request_id, token_ids, params, prefill_only, output_token_ids, resumed_choices=resumed_choices)

    def admit(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        prefill_only: bool = False,
        output_token_ids: Seq[int] = (),
        images: Seq[ImageInput] = (),
        images_remote: bool = False,
        resumed_choices: Seq[tuple[int, Seq[int]]] = (),
    ) -> None:
        """Queue a request checked before it came (by the gateway, the tokenizer and the wire
        decoder). Only what this engine alone knows is checked here (ValueError): the id is not
        running, a resumed request's choices are its own, it fits the KV pool alone (a longer
        max_tokens is cut to what fits).
        `prefill_only`: stop after the first token(s) and hold the pages (see `take_prefilled`).
        `output_token_ids`: a request resumed after its worker was lost (one choice only): the
        tokens it generated there, recomputed here (prefix cache first) and never reported
        again; they count as output for max_tokens, min_tokens, penalties and the grammar, and a
        seeded request's generator is advanced past their draws, so it continues the sequence
        it would have drawn on the first worker. `params.lora`: the loaded LoRA adapter it runs
        under (None: the base model). `images`: a multimodal prompt's images (ImageInput), their
        placeholders in the prompt; the encoder step turns them into rows (encoder_cache.py).
        `images_remote`: an encoder worker sends their rows (`receive_image_rows`); the prompt
        waits for them (engine_images.py), then encodes here what has not come.
        `resumed_choices`: a resumed request of several choices (n > 1): (index, tokens) of each
        choice still to finish, each recomputed and continued as `output_token_ids` is."""
        self.validator.not_running(request_id, self.requests)
        root = self._check_lora(params.lora)
        mrope = self.images.check(prompt_token_ids, images)
        token_ids = list(prompt_token_ids)
        choices = self.validator.resumable(output_token_ids, resumed_choices, params)
        params = self.validator.fit_pool(len(token_ids), params, prefill_only)
        if any(resumed for _, resumed in choices):
            params = dataclasses.replace(params, prompt_logprobs=None)  # reported with its first token
        forks = 0 if params.use_beam_search or len(choices) > 1 else params.num_sequences - 1
        seqs = []
        for index, resumed in choices:
            seq = Sequence(
                request_id,
                index,
                token_ids + resumed,
                len(token_ids),
                params,
                pending_forks=forks,
                grammar=self.grammar_masks.start(params, resumed),
                lora=params.lora,
                prefix_root=root,
                images=list(images),
                mrope=mrope,
            )
            if images_remote:
                self.images.wait_for(seq)
            self.generators.start(seq, draws_done=len(resumed), vocab_size=self.model_config.vocab_size)
            seqs.append(seq)
        beam = BeamState(params.num_sequences, params.length_penalty) if params.use_beam_search else None
        self.requests[request_id] = EngineRequest(
            request_id, params, seqs, len(token_ids), prefill_only=prefill_only, beam=beam
        )
        for seq in seqs:
            self.scheduler.add(seq)

    def receive_image_rows(self, request_id: str, digest: str, rows: torch.Tensor) -> None:
        """An encoder worker's rows of one image (engine_images.py)."""
        req = self.requests.get(request_id)
        self.images.receive(req.seqs if req is not None else (), digest, rows)

    def _check_lora(self, lora: str | None) -> int | None:
        """ValueError unless `lora` is None or an adapter this engine holds; its prefix-cache root."""
        if lora is None:
            return None
        if self.adapters is None:
            raise ValueError(f"lora: adapter {lora!r} asked of an engine that serves none (enable_lora)")
        self.adapters.check(lora)
        return self.adapters.prefix_root(lora)

    def admit_embedding(self, request_id: str, prompt_token_ids: Seq[int], pooling: Pooling, priority: int = 0) -> None:
        """Queue an embedding request, checked as `admit`'s: its prompt runs as a prefill, and its
        output is its pooled final-norm hidden state, L2-normalised (`RequestOutput.embedding`),
        not a token; its pages are freed as it ends. Not on pipeline stages (ValueError): the
        final norm is on the last one, and only logits travel back (`pooling.embed` offline)."""
        if self.config.pipeline_parallel_size > 1:
            raise ValueError("input: embeddings are not served by a pipeline-parallel worker")
        self.validator.not_running(request_id, self.requests)
        token_ids, params = list(prompt_token_ids), SamplingParams(temperature=0.0, max_tokens=1, priority=priority)
        params = self.validator.fit_pool(len(token_ids), params, prefill_only=True)
        seq = Sequence(request_id, 0, token_ids, len(token_ids), params, pooling=pooling)
        self.requests[request_id] = EngineRequest(request_id, params, [seq], len(token_ids))
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages. Returns False if it was unknown or already done."""
        self.release_prefilled(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        self.generators.drop(req.seqs)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.scheduler.in_flight is not None:
            return pipelined_step(self)
        self.images.stop_waiting(self.scheduler.waiting)
        plan = self.scheduler.schedule()
        self.stalled = plan.empty  # work is queued but nothing fits (pages held elsewhere)
        if plan.empty:
            return []
        started = time.perf_counter()
        if self.drafter is not None:  # fills the plan's draft_quantized proposals
            self.drafter.propose(plan)
        masks = self.grammar_masks.launch(plan)  # structured outputs: filled while the model runs
        ran = self.runner.launch(self.images.model_input(plan))
        return self.apply_step(plan, plan, ran.result(), started, ran.pooled, masks)

    def apply_step(
        self,
        ran: StepPlan,
        plan: StepPlan,
        logits: torch.Tensor,
        started: float,
        pooled: torch.Tensor | None = None,
        masks: PendingMasks | None = None,
    ) -> list[RequestOutput]:
        """The update after a step: `plan`'s sequences take their tokens (embedding requests their
        `pooled` rows); `ran` (the same plan,
        or a pipeline's with the chunks of aborted sequences too) counts in the statistics and the
        step trace, as one step of `started` (its launch) to now: with steps in flight these
        spans overlap, so their sum exceeds the wall time. `masks`: the grammar masks launched
        beside the forward pass (None: a pipeline's step, whose masks are filled now)."""
        touched = self.updater.apply(plan, logits, pooled, masks)
        for req in touched:
            if req.prefill_only:
                self.handoff.hold(req)
        self.stats.record_step(ran, self.scheduler, self.blocks, time.perf_counter() - started)
        if self.step_trace is not None:
            self.step_trace.record(ran, started, time.perf_counter() - started)
        outputs = build_outputs(touched)
        for req, out in zip(touched, outputs):
            if out.finished:
                self.requests.pop(req.request_id, None)
                self.generators.drop(req.seqs)
        return outputs

    # ---- disaggregated prefill ------------------------------------------------------------
    def take_prefilled(self, request_id: str) -> PrefillResult | None:
        """A prefill-only request whose first tokens are out: the pages to send (None: not held)."""
        return self.handoff.take(request_id)

    def export_prefilled(self, request_id: str, skip_pages: int = 0) -> PageExport:
        """Prefill side: CPU copies of a held request's prompt pages from `skip_pages` on (the
        last page always), every rank's (rank 0 gathers its followers' shards). The pages stay
        held until `keep_prefilled` or `release_prefilled`. KeyError unless `take_prefilled` holds the request."""
        result = self.handoff.take(request_id)
        if result is None:
            raise KeyError(f"engine: no pages held for {request_id!r}")
        return self.handoff_pages.export_pages(result, skip_pages)

    def release_prefilled(self, request_id: str) -> None:
        """The transfer failed or timed out, or the request ended: free its pages, held or kept."""
        self.handoff.release(request_id)

    def keep_prefilled(self, request_id: str) -> None:
        """The transfer was acknowledged: keep the pages for `resend_prefilled` (prefilled.py)."""
        self.handoff.keep(request_id)

    def release_kept(self) -> int:
        """Free every kept request's pages (their scheduler forgot them); returns how many."""
        return self.handoff.release_kept()

    def resend_prefilled(self, request_id: str, prompt_token_ids: Seq[int], kept_id: str = "") -> bool:
        """A migrated request: hold its kept pages (kept as `kept_id`, if not `request_id`) again
        for `export_prefilled`; False if none are kept."""
        return self.handoff.resend(request_id, prompt_token_ids, kept_id)

    @property
    def kv_layout(self) -> KVLayout:
        """Decode side: what received pages must match (layers, ranks, rank 0's pool shape)."""
        return self.handoff_pages.kv_layout

    def pin_prefix_pages(self, token_ids: Seq[int], num_pages: int) -> list[int]:
        """Decode side: a reference on each cached page of the first `num_pages` full pages of
        `token_ids` (fewer where fewer are cached), held until `import_pages` takes them or
        `free_pages` drops them."""
        return self.handoff_pages.pin_prefix_pages(token_ids, num_pages)

    def free_pages(self, pages: list[int]) -> None:
        """Decode side: drop the references `pin_prefix_pages` took on `pages` and empty it."""
        self.handoff_pages.free_pages(pages)

    def import_pages(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token_ids: list[int],
        rank_pages: list[list[torch.Tensor]],
        rank_sent_scales: list[list[float]],
        prefix_pages: Seq[int] = (),
        images: Seq[ImageInput] = (),
        resumed: Seq[tuple[int, Seq[int]]] = (),
    ) -> None:
        """Decode side: `import_prefilled` with the received pages: `rank_pages[r]` holds rank
        r's layers ([n, 2, S, its KV heads, D] each) of the prompt's pages after `prefix_pages`,
        sent with `rank_sent_scales[r]` (an fp8 sender's; empty otherwise); each rank's are
        written into its pool, converted where its dtype or scales differ (rank 0 scatters the
        followers'). The engine owns `prefix_pages` from here on, also when this raises."""

        def write(table: list[int]) -> None:
            self.handoff_pages.write_pages(table, rank_pages, rank_sent_scales)

        self.import_prefilled(
            request_id, prompt_token_ids, params, first_token_ids, write, prefix_pages, images, resumed
        )

    def import_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token_ids: list[int],
        write_pages: Callable[[list[int]], None],
        prefix_pages: Seq[int] = (),
        images: Seq[ImageInput] = (),
        resumed: Seq[tuple[int, Seq[int]]] = (),
    ) -> None:
        """Decode side: continue a request prefilled elsewhere (`images`: its prompt's, which key
        its pages and run again in a recompute; `resumed`: a migrated request's (choice index,
        tokens streamed already) in place of `first_token_ids`: each choice starts from its first
        token and decodes the rest again as given, reporting none, `Sequence.replay`). `prefix_pages` are leading
        prompt pages this pool already holds (references taken with `pin_prefix_pages`; the engine
        owns them from here on, also when this raises). Allocates the rest of the prompt's pages,
        calls `write_pages(new_pages)` to fill them, publishes the prompt's full pages to the
        prefix cache, and starts every choice whose first token did not already end it.
        Raises OutOfPages if the pool cannot hold the prompt."""
        root = self._check_lora(params.lora)  # ValueError before any page is taken
        mrope = self.images.check(prompt_token_ids, images)
        req = self.handoff.import_request(
            request_id,
            prompt_token_ids,
            params,
            first_token_ids,
            write_pages,
            prefix_pages,
            running=self.requests,
            prefix_root=root,
            images=images,
            mrope=mrope,
            resumed=resumed,
        )
        if req is not None:
            self.requests[request_id] = req

    # ---- offline --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams],
        loras: Seq[str | None] | None = None,
    ) -> list[CompletionResult]:
        """Run prompts to completion together (each under its LoRA adapter in `loras`, None: the
        base model); results in prompt order."""
        from pagemesh.workers.engine.offline import generate

        return generate(self, prompts, sampling_params, loras)
