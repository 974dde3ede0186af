"""The audio channel: gateway ⇄ scheduler ⇄ audio workers (speech to text, `--audio N`).

    gateway   ──TranscriptionRequest──▶ scheduler ──TranscriptionTask──▶ audio worker
    gateway   ◀──TranscriptionResult / RequestFailed── audio worker (to the request's `reply_to`)
    gateway   ◀──RequestFailed── scheduler (refused: no worker, unknown model, queue full)
    gateway   ──AbortRequest──▶ scheduler ──AbortRequest──▶ audio worker (client gone)

No tokenizer service is on this path: the audio worker detokenizes its own model's output. The
audio travels as the file the client uploaded; the worker decodes it (a file it cannot read is a
400 it sends the gateway itself, as a diffusion worker does for a bad image request).
"""

from __future__ import annotations

from pagemesh.common.messages.base import ProtocolError, message


@message
class TranscriptionRequest:
    """Gateway -> scheduler: a transcription to place on an audio worker. `model` None: the
    mesh's audio model (the only one, or the first registered); `max_tokens` None: as many as
    the model's decoder holds."""

    request_id: str
    model: str | None
    audio: bytes  # the uploaded file, as the client sent it
    max_tokens: int | None
    reply_to: str  # the gateway's reply address
    arrival_time: float

    def _check(self) -> None:
        _check_audio("TranscriptionRequest", self.audio, self.max_tokens)


@message
class TranscriptionTask:
    """Scheduler -> audio worker."""

    request_id: str
    audio: bytes
    max_tokens: int | None
    reply_to: str
    queued_s: float = 0.0  # time the request waited in the scheduler

    def _check(self) -> None:
        _check_audio("TranscriptionTask", self.audio, self.max_tokens)


@message
class TranscriptionResult:
    """Audio worker -> gateway: the transcript, with what it took."""

    request_id: str
    text: str
    audio_seconds: float  # the clip's length
    tokens: int  # tokens the model generated (its end token included)
    queued_s: float  # in the scheduler's queue
    compute_s: float  # from its admission on the worker to its text (its wait for a batch slot included)


def _check_audio(where: str, audio: bytes, max_tokens: int | None) -> None:
    if not audio:
        raise ProtocolError(f"{where}.audio: an empty file")
    if max_tokens is not None and max_tokens < 1:
        raise ProtocolError(f"{where}.max_tokens: must be >= 1")
