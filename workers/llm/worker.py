"""The LLM worker: an `Engine` behind the worker shell, in one of three roles.

    mixed    GenerateTask ─▶ engine (prefill + decode) ─▶ TokenDeltaBatch per step
    mixed or GenerateTask(pooling): an embedding ─▶ engine, prefill only ─▶ its vector in an
    prefill  EmbeddingBatch (one per step per destination); its pages are freed at once
    prefill  PrefillTask  ─▶ engine, prefill only ─▶ first token(s) at once, then HandoffOut
                             sends the prompt's pages to the decode worker, and keeps them
                             until the request ends (a migrated request's resend)
    decode   DecodeTask   ─▶ HandoffIn pins the cached prefix, awaits the pages, imports them
                             into the engine ─▶ decodes, TokenDeltaBatch per step

Every step it sends one TokenDeltaBatch per destination (a tokenizer's token address), carrying
the requests that started on it since the last step (`started`), and tells the scheduler of
requests that left (RequestDone) and of prefix-cache keys that came and went (KVEventBatch, the
step's KV cache events in vLLM's format: workers/engine/kv_event_feed.py), which it also
publishes with --kv-events-config.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from pagemesh.common.messages import (
    DecodeTask,
    DoneReason,
    Embedding,
    EmbeddingBatch,
    FinishReason,
    GenerateTask,
    HeldRequest,
    KVEventsResync,
    KVPoolInfo,
    KVPoolLoad,
    LoRAAdapterTask,
    PrefillTask,
    RequestStarted,
    SpeculationLoad,
    TokenDelta,
    TokenDeltaBatch,
    WorkerKind,
    WorkerRole,
)
from pagemesh.common.model_files import served_model_name
from pagemesh.workers.engine.engine import Engine, RequestOutput
from pagemesh.workers.engine.kv_event_feed import KVEventFeed
from pagemesh.workers.llm.config import LLMWorkerConfig
from pagemesh.workers.llm.handoff import HandoffIn, HandoffOut
from pagemesh.workers.llm.image_rows import ImageRowsIn
from pagemesh.workers.llm.kv_events_publisher import KVEventsPublisher
from pagemesh.workers.llm.lora import lora_load, run_adapter_task
from pagemesh.workers.shell.backend import Load, Registration, WorkerContext
from pagemesh.workers.shell.step_threads import StepThreads


class LLMWorker:
    """A `WorkerBackend` around one engine."""

    task_types = (GenerateTask, PrefillTask, DecodeTask, LoRAAdapterTask, KVEventsResync)

    def __init__(self, config: LLMWorkerConfig, engine: Engine, ctx: WorkerContext, threads: StepThreads | None = None):
        self.config, self.engine, self.ctx = config, engine, ctx
        self.threads = threads  # a CPU worker's adaptive thread count (workers/shell/thread_policy.py)
        # On a CPU the step runs on the event loop's own thread: a step of a few tens of ms is
        # hundreds of torch/C calls, and handing the GIL and the step's result between two
        # threads cost ~5% of decode throughput at 32 streams here. On CUDA the step stays in
        # the compute thread (a first Triton compile can take seconds; heartbeats go on).
        self.step_inline = engine.device.type == "cpu"
        self.out = HandoffOut(ctx, engine, config.transfer_timeout, self._left)
        self.incoming = None
        if config.role is WorkerRole.DECODE:
            self.incoming = HandoffIn(ctx, engine, config.kv_address, config.transfer_timeout, self._imported)
        self.image_rows = None  # image rows from encoder workers (--encoder N): a single-rank multimodal worker
        if config.embeds_address and engine.runner.image_encoder is not None and engine.runner.followers is None:
            self.image_rows = ImageRowsIn(ctx, engine, config.embeds_address)
        self.reply_to: dict[str, str] = {}  # request -> its tokenizer's token address
        self.produced = 0  # tokens sampled here, ever (heartbeats carry it: the status page's tokens/s)
        self.starting: dict[str, list[RequestStarted]] = {}  # reply_to -> started since the last batch
        self.scheduler_queued: dict[str, float] = {}  # request -> seconds it waited in the scheduler
        events_config = engine.config.kv_events_config
        legacy = events_config is not None and events_config.legacy_array_events
        self.kv_events = KVEventFeed(ctx.worker_id, engine.blocks, legacy)  # always: the scheduler's prefix index
        self.kv_events_publisher = KVEventsPublisher.for_config(events_config)  # --kv-events-config (None: off)

    # ---- WorkerBackend ----------------------------------------------------------------------
    def registration(self) -> Registration:
        path, blocks = self.engine.model_path, self.engine.blocks
        return Registration(
            kind=WorkerKind.LLM,
            role=self.config.role,
            model=(*self.engine.config.served_model_name, served_model_name(path) if path else "custom")[0],
            max_running=self.engine.config.max_num_seqs,
            kv=KVPoolInfo(
                page_size=blocks.page_size,
                num_pages=blocks.num_usable_pages,
                kv_endpoint=self.config.kv_advertise or "",
            ),
            ranks=self.engine.config.tensor_parallel_size * self.engine.config.pipeline_parallel_size,
            pipeline_stages=self.engine.config.pipeline_parallel_size,
            embeds_endpoint=self.config.embeds_address if self.image_rows is not None else "",
        )

    def add(self, task: GenerateTask | PrefillTask | DecodeTask | LoRAAdapterTask | KVEventsResync) -> None:
        if isinstance(task, KVEventsResync):  # the scheduler missed a batch: a snapshot next
            return self.kv_events.resync()
        if isinstance(task, LoRAAdapterTask):  # between steps: no step sees half an adapter
            return self.ctx.to_scheduler(run_adapter_task(self.engine, self.ctx.worker_id, task))
        if isinstance(task, DecodeTask):
            if self.incoming is None:
                self.ctx.log.warning("decode task for a worker without a KV address", request_id=task.request_id)
                return self.ctx.done(task.request_id, DoneReason.REJECTED, "this worker takes no KV pages")
            return self.incoming.task(task)
        resumed_prefill = isinstance(task, PrefillTask) and task.resumed
        if resumed_prefill and self.out.resend(
            task.request_id, task.prompt_token_ids, task.decode_kv_endpoint, task.skip_pages, task.kept_id
        ):
            return  # its kept pages go to the new decode worker; no token is reported from here
        self.scheduler_queued[task.request_id] = task.queued_s
        prefill_only = isinstance(task, PrefillTask)
        sampling = task.sampling
        if resumed_prefill:  # none kept: prefilled again for its pages, its first token not reported
            sampling = dataclasses.replace(sampling, ignore_eos=True, stop_token_ids=())
        try:
            resumed = task.output_token_ids if isinstance(task, GenerateTask) else ()  # migrated here
            if isinstance(task, GenerateTask) and task.pooling is not None:
                self.engine.admit_embedding(
                    task.request_id, task.prompt_token_ids, task.pooling, task.sampling.priority
                )
            else:
                self.engine.admit(  # checked at the gateway and the tokenizer
                    task.request_id,
                    task.prompt_token_ids,
                    sampling,
                    prefill_only=prefill_only,
                    output_token_ids=resumed,
                    images=task.images,
                    images_remote=bool(task.encoder_id) and self.image_rows is not None,
                    resumed_choices=[(c.index, c.output_token_ids) for c in task.resumed_choices]
                    if isinstance(task, GenerateTask)
                    else (),
                )
        except ValueError as e:
            self.ctx.log.warning("request refused", request_id=task.request_id, error=str(e))
            self.scheduler_queued.pop(task.request_id, None)
            self.ctx.done(task.request_id, DoneReason.REJECTED, str(e))
            self._send_final(task.request_id, task.reply_to, task.sampling.n)
            return
        if prefill_only:
            self.out.expect(task.request_id, task.decode_kv_endpoint, task.skip_pages)
        if not resumed_prefill:  # (a resumed one's tokenizer hears of it from its new decode worker)
            self._started(task.request_id, task.reply_to, len(task.prompt_token_ids))

    def abort(self, request_id: str) -> None:
        reply_to = self.reply_to.get(request_id)
        running = self.engine.requests.get(request_id)
        n = running.params.n if running is not None else 1
        known = self.engine.abort(request_id)  # frees its pages, those held for a transfer too
        self.out.forget(request_id)
        if self.incoming is not None:
            self.incoming.forget(request_id)
        if known and reply_to:
            self._send_final(request_id, reply_to, n)
        self._forget(request_id)

    def has_work(self) -> bool:
        return self.engine.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        if self.threads is None:
            return self.engine.step()
        return self.threads.run(self.engine.step, lambda: self.engine.stats.tokens)

    def stalled(self) -> bool:
        return self.engine.stalled

    async def publish(self, outputs: list[RequestOutput]) -> None:
        starting, self.starting = self.starting, {}
        batches: dict[str, list[TokenDelta]] = {reply_to: [] for reply_to in starting}
        embeddings: dict[str, list[Embedding]] = {}
        for out in outputs:
            reply_to = self.reply_to.get(out.request_id)
            if reply_to is None:
                continue
            if out.embedding is not None:  # no tokens, nothing to detokenize: its own message
                embedding = Embedding(
                    request_id=out.request_id, values=out.embedding, prompt_tokens=out.num_prompt_tokens
                )
                embeddings.setdefault(reply_to, []).append(embedding)
                continue
            queue_time = None
            if out.queue_time is not None:
                queue_time = out.queue_time + self.scheduler_queued.pop(out.request_id, 0.0)
            prompt_logprobs = out.prompt_logprobs  # TokenLogprob records: they travel as they are
            for so in out.outputs:
                self.produced += len(so.new_token_ids)
                batches.setdefault(reply_to, []).append(
                    TokenDelta(
                        request_id=out.request_id,
                        index=so.index,
                        token_ids=so.new_token_ids,
                        logprobs=so.logprobs or None,
                        finish_reason=so.finish_reason,
                        num_prompt_tokens=out.num_prompt_tokens,
                        queue_time_s=queue_time,
                        prompt_logprobs=prompt_logprobs,
                        num_cached_tokens=out.num_cached_tokens,
                    )
                )
                queue_time = prompt_logprobs = None  # once per request
        for reply_to, deltas in batches.items():  # one message per step per destination
            batch = TokenDeltaBatch(worker_id=self.ctx.worker_id, deltas=deltas, started=starting.get(reply_to, []))
            await self.ctx.push(reply_to, batch)
        for reply_to, done in embeddings.items():  # after `started`: a request may start and end in one step
            await self.ctx.push(reply_to, EmbeddingBatch(worker_id=self.ctx.worker_id, embeddings=done))
        for out in outputs:
            if out.finished:
                if self.out.has_pages(out.request_id):
                    await self.out.send(out.request_id)
                else:
                    self._finished(out.request_id)

    async def between_steps(self) -> None:
        """The KV cache events of the last step (and of what ran in the inbox) as one batch,
        encoded once: to the scheduler (in order on the one scheduler socket; a snapshot when
        due) and, with --kv-events-config, to the PUB socket. First the transfers due between steps:
        the kept pages a migrated request asked for (HandoffOut.resend), then those that waited for
        room in flight."""
        await self.out.send_between_steps()
        payload, messages = self.kv_events.take()
        if payload is not None and self.kv_events_publisher is not None:
            self.kv_events_publisher.send(payload)
        for msg in messages:
            self.ctx.to_scheduler(msg)

    def load(self) -> Load:
        blocks, sched = self.engine.blocks, self.engine.scheduler
        received = self.incoming.bytes_received if self.incoming is not None else 0
        return Load(
            running=len(sched.running),
            waiting=len(sched.waiting),
            produced=self.produced,
            kv=KVPoolLoad(
                free_pages=blocks.num_free_pages,
                used_pages=blocks.num_used_pages,
                total_pages=blocks.num_usable_pages,
                bytes_sent=self.out.bytes_sent,
                bytes_received=received,
            ),
            speculation=self._speculation(),
            lora=lora_load(self.engine),
        )

    def _speculation(self) -> SpeculationLoad | None:
        if self.engine.scheduler.speculator is None:
            return None
        stats = self.engine.stats.speculation
        return SpeculationLoad(
            verify_passes=stats.passes,
            draft_tokens=stats.proposed,
            accepted_tokens=stats.accepted,
            accepted_per_pos=list(stats.accepted_per_pos),
        )

    def held(self) -> list[HeldRequest]:
        held = {rid: HeldRequest(request_id=rid, reply_to=reply_to) for rid, reply_to in self.reply_to.items()}
        for h in self.incoming.held() if self.incoming is not None else ():
            held.setdefault(h.request_id, h)
        return list(held.values())

    def registered_again(self) -> None:
        self.kv_events.resync()
        # a scheduler that did not know this worker (restarted, or counted it lost) does not know
        # which requests' pages it kept either: none would be freed at their end, so free them now
        if released := self.engine.release_kept():
            self.ctx.log.info("kept pages freed: the scheduler registered this worker again", requests=released)

    def background(self) -> list:
        loops = [self._deadline_loop()]
        if self.incoming is not None:
            loops.append(self.incoming.receive_loop())
        if self.image_rows is not None:
            loops.append(self.image_rows.receive_loop())
        return loops

    def close(self) -> None:
        self.out.close()
        if self.kv_events_publisher is not None:
            self.kv_events_publisher.close()
        if self.incoming is not None:
            self.incoming.close()
        if self.image_rows is not None:
            self.image_rows.close()

    # ---- inside -----------------------------------------------------------------------------
    def _started(self, request_id: str, reply_to: str, num_prompt_tokens: int) -> None:
        """Tell the tokenizer a worker holds it (before any of its tokens, in the next step's
        batch): a scheduler restart does not fail it from here on."""
        self.reply_to[request_id] = reply_to
        started = RequestStarted(request_id=request_id, num_prompt_tokens=num_prompt_tokens)
        self.starting.setdefault(reply_to, []).append(started)

    def _imported(self, task: DecodeTask) -> None:
        if task.request_id not in self.engine.requests:  # every choice ended on its first token
            self.reply_to[task.request_id] = task.reply_to
            self._finished(task.request_id)
            return
        # the decode half holds it now: its tokenizer counts this worker's tokens from here on,
        # also when this worker was one of the request's lost holders before it moved (a
        # migrated request prefilled again and handed to the same decode worker)
        self._started(task.request_id, task.reply_to, len(task.prompt_token_ids))

    def _finished(self, request_id: str) -> None:
        self._left(request_id, DoneReason.FINISHED)

    def _left(self, request_id: str, reason: DoneReason) -> None:
        self._forget(request_id)
        self.ctx.done(request_id, reason)

    def _forget(self, request_id: str) -> None:
        self.reply_to.pop(request_id, None)
        self.scheduler_queued.pop(request_id, None)
        self.out.forget(request_id)

    def _send_final(self, request_id: str, reply_to: str, n: int) -> None:
        deltas = [
            TokenDelta(
                request_id=request_id,
                index=i,
                token_ids=[],
                logprobs=None,
                finish_reason=FinishReason.ABORT,
                num_prompt_tokens=0,
            )
            for i in range(n)
        ]
        asyncio.ensure_future(self.ctx.push(reply_to, TokenDeltaBatch(worker_id=self.ctx.worker_id, deltas=deltas)))

    async def _deadline_loop(self) -> None:
        """Transfers that were not acknowledged, and handoff halves whose partner never came,
        give their pages back after `transfer_timeout`."""
        while True:
            await asyncio.sleep(min(1.0, self.config.transfer_timeout / 4))
            self.ctx.post(self._expire)

    def _expire(self) -> None:
        now = time.monotonic()
        self.out.expire(now)
        if self.incoming is not None:
            self.incoming.expire(now)
