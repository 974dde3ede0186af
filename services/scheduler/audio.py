"""Where a transcription runs: one audio worker, which does the whole request. Pure Python.

    TranscriptionRequest ──(a model no audio worker serves: 404)──▶ the audio queue
        ──▶ the least loaded live audio worker of its model with room ──TranscriptionTask──▶ it

As an image request on a diffusion worker: `model` None is the mesh's audio model (the first
registered live worker's), load is the worker's requests over its `max_running` (its engine's
batch), ties go to the lower id. A request no worker has room for waits in the audio queue, which
holds up no other kind. A lost audio worker fails its requests (a transcription does not migrate).
"""

from __future__ import annotations

from pagemesh.common.messages import TranscriptionRequest, TranscriptionTask, WorkerKind
from pagemesh.services.scheduler.placement import least_loaded_with_room
from pagemesh.services.scheduler.registry import Registry, WorkerInfo


def audio_workers(registry: Registry, model: str | None, now: float) -> list[WorkerInfo]:
    """The live audio workers a transcription for `model` may go to."""
    return registry.serving(WorkerKind.AUDIO, model, now)


def unknown_audio_model(registry: Registry, model: str | None) -> str | None:
    """The 404's text for a model no audio worker of this mesh serves (or served) while others
    are; None if it is one of them (then it waits, or gets a 503 while none is live), no model was
    named, or no audio worker ever registered."""
    served = registry.known_models(WorkerKind.AUDIO)
    if model is None or not served or model in served:
        return None
    return f"The model `{model}` does not exist; audio models served: {', '.join(sorted(served))}."


def place_transcription(
    registry: Registry, request: TranscriptionRequest, queued_s: float, now: float
) -> tuple[WorkerInfo, TranscriptionTask] | None:
    """The worker and its task (`queued_s`: the request's wait here), or None while every audio
    worker of its model is full."""
    worker = least_loaded_with_room(audio_workers(registry, request.model, now))
    if worker is None:
        return None
    task = TranscriptionTask(
        request_id=request.request_id,
        audio=request.audio,
        max_tokens=request.max_tokens,
        reply_to=request.reply_to,
        queued_s=queued_s,
    )
    return worker, task
