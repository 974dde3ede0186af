"""The scheduler without sockets: worker registry, admission, placement, the prefill→decode
handoff's bookkeeping, and failure handling.

    ScheduleRequest ──▶ admit (queue bound) ──▶ place ──▶ PrefillTask → P, DecodeTask → D
                                                     └──▶ GenerateTask → mixed worker
                    (pooling: an embedding) ──▶ place ──▶ GenerateTask(pooling) → one prefill or mixed worker
    ImageRequest    ──▶ admit (its kind's queue) ──▶ place ──▶ ImageTask → diffusion worker
    TranscriptionRequest ──▶ admit (its kind's queue) ──▶ place ──▶ TranscriptionTask → audio worker
    KVEventBatch ──▶ which prefix pages each worker holds, from its KV cache events (placement,
             pages D need not get; a gap asks for a snapshot: services/scheduler/kv_event_index.py)
    RequestDone / worker death / AbortRequest ──▶ forget, tell the other holders, fail if needed
    worker death ──▶ MigrateRequest to the request's tokenizer, which sends it again with the
             tokens streamed (ScheduleRequest.resume): to the prefill worker that kept its pages
             and a decode worker, which replays them, or recomputed on one decode or mixed worker
             (services/scheduler/migration.py; the books and endings: failures.py)
    Ping ──▶ Pong(instance): tokenizers learn that this process restarted (common/liveness.py);
             a tokenizer's Ping gives its token address, where its requests' failures go
    RegisterWorker.held ──▶ a restarted scheduler takes back the requests workers hold

`handle(identity, msg, now)` and `tick(now)` return what to send, in order, as (destination,
message) pairs: a destination is a peer's identity on the scheduler's Router (bytes) or a worker
id (str; a worker's identity is its id). `now` is monotonic seconds from the caller: nothing here
reads a clock, sleeps or touches a socket.

Workers are pooled by (kind, role). A request is placed by its kind: an LLM request
(ScheduleRequest) on (llm, prefill) + (llm, decode) workers, or on one (llm, mixed) worker; an
image request (ImageRequest) on the least loaded (diffusion, mixed) worker serving its model, a
transcription likewise on an (audio, mixed) one (services/scheduler/audio.py).
Each kind has its own admission queue, so images waiting for a diffusion worker never hold up
text, and the reverse. A kind has its entries in `_placers` and `_readiness`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import structlog

from pagemesh.common.messages import (
    AbortRequest,
    ClusterStatus,
    Heartbeat,
    ImageRequest,
    ImageTask,
    KVEventBatch,
    LoRAAdapterDone,
    LoRAAdapterRequest,
    Message,
    MigrateRequest,
    Ping,
    Pong,
    Registered,
    RegisterWorker,
    RequestDone,
    RequestFailed,
    ScheduleRequest,
    StatusRequest,
    TranscriptionRequest,
    UnknownWorker,
    WorkerKind,
    WorkerRole,
    WorkerStopped,
)
from pagemesh.common.multimodal import hash_token_ids
from pagemesh.services.scheduler.audio import place_transcription, unknown_audio_model
from pagemesh.services.scheduler.config import SchedulerConfig
from pagemesh.services.scheduler.failures import Outputs, Placed, PlacedRequests
from pagemesh.services.scheduler.kv_event_index import KVEventIndex
from pagemesh.services.scheduler.loras import MeshAdapters
from pagemesh.services.scheduler.migration import longest_resumed, migrations_of, resume_pairs, resumed_output
from pagemesh.services.scheduler.placement import (
    Placer,
    embedding_workers,
    least_loaded_with_room,
    pairing_problem,
    shapes_in_both,
)
from pagemesh.services.scheduler.placement import too_large_for_every_pool as too_large
from pagemesh.services.scheduler.prefix_index import PromptPages
from pagemesh.services.scheduler.queues import Queued, may_wait, put_first
from pagemesh.services.scheduler.registry import Registry, WorkerInfo
from pagemesh.services.scheduler.tasks import llm_tasks, with_encoder

log = structlog.get_logger()
LLM_ROLES = (WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.MIXED)


class SchedulerCore:
    """All of one scheduler process's state and decisions. Each message is handled whole (no
    call sees another half done); what to send comes back as Outputs. `instance` is the process's
    start id (answered in Pong); `now` at construction is its start, which opens the grace window
    (a heartbeat timeout) in which requests wait for workers that have not registered yet."""

    def __init__(self, config: SchedulerConfig, instance: str, now: float):
        self.config = config
        self.instance = instance
        self.started_at = now
        self.registry = Registry(config.heartbeat_timeout, config.step_timeout)
        self.placer = Placer(config.placement)
        # per kind: request id -> entry, oldest first
        self.queues: dict[WorkerKind, OrderedDict[str, Queued]] = {kind: OrderedDict() for kind in WorkerKind}
        # the requests on workers
        self.requests = PlacedRequests(self.registry, config.max_migrations, config.worker_return_wait > 0)
        self.last_loss: float | None = None  # when a worker was last lost (requests may wait for its return)
        self.migrations = 0  # resumed requests received (metrics)
        self.adapters = MeshAdapters(config.lora_modules)  # the LoRA adapters the mesh serves
        self.log = log.bind(service="scheduler")
        self.kv_events = KVEventIndex(self.registry, self.log)  # the workers' prefix keys
        self._handlers: dict[type, Callable[[bytes, Message, float, Outputs], None]] = {
            RegisterWorker: self._on_register,
            Heartbeat: self._on_heartbeat,
            WorkerStopped: self._on_worker_stopped,
            KVEventBatch: self.kv_events.receive,
            ScheduleRequest: self._on_schedule,
            ImageRequest: self._on_image,
            TranscriptionRequest: self._on_transcription,
            RequestDone: self._on_done,
            AbortRequest: self._on_abort,
            StatusRequest: self._on_status,
            Ping: self._on_ping,
            LoRAAdapterRequest: self._on_lora_request,
            LoRAAdapterDone: self._on_lora_done,
        }
        self._placers: dict[WorkerKind, Callable[[Queued, float, Outputs], bool]] = {
            WorkerKind.LLM: self._place_llm,
            WorkerKind.DIFFUSION: self._place_image,
            WorkerKind.AUDIO: self._place_transcription,
        }
        self._readiness: dict[WorkerKind, Callable[[float], bool]] = {
            WorkerKind.LLM: self._llm_can_serve,
            WorkerKind.DIFFUSION: lambda now: bool(self.registry.alive(WorkerKind.DIFFUSION, WorkerRole.MIXED, now)),
            WorkerKind.AUDIO: lambda now: bool(self.registry.alive(WorkerKind.AUDIO, WorkerRole.MIXED, now)),
        }

    @property
    def placed(self) -> dict[str, Placed]:
        """The requests on workers, by request id."""
        return self.requests.placed

    @property
    def tokenizers(self) -> dict[str, bytes]:
        """A tokenizer's token address -> its identity here."""
        return self.requests.tokenizers

    @property
    def unreported(self) -> dict[str, list[RequestFailed | MigrateRequest]]:
        """Failures and migrations for tokenizers not heard from yet, by token address."""
        return self.requests.unreported

    @property
    def queued(self) -> int:
        """Requests admitted and not placed yet, of every kind."""
        return sum(map(len, self.queues.values()))

    def handle(self, identity: bytes, msg: Message, now: float) -> Outputs:
        """One message from the peer `identity`; returns what to send."""
        handler = self._handlers.get(type(msg))
        out: Outputs = []
        if handler is None:
            self.log.warning("unexpected message", type=type(msg).__name__)
        else:
            handler(identity, msg, now, out)
        return out

    def tick(self, now: float) -> Outputs:
        """Periodic: drop workers whose heartbeats stopped (failing their requests) and, once the
        start-up grace window is over, refuse what waits for a kind of worker no one serves."""
        out: Outputs = []
        for dead in self.registry.expire(now):
            self.last_loss = now
            hung = self.registry.stuck(dead, now)
            self.log.warning("worker lost", worker=dead.worker_id, requests=len(dead.requests), hung=hung)
            why = "is stuck in one step" if hung else "stopped responding"
            self.requests.lost(dead, f"worker {dead.worker_id} {why}", now, out)
            out += self.adapters.worker_gone(dead.worker_id)
            self._place_again(now, out)
        if not self._may_wait(now):
            for queue in self.queues.values():
                for entry in [e for e in queue.values() if not self._can_serve_entry(e, now)]:
                    del queue[entry.request.request_id]  # no worker came
                    why = self._pairing_problem(now) if entry.kind == WorkerKind.LLM else None
                    self._reject(entry.origin, entry.request.request_id, why or "no workers are available", out)
        self.requests.sweep_kept(now, self._known, out)
        return out

    def excuse_silence(self, seconds: float) -> None:
        """This process did not run for `seconds` (stopped, starved): no worker is judged by them
        (their heartbeats are unread); a dead one is found that much later."""
        self.registry.excuse_silence(seconds)

    def _can_serve_entry(self, entry: Queued, now: float) -> bool:
        if entry.kind in (WorkerKind.DIFFUSION, WorkerKind.AUDIO):  # a model's workers run it whole
            return bool(self.registry.serving(entry.kind, entry.model, now))
        if entry.request.pooling is not None:
            return bool(self._embedding_workers(now))
        if entry.request.resume is not None and self._resume_workers(now):
            return True  # a migrated request: one decode or mixed worker can recompute it all
        return self.can_serve(entry.kind, now)

    def _resume_workers(self, now: float) -> list[WorkerInfo]:
        """Where a migrated request with generated tokens may go: it recomputes them itself."""
        decode = self.registry.alive(WorkerKind.LLM, WorkerRole.DECODE, now)
        return decode + self.registry.alive(WorkerKind.LLM, WorkerRole.MIXED, now)

    def _embedding_workers(self, now: float) -> list[WorkerInfo]:
        """Where an embedding request may go: a worker that prefills (placement.embedding_workers)."""
        alive = self.registry.alive
        return embedding_workers(
            alive(WorkerKind.LLM, WorkerRole.PREFILL, now), alive(WorkerKind.LLM, WorkerRole.MIXED, now)
        )

    def can_serve(self, kind: WorkerKind, now: float) -> bool:
        """Some live workers can take a request of this kind."""
        ready = self._readiness.get(kind)
        return ready is not None and ready(now)

    def is_ready(self, now: float) -> bool:
        """Every kind the mesh serves can take a request (an LLM pool: a mixed worker, or a prefill
        and a decode one of one size). The kinds are the configured ones (`--serves`, which `pagemesh
        up` sets). With none configured: the LLM pools, or in a mesh with no LLM worker, the pool of a
        kind registered (diffusion, audio: a lone one registered before the LLM ones would then read
        as ready)."""
        if self.config.serves:
            return all(self.can_serve(kind, now) for kind in self.config.serves)
        kinds = {w.kind for w in self.registry.workers.values()} - {WorkerKind.ENCODER}
        llm = WorkerKind.LLM in kinds or not kinds
        return self.can_serve(WorkerKind.LLM, now) if llm else any(self.can_serve(k, now) for k in kinds)

    def status(self, now: float) -> ClusterStatus:
        """`ready`: see `is_ready`."""
        return ClusterStatus(
            ready=self.is_ready(now),
            workers=[w.status(self.registry.is_alive(w, now)) for w in self.registry.workers.values()],
            queued=self.queued,
            migrations=self.migrations,
            lora_adapters=self.adapters.listed(),
            **self.kv_events.counts(),
        )

    # ---- workers --------------------------------------------------------------------------
    def _on_register(self, identity: bytes, msg: RegisterWorker, now: float, out: Outputs) -> None:
        replaced = self.registry.register(WorkerInfo.registered(msg, now))
        self.log.info(
            "worker registered",
            worker=msg.worker_id,
            kind=msg.kind,
            role=msg.role,
            pages=msg.kv.num_pages if msg.kv else 0,
        )
        out.append((identity, Registered(worker_id=msg.worker_id)))
        if msg.role in (WorkerRole.PREFILL, WorkerRole.DECODE) and (problem := self._pairing_problem(now)):
            self.log.warning("prefill and decode workers cannot pair", worker=msg.worker_id, problem=problem)
        if replaced is not None:  # a new process under the id: the old one's requests are gone
            self.log.warning("worker restarted", worker=msg.worker_id, requests=len(replaced.requests))
            self.requests.lost(replaced, f"worker {msg.worker_id} restarted", now, out)
            self._place_again(now, out, drain=False)  # placed with the rest below
        for held in msg.held or ():  # placed by an earlier scheduler process: keep them in the books
            migrations = 0 if msg.kind == WorkerKind.LLM else None  # the count before the restart is lost
            placed = self.placed.setdefault(
                held.request_id, Placed(held.request_id, held.reply_to, set(), None, migrations)
            )
            placed.holders.add(msg.worker_id)
            if msg.role == WorkerRole.PREFILL:
                placed.prefill = msg.worker_id
            self.registry.workers[msg.worker_id].requests.add(held.request_id)
        self._drain(now, out)

    def _on_heartbeat(self, identity: bytes, msg: Heartbeat, now: float, out: Outputs) -> None:
        if self.registry.heartbeat(msg, now):
            if msg.lora is not None:  # a worker that serves adapters: the mesh's, no more, no fewer
                out += self.adapters.sync(msg.worker_id, msg.lora.known)
            self._drain(now, out)
        else:  # this scheduler was restarted, or dropped the worker: it must register again
            # to the worker's own socket: heartbeats come from a send-only socket of their own
            out.append((msg.worker_id, UnknownWorker(worker_id=msg.worker_id)))

    def _on_worker_stopped(self, identity: bytes, msg: WorkerStopped, now: float, out: Outputs) -> None:
        """A worker whose engine failed (or that drained) leaves now, not at the heartbeat timeout."""
        gone = self.registry.remove(msg.worker_id, msg.instance)
        if gone is None:
            return  # an old process's late word, or a worker already dropped
        self.log.warning("worker stopped", worker=msg.worker_id, requests=len(gone.requests), error=msg.error)
        self.last_loss = now
        # the error's text stays in the logs: clients learn that the engine failed, not its internals
        why = f"the engine of worker {msg.worker_id} failed" if msg.error else f"worker {msg.worker_id} stopped"
        self.requests.lost(gone, why, now, out)
        out += self.adapters.worker_gone(msg.worker_id)
        self._place_again(now, out)

    # ---- admission and placement ----------------------------------------------------------
    def _known(self, request_id: str) -> bool:
        return request_id in self.placed or any(request_id in q for q in self.queues.values())

    def _on_schedule(self, identity: bytes, msg: ScheduleRequest, now: float, out: Outputs) -> None:
        if self._known(msg.request_id):
            return  # sent again by a tokenizer that saw this process start: it has it already
        lora = msg.sampling.lora
        if lora is not None and not self.adapters.serves(lora):  # unloaded since the gateway looked
            return self._refuse(
                identity, msg.request_id, 404, f"The model `{lora}` does not exist.", "model_not_found", out
            )
        if msg.resume is not None:
            self.migrations += 1
            self.log.info("request migrating", request_id=msg.request_id, migrations=msg.resume.migrations)
        # what the worker will (re)compute; an adapter's pages have keys of their own (page_hash.root_hash),
        # an image's placeholders by its content (common/multimodal.py's hash_token_ids)
        prompt = PromptPages(hash_token_ids(msg.prompt_token_ids, msg.images) + resumed_output(msg), lora=lora)
        roles = (self.registry.alive(WorkerKind.LLM, r, now) for r in LLM_ROLES)
        if msg.pooling is not None:  # an embedding: its prompt alone, on a worker that prefills
            roles = ([], [], self._embedding_workers(now))
        length = len(msg.prompt_token_ids) + longest_resumed(msg)  # the longest choice it recomputes
        refusal = too_large(*roles, max(length, len(prompt.token_ids)), decode_alone=msg.resume is not None)
        if refusal is not None:
            return self._refuse(identity, msg.request_id, 400, refusal, None, out)
        self._admit(identity, Queued(identity, msg, prompt, WorkerKind.LLM, now), out, now)

    def _on_image(self, identity: bytes, msg: ImageRequest, now: float, out: Outputs) -> None:
        if self._known(msg.request_id):
            return
        if msg.model is not None and not self._starting(now):
            served = self.registry.known_models(WorkerKind.DIFFUSION)
            if served and msg.model not in served:
                return self._refuse(
                    identity,
                    msg.request_id,
                    404,
                    f"The model `{msg.model}` does not exist; image models served: {', '.join(sorted(served))}.",
                    "model_not_found",
                    out,
                )
        self._admit(identity, Queued(identity, msg, None, WorkerKind.DIFFUSION, now, model=msg.model), out, now)

    def _on_transcription(self, identity: bytes, msg: TranscriptionRequest, now: float, out: Outputs) -> None:
        if self._known(msg.request_id):
            return
        if not self._starting(now) and (unknown := unknown_audio_model(self.registry, msg.model)):
            return self._refuse(identity, msg.request_id, 404, unknown, "model_not_found", out)
        self._admit(identity, Queued(identity, msg, None, WorkerKind.AUDIO, now, model=msg.model), out, now)

    def _admit(self, identity: bytes, entry: Queued, out: Outputs, now: float) -> None:
        """Queue a request on its kind's queue, or refuse it (no worker of its kind, queue full)."""
        request_id = entry.request.request_id
        if not self._can_serve_entry(entry, now) and not self._may_wait(now):
            why = self._pairing_problem(now) if entry.kind == WorkerKind.LLM else None
            return self._reject(identity, request_id, why or "no workers are available", out)
        queue = self.queues[entry.kind]
        if len(queue) >= self.config.max_queue:
            return self._reject(identity, request_id, "the request queue is full", out)
        self.tokenizers[entry.request.reply_to] = identity
        queue[request_id] = entry
        self._drain(now, out)

    def _reject(self, identity: bytes, request_id: str, why: str, out: Outputs) -> None:
        self._refuse(identity, request_id, 503, f"Service unavailable: {why}; retry later.", "overloaded", out)

    def _refuse(self, identity: bytes, request_id: str, status: int, text: str, code: str | None, out: Outputs) -> None:
        self.log.info("request rejected", request_id=request_id, reason=text)
        self.requests.free_kept(request_id, text, out)  # a moved request's, if kept
        error_type = "server_error" if status >= 500 else "invalid_request_error"
        param = "model" if code == "model_not_found" else "prompt" if text.startswith("prompt:") else None
        failed = RequestFailed(
            request_id=request_id, status=status, error_type=error_type, message=text, param=param, code=code
        )
        out.append((identity, failed))

    def _drain(self, now: float, out: Outputs) -> None:
        """Place each kind's queued requests, oldest first, while some worker can take them."""
        for kind, queue in self.queues.items():
            while queue:
                entry = next(iter(queue.values()))
                if not self._placers[kind](entry, now, out):
                    break

    def _place_llm(self, entry: Queued, now: float, out: Outputs) -> bool:
        """Place an LLM request (disaggregated, or on a mixed worker); False if none can take it now."""

        def alive(role: WorkerRole) -> list[WorkerInfo]:
            return self.registry.alive(WorkerKind.LLM, role, now)

        req = entry.request
        resumed = resumed_output(req)
        if req.pooling is not None:  # an embedding: its prompt alone, on one worker that prefills
            placement = self.placer.place_prefill_only(self._embedding_workers(now), entry.prompt)
        elif req.resume is None:
            placement = self.placer.place(
                alive(WorkerRole.PREFILL), alive(WorkerRole.DECODE), alive(WorkerRole.MIXED), entry.prompt
            )
        else:  # migrated: an exact resume from the prefill worker that kept its pages, or recomputed
            # where it goes (migration.py); a lone decode worker will do as a mixed one
            keeper = self.requests.kept.get(req.request_id)
            pairs = resume_pairs(req, keeper, alive(WorkerRole.PREFILL), alive(WorkerRole.DECODE))
            placement = self.placer.place(*pairs, self._resume_workers(now), entry.prompt)
        if placement is None:
            return False
        del self.queues[WorkerKind.LLM][req.request_id]
        queued = now - entry.enqueued_at
        tasks = llm_tasks(req, placement, queued, resumed, self.requests.kept_ids.get(req.request_id, ""))
        holders = {worker_id for worker_id, _ in tasks}  # not an encoder worker: its loss strands nothing
        handed_off = placement.prefill.worker_id if len(tasks) == 2 else None  # the prefill worker
        if req.images:
            encoders = self.registry.alive(WorkerKind.ENCODER, WorkerRole.MIXED, now)
            tasks = with_encoder(req, tasks, encoders, self.registry.workers)
        out += tasks
        for wid in holders:
            self.registry.workers[wid].requests.add(req.request_id)
        self.placed[req.request_id] = Placed(req.request_id, req.reply_to, holders, handed_off, migrations_of(req))
        return True

    def _place_image(self, entry: Queued, now: float, out: Outputs) -> bool:
        """Place an image request on the least loaded diffusion worker of its model with room."""
        worker = least_loaded_with_room(self.registry.serving(WorkerKind.DIFFUSION, entry.model, now))
        if worker is None:
            return False
        req = entry.request
        task = ImageTask(
            request_id=req.request_id, params=req.params, reply_to=req.reply_to, queued_s=now - entry.enqueued_at
        )
        self._hand_over(entry, worker, task, out)
        return True

    def _place_transcription(self, entry: Queued, now: float, out: Outputs) -> bool:
        """Place a transcription on an audio worker (services/scheduler/audio.py)."""
        placed = place_transcription(self.registry, entry.request, now - entry.enqueued_at, now)
        if placed is not None:
            self._hand_over(entry, *placed, out)
        return placed is not None

    def _hand_over(self, entry: Queued, worker: WorkerInfo, task: Message, out: Outputs) -> None:
        """A request its one worker runs whole (an image, a transcription): sent, and booked there
        with its queue entry (it does not migrate: when its worker is lost, it starts over)."""
        req = entry.request
        del self.queues[entry.kind][req.request_id]
        out.append((worker.worker_id, task))
        worker.requests.add(req.request_id)
        self.placed[req.request_id] = Placed(req.request_id, req.reply_to, {worker.worker_id}, None, None, entry)

    def _place_again(self, now: float, out: Outputs, drain: bool = True) -> None:
        """Images and transcriptions whose worker was lost: back at the head of their queue, placed if they can be."""
        for entry in self.requests.take_restarted():
            entry = put_first(self.queues[entry.kind], entry)
            self.log.info("request placed again", request_id=entry.request.request_id, restarts=entry.restarts)
        if drain:
            self._drain(now, out)

    def _llm_can_serve(self, now: float) -> bool:
        prefill, decode, mixed = (self.registry.alive(WorkerKind.LLM, r, now) for r in LLM_ROLES)
        return bool(mixed) or bool(shapes_in_both(prefill, decode))

    def _pairing_problem(self, now: float) -> str | None:
        """Why the live prefill and decode workers cannot pair (different parallel shapes: tp x pp)."""
        alive = self.registry.alive
        return pairing_problem(
            alive(WorkerKind.LLM, WorkerRole.PREFILL, now), alive(WorkerKind.LLM, WorkerRole.DECODE, now)
        )

    def _starting(self, now: float) -> bool:
        """Within a heartbeat timeout of this process's start, workers may not have registered
        yet (a restarted scheduler): requests wait for them rather than being refused."""
        return now - self.started_at <= self.config.heartbeat_timeout

    def _may_wait(self, now: float) -> bool:
        cfg, silent = self.config, any(not self.registry.is_alive(w, now) for w in self.registry.workers.values())
        last_loss = now if silent else self.last_loss  # a silent worker is being lost: its loss is now
        return may_wait(now, self.started_at, cfg.heartbeat_timeout, last_loss, cfg.worker_return_wait)

    # ---- endings (services/scheduler/failures.py) ----------------------------------------
    def _on_done(self, identity: bytes, msg: RequestDone, now: float, out: Outputs) -> None:
        self.requests.done(msg, out)
        self._drain(now, out)

    def _on_abort(self, identity: bytes, msg: AbortRequest, now: float, out: Outputs) -> None:
        for queue in self.queues.values():
            queue.pop(msg.request_id, None)
        self.requests.abort(msg, out)

    # ---- peers ----------------------------------------------------------------------------
    def _on_ping(self, identity: bytes, msg: Ping, now: float, out: Outputs) -> None:
        if msg.address is not None:
            self.requests.tokenizer_pinged(msg.address, identity, out)
        out.append((identity, Pong(service="scheduler", instance=self.instance)))

    def _on_status(self, identity: bytes, msg: StatusRequest, now: float, out: Outputs) -> None:
        out.append((identity, self.status(now)))

    # ---- LoRA adapters (services/scheduler/loras.py) -------------------------------------------
    def _on_lora_request(self, identity: bytes, msg: LoRAAdapterRequest, now: float, out: Outputs) -> None:
        workers = [w.worker_id for w in self.registry.workers.values() if w.kind == WorkerKind.LLM]
        workers = [w for w in workers if self.registry.is_alive(self.registry.workers[w], now)]
        self.log.info("lora adapter request", op=msg.op, name=msg.name, path=msg.path, workers=len(workers))
        out += self.adapters.request(identity, msg, workers)

    def _on_lora_done(self, identity: bytes, msg: LoRAAdapterDone, now: float, out: Outputs) -> None:
        if msg.status == 200:
            self.registry.lora_changed(msg.worker_id, msg.op_id, self.adapters.ops.get(msg.op_id))
        else:
            self.log.warning("lora adapter task failed", worker=msg.worker_id, op_id=msg.op_id, error=msg.message)
        out += self.adapters.done(msg)
        self._drain(now, out)
