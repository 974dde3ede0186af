"""`POST /v1/audio/transcriptions`: OpenAI's speech-to-text API, served by the mesh's audio workers.

    multipart form ──parse_transcription_form (a 400 names the field)──▶ TranscriptionRequest
        ──▶ scheduler ──▶ an audio worker: the file decoded (WAV), Whisper greedy, detokenized
    ◀── TranscriptionResult, or RequestFailed (the worker's 400 for a file it cannot read; the
        scheduler's 404 unknown model, 503 no worker / queue full; a worker lost: 503)
    ──▶ {"text", "usage": {"type": "duration", "seconds"}} (json), or the text alone (text)

What the worker does is all it can do: one 30-second window, greedy decoding, the checkpoint's
default prompt (its language detected). So `temperature` other than 0, `language`, `prompt`,
`timestamp_granularities[]`, a `response_format` with segments or timestamps (verbose_json, srt,
vtt) and `stream` true are 400s naming the field, as is any field OpenAI's API does not have:
none is ignored. The file is read whole (the body is bounded by --max-body-bytes: a 413).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import structlog
from aiohttp import web

from pagemesh.common.messages import RequestFailed, TranscriptionRequest, TranscriptionResult
from pagemesh.gateway.auth import API_KEY
from pagemesh.gateway.config import GatewayConfig
from pagemesh.gateway.errors import ApiError, from_request_failed, invalid
from pagemesh.gateway.limits import KeyLimits
from pagemesh.gateway.mesh import MeshClient
from pagemesh.gateway.metrics import GatewayMetrics
from pagemesh.gateway.responses import to_json

log = structlog.get_logger()

RESPONSE_FORMATS = ("json", "text")
# OpenAI's fields this server refuses, and why
REFUSED = {
    "language": "the language is detected from the audio (the checkpoint's default prompt)",
    "prompt": "decoding starts from the checkpoint's default prompt",
    "timestamp_granularities[]": "no timestamps are produced",
    "timestamp_granularities": "no timestamps are produced",
}
KNOWN = ("file", "model", "response_format", "temperature", "stream", *REFUSED)


@dataclass(frozen=True)
class UploadedFile:
    """A form field that carried a file: its name as the client gave it, and its bytes."""

    filename: str | None
    data: bytes


@dataclass(frozen=True)
class TranscriptionCall:
    """A checked transcription form."""

    model: str | None
    audio: bytes
    response_format: str


def parse_transcription_form(fields: Iterable[tuple[str, str | UploadedFile]]) -> TranscriptionCall:
    """The form's (name, value) pairs in order (a file's value: UploadedFile) -> the call; raises
    a 400 ApiError naming the first bad field."""
    values: dict[str, str | UploadedFile] = {}
    for name, value in fields:
        if name not in KNOWN:
            raise invalid(f"{name[:64]}: unknown field; accepted: file, model, response_format, temperature", name[:64])
        if name in REFUSED:
            param = name.removesuffix("[]")
            raise invalid(f"{param}: not supported ({REFUSED[name]})", param)
        if name in values:
            raise invalid(f"{name}: given more than once", name)
        if name != "file" and isinstance(value, UploadedFile):
            raise invalid(f"{name}: must be a form field, not a file", name)
        values[name] = value
    file = values.get("file")
    if file is None:
        raise invalid("file: required (the audio, uploaded as multipart/form-data)", "file")
    if not isinstance(file, UploadedFile):
        raise invalid("file: must be an uploaded file (multipart/form-data), not a text field", "file")
    if not file.data:
        raise invalid("file: the uploaded file is empty", "file")
    model = values.get("model")
    if model is not None and not model:
        raise invalid("model: must be a non-empty string", "model")
    response_format = values.get("response_format", "json")
    if response_format not in RESPONSE_FORMATS:
        shown = repr(response_format[:40])
        raise invalid(f"response_format: {shown} is not supported; use 'json' or 'text'", "response_format")
    _check_temperature(values.get("temperature"))
    if values.get("stream", "false").lower() != "false":
        raise invalid("stream: streamed transcriptions are not supported; leave it out or false", "stream")
    return TranscriptionCall(model=model, audio=file.data, response_format=response_format)


def _check_temperature(value: str | None) -> None:
    if value is None:
        return
    try:
        temperature = float(value)
    except ValueError:
        raise invalid("temperature: must be a number", "temperature") from None
    if temperature != 0:
        raise invalid("temperature: only 0 is supported (decoding is greedy)", "temperature")


def transcription_response(call: TranscriptionCall, result: TranscriptionResult) -> web.Response:
    """OpenAI's answer: the Transcription object (json), or the text alone (text)."""
    if call.response_format == "text":
        return web.Response(text=result.text, content_type="text/plain")
    usage = {"type": "duration", "seconds": math.ceil(result.audio_seconds)}
    return web.Response(body=to_json({"text": result.text, "usage": usage}), content_type="application/json")


