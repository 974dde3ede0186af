"""The audio worker: an `AudioEngine` (Whisper, continuous batching) behind the worker shell.

TranscriptionTask ─▶ decode_audio + engine.admit (a file it cannot take: a 400 to the gateway)
                 ─▶ one batched engine step per shell step (one token per running request)
                 ─▶ a finished request: its tokens as text, TranscriptionResult to the
                    gateway (`reply_to`), RequestDone
AbortRequest ─▶ engine.abort at the next step boundary (its pages are free for the next step)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pagemesh.common.messages import (
    DoneReason,
    HeldRequest,
    RequestFailed,
    TranscriptionResult,
    TranscriptionTask,
    WorkerKind,
    WorkerRole,
)
from pagemesh.workers.audio.audio_files import SAMPLE_RATE, decode_audio
from pagemesh.workers.audio.engine import AudioEngine, AudioOutput
from pagemesh.workers.audio.transcript import TranscriptDecoder
from pagemesh.workers.shell.backend import Load, Registration, WorkerContext


@dataclass
class _Transcription:
    """A request on this worker: where its answer goes, and its tokens so far."""

    reply_to: str
    audio_seconds: float
    queued_s: float
    admitted_at: float
    token_ids: list[int] = field(default_factory=list)


class AudioWorker:
    """A `WorkerBackend` around one audio engine serving the model `model`; `transcripts` turns a
    finished request's tokens into its text. Each task ends in exactly one of: a TranscriptionResult
    to its `reply_to` then RequestDone(FINISHED); a 400 RequestFailed to its `reply_to` (a file it
    cannot decode or admit) then RequestDone(INVALID); or an abort, after which nothing is sent."""

    task_types = (TranscriptionTask,)

    def __init__(self, engine: AudioEngine, transcripts: TranscriptDecoder, model: str, ctx: WorkerContext):
        self.engine, self.transcripts, self.model, self.ctx = engine, transcripts, model, ctx
        self.step_inline = engine.device.type == "cpu"
        self.requests: dict[str, _Transcription] = {}
        self.produced = 0  # tokens generated, ever (heartbeats carry it: the status page's rate)

    # ---- WorkerBackend ----------------------------------------------------------------------
    def registration(self) -> Registration:
        return Registration(
            kind=WorkerKind.AUDIO, role=WorkerRole.MIXED, model=self.model, max_running=self.engine.max_batch
        )

    def add(self, task: TranscriptionTask) -> None:
        rid = task.request_id
        if rid in self.requests:  # sent again (a restarted scheduler): it runs already
            return
        try:
            samples = decode_audio(task.audio)
            max_tokens = task.max_tokens or self.engine.model.config.max_target_positions  # the engine caps it
            self.engine.admit(rid, samples, max_tokens)
        except ValueError as e:  # the client's file (or max_tokens): a 400 from here, nothing else to do
            self._refuse(task, str(e))
            return
        self.requests[rid] = _Transcription(task.reply_to, samples.size / SAMPLE_RATE, task.queued_s, time.monotonic())

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.requests.pop(request_id, None)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[AudioOutput]:
        return self.engine.step()

    def stalled(self) -> bool:
        return False

    async def publish(self, outputs: list[AudioOutput]) -> None:
        for out in outputs:
            request = self.requests.get(out.request_id)
            if request is None:  # aborted meanwhile
                continue
            request.token_ids += out.new_token_ids
            self.produced += len(out.new_token_ids)
            if out.finished:
                del self.requests[out.request_id]
                await self.ctx.push(request.reply_to, self._result(out.request_id, request))
                self.ctx.done(out.request_id, DoneReason.FINISHED)

    async def between_steps(self) -> None:
        return None

    def load(self) -> Load:
        return Load(running=len(self.engine.running), waiting=len(self.engine.waiting), produced=self.produced)

    def held(self) -> list[HeldRequest]:
        return [HeldRequest(request_id=rid, reply_to=r.reply_to) for rid, r in self.requests.items()]

    def registered_again(self) -> None:
        return None

    def background(self) -> list:
        return []

    def close(self) -> None:
        return None

    # ---- inside -----------------------------------------------------------------------------
    def _result(self, request_id: str, request: _Transcription) -> TranscriptionResult:
        return TranscriptionResult(
            request_id=request_id,
            text=self.transcripts.text(request.token_ids),
            audio_seconds=request.audio_seconds,
            tokens=len(request.token_ids),
            queued_s=request.queued_s,
            compute_s=time.monotonic() - request.admitted_at,
        )

    def _refuse(self, task: TranscriptionTask, error: str) -> None:
        """A 400 naming the field: `file` for what the audio is, else the engine's field."""
        field_name, sep, _ = error.partition(":")
        param = field_name if sep and field_name.isidentifier() and field_name != "audio" else "file"
        message = f"file: {error.removeprefix('audio: ')}" if param == "file" else error
        self.ctx.log.info("transcription invalid", request_id=task.request_id, error=message)
        failed = RequestFailed(
            request_id=task.request_id,
            status=400,
            error_type="invalid_request_error",
            message=message,
            param=param,
            code=None,
        )
        asyncio.ensure_future(self.ctx.push(task.reply_to, failed))  # from `add` (not a coroutine)
        self.ctx.done(task.request_id, DoneReason.INVALID, message)