async def read_form(request: web.Request, max_body_bytes: int) -> list[tuple[str, str | UploadedFile]]:
    """The multipart form's fields, files read whole (a body over `max_body_bytes`: 413)."""
    if request.content_length is not None and request.content_length > max_body_bytes:
        raise ApiError(
            413, f"request body larger than {max_body_bytes} bytes", "invalid_request_error", None, "request_too_large"
        )
    if request.content_type != "multipart/form-data":
        raise invalid("file: required, in a multipart/form-data body (the audio file and form fields)", "file")
    try:
        form = await request.post()  # aiohttp bounds it by the application's client_max_size
    except ValueError as e:
        raise invalid(f"file: the multipart body cannot be read ({str(e)[:200]})", "file") from None
    return [(name, _form_value(name, value)) for name, value in form.items()]


def _form_value(name: str, value: str | bytes | bytearray | web.FileField) -> str | UploadedFile:
    """A file's bytes, or a field's text. aiohttp gives a part with no filename as text if its type
    is text (or none), else as bytes: bytes named `file` are the upload, any other must be UTF-8."""
    if isinstance(value, web.FileField):
        return UploadedFile(value.filename, value.file.read())
    if isinstance(value, str):
        return value
    if name == "file":
        return UploadedFile(None, bytes(value))
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(f"{name[:64]}: must be UTF-8 text", name[:64]) from None


class AudioRoute:
    """The handler: one TranscriptionRequest in the mesh, straight to the scheduler (no tokenizer
    on its path), its one reply awaited up to the request timeout; a client that leaves first (or
    a timeout) aborts it, freeing its place in the worker's batch."""

    def __init__(self, config: GatewayConfig, mesh: MeshClient, limits: KeyLimits, metrics: GatewayMetrics):
        self.config, self.mesh, self.limits, self.metrics = config, mesh, limits, metrics

    async def handle(self, request: web.Request) -> web.Response:
        try:
            return await self._transcribe(request)
        except ApiError as e:
            self.metrics.transcription_request(e.status)
            raise

    async def _transcribe(self, request: web.Request) -> web.Response:
        arrival = time.monotonic()
        call = parse_transcription_form(await read_form(request, self.config.max_body_bytes))
        admission = self.limits.admit(request[API_KEY], None)  # concurrency only: no prompt tokens
        request_id = f"trsc-{uuid.uuid4().hex}"
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                request_msg = TranscriptionRequest(
                    request_id=request_id,
                    model=call.model,
                    audio=call.audio,
                    max_tokens=None,
                    reply_to=self.mesh.reply_to,
                    arrival_time=time.time(),
                )
                reply = await self.mesh.call_direct(request_msg, arrival, self.config.request_timeout)
                if isinstance(reply, RequestFailed):
                    log.info("transcription failed", status=reply.status, error=reply.message)
                    raise from_request_failed(reply)
                assert isinstance(reply, TranscriptionResult), reply
                log.info("transcription done", audio_seconds=reply.audio_seconds, tokens=reply.tokens)
                self.metrics.transcription_request(200, time.monotonic() - arrival, reply.audio_seconds)
                return transcription_response(call, reply)
            finally:
                admission.finish(0)
