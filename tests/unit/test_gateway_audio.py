"""`POST /v1/audio/transcriptions` at the gateway: the form's checks (pure: every refusal is a 400
naming its field), and the route over real sockets to a fake scheduler: what it sends, the
answer's two shapes, the scheduler's refusal, the body limit, a timeout's abort."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pagemesh.common.messages import AbortRequest, RequestFailed, TranscriptionRequest, TranscriptionResult
from pagemesh.gateway.audio import TranscriptionCall, UploadedFile, parse_transcription_form
from pagemesh.gateway.errors import ApiError
from pagemesh.tests.gateway_harness import FakeMesh, run

WAV = UploadedFile("a.wav", b"RIFF....WAVE")


def parse(*fields: tuple[str, object]) -> TranscriptionCall:
    return parse_transcription_form(list(fields))


def refusal(*fields: tuple[str, object]) -> tuple[str | None, str]:
    with pytest.raises(ApiError) as e:
        parse(*fields)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value.param, e.value.message


def test_a_file_alone_is_json_for_the_default_model():
    assert parse(("file", WAV)) == TranscriptionCall(model=None, audio=b"RIFF....WAVE", response_format="json")


def test_the_fields_that_change_nothing_or_say_what_is_done_are_accepted():
    call = parse(
        ("model", "whisper-tiny"),
        ("file", WAV),
        ("response_format", "text"),
        ("temperature", "0.0"),
        ("stream", "false"),
    )
    assert call == TranscriptionCall(model="whisper-tiny", audio=b"RIFF....WAVE", response_format="text")
    assert parse(("file", WAV), ("temperature", "0")).response_format == "json"


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ((), "file", "file: required (the audio, uploaded as multipart/form-data)"),
        ((("file", "hello"),), "file", "file: must be an uploaded file (multipart/form-data), not a text field"),
        ((("file", UploadedFile("a.wav", b"")),), "file", "file: the uploaded file is empty"),
        ((("file", WAV), ("file", WAV)), "file", "file: given more than once"),
        ((("file", WAV), ("model", "")), "model", "model: must be a non-empty string"),
        ((("file", WAV), ("model", WAV)), "model", "model: must be a form field, not a file"),
        (
            (("file", WAV), ("response_format", "srt")),
            "response_format",
            "response_format: 'srt' is not supported; use 'json' or 'text'",
        ),
        (
            (("file", WAV), ("response_format", "verbose_json")),
            "response_format",
            "response_format: 'verbose_json' is not supported; use 'json' or 'text'",
        ),
        (
            (("file", WAV), ("response_format", "vtt")),
            "response_format",
            "response_format: 'vtt' is not supported; use 'json' or 'text'",
        ),
        (
            (("file", WAV), ("temperature", "0.5")),
            "temperature",
            "temperature: only 0 is supported (decoding is greedy)",
        ),
        ((("file", WAV), ("temperature", "warm")), "temperature", "temperature: must be a number"),
        (
            (("file", WAV), ("language", "en")),
            "language",
            "language: not supported (the language is detected from the audio (the checkpoint's default prompt))",
        ),
        (
            (("file", WAV), ("prompt", "Hello")),
            "prompt",
            "prompt: not supported (decoding starts from the checkpoint's default prompt)",
        ),
        (
            (("file", WAV), ("timestamp_granularities[]", "word")),
            "timestamp_granularities",
            "timestamp_granularities: not supported (no timestamps are produced)",
        ),
        (
            (("file", WAV), ("stream", "true")),
            "stream",
            "stream: streamed transcriptions are not supported; leave it out or false",
        ),
        (
            (("file", WAV), ("include[]", "logprobs")),
            "include[]",
            "include[]: unknown field; accepted: file, model, response_format, temperature",
        ),
        (
            (("chunking_strategy", "auto"), ("file", WAV)),
            "chunking_strategy",
            "chunking_strategy: unknown field; accepted: file, model, response_format, temperature",
        ),
    ],
)
def test_each_refusal_is_a_400_naming_its_field(fields, param, message):
    assert refusal(*fields) == (param, message)


# ---- the route, over real sockets to a fake scheduler


def form(**fields) -> aiohttp.FormData:
    data = aiohttp.FormData()
    data.add_field("file", b"RIFF-the-uploaded-bytes", filename="clip.wav", content_type="audio/wav")
    for name, value in fields.items():
        data.add_field(name, value)
    return data


async def transcription_at_scheduler(fake: FakeMesh) -> TranscriptionRequest:
    identity, msg = await asyncio.wait_for(fake.scheduler.recv(), 10)  # a 400 instead: fail, do not hang
    assert identity == b"gw0" and isinstance(msg, TranscriptionRequest)
    return msg


def result(request: TranscriptionRequest, text: str) -> TranscriptionResult:
    return TranscriptionResult(
        request_id=request.request_id, text=text, audio_seconds=2.25, tokens=5, queued_s=0.0, compute_s=0.5
    )


async def counted(fake: FakeMesh) -> dict[str, float]:
    """The gateway's transcription counters, from /metrics."""
    text = await (await fake.client.get("/metrics")).text()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    names = ("pagemesh_transcription_requests_total", "pagemesh_transcribed_audio_seconds_total")
    return {key: float(value) for key, value in samples if key.startswith(names)}


def test_an_upload_goes_to_the_scheduler_and_its_text_comes_back_in_both_shapes(tmp_path):
    async def test(fake: FakeMesh):
        response = asyncio.ensure_future(fake.client.post("/v1/audio/transcriptions", data=form(model="whisper-tiny")))
        request = await transcription_at_scheduler(fake)
        assert (request.model, request.audio, request.max_tokens) == ("whisper-tiny", b"RIFF-the-uploaded-bytes", None)
        await fake.reply(request, result(request, "w5 w9 w11"))
        response = await response
        assert response.status == 200 and response.content_type == "application/json"
        assert await response.json() == {"text": "w5 w9 w11", "usage": {"type": "duration", "seconds": 3}}

        response = asyncio.ensure_future(
            fake.client.post("/v1/audio/transcriptions", data=form(response_format="text"))
        )
        request = await transcription_at_scheduler(fake)
        assert request.model is None
        await fake.reply(request, result(request, "w5 w9"))
        response = await response
        assert response.status == 200 and response.content_type == "text/plain"
        assert await response.text() == "w5 w9"
        assert await counted(fake) == {
            'pagemesh_transcription_requests_total{status="200"}': 2.0,
            "pagemesh_transcribed_audio_seconds_total": 4.5,
        }

    run(tmp_path, test, max_body_bytes=4096)


def test_the_schedulers_refusal_is_the_error_and_a_timeout_aborts_the_request(tmp_path):
    async def test(fake: FakeMesh):
        response = asyncio.ensure_future(fake.client.post("/v1/audio/transcriptions", data=form(model="nope")))
        request = await transcription_at_scheduler(fake)
        message = "The model `nope` does not exist; audio models served: whisper-tiny."
        failed = RequestFailed(
            request_id=request.request_id,
            status=404,
            error_type="invalid_request_error",
            message=message,
            param="model",
            code="model_not_found",
        )
        await fake.scheduler.send(b"gw0", failed)  # the scheduler answers on the gateway's Dealer
        response = await response
        assert response.status == 404
        assert await response.json() == {
            "error": {"message": message, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        }
        # no answer within the request timeout: a 504, and the request is aborted in the mesh
        response = asyncio.ensure_future(fake.client.post("/v1/audio/transcriptions", data=form()))
        request = await transcription_at_scheduler(fake)
        assert (await response).status == 504
        identity, abort = await fake.scheduler.recv()
        assert abort == AbortRequest(request_id=request.request_id, reason="client disconnected or timed out")

    run(tmp_path, test, request_timeout=1.0)


def unnamed_parts(*parts: tuple[str, bytes]) -> aiohttp.MultipartWriter:
    """A form of non-text parts with no filename (as curl's `-F name=<file` sends them)."""
    with aiohttp.MultipartWriter("form-data") as writer:
        for name, value in parts:
            part = writer.append(value, {"Content-Type": "application/octet-stream"})
            part.set_content_disposition("form-data", name=name)
    return writer


def test_parts_without_a_filename_are_the_file_as_bytes_and_fields_as_utf8_text(tmp_path):
    async def test(fake: FakeMesh):
        form_ = unnamed_parts(("file", b"RIFF-bytes"), ("model", b"whisper-tiny"))
        response = asyncio.ensure_future(fake.client.post("/v1/audio/transcriptions", data=form_))
        request = await transcription_at_scheduler(fake)
        assert (request.audio, request.model) == (b"RIFF-bytes", "whisper-tiny")
        await fake.reply(request, result(request, "w1"))
        assert (await response).status == 200
        form_ = unnamed_parts(("file", b"RIFF-bytes"), ("model", b"\xff\xfe"))
        response = await fake.client.post("/v1/audio/transcriptions", data=form_)
        assert response.status == 400
        assert (await response.json())["error"] == {
            "message": "model: must be UTF-8 text",
            "type": "invalid_request_error",
            "param": "model",
            "code": None,
        }

    run(tmp_path, test)


def test_a_body_over_the_limit_is_a_413_and_a_json_body_a_400_naming_the_file(tmp_path):
    async def test(fake: FakeMesh):
        big = aiohttp.FormData()
        big.add_field("file", b"\0" * 5000, filename="clip.wav", content_type="audio/wav")
        response = await fake.client.post("/v1/audio/transcriptions", data=big)
        assert response.status == 413
        assert (await response.json())["error"]["code"] == "request_too_large"
        response = await fake.client.post("/v1/audio/transcriptions", json={"file": "clip.wav"})
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["param"] == "file" and error["message"].startswith("file: required, in a multipart/form-data")
        response = await fake.client.post("/v1/audio/transcriptions", data=form(language="en"))
        assert response.status == 400 and (await response.json())["error"]["param"] == "language"
        assert await counted(fake) == {
            'pagemesh_transcription_requests_total{status="413"}': 1.0,
            'pagemesh_transcription_requests_total{status="400"}': 2.0,
            "pagemesh_transcribed_audio_seconds_total": 0.0,
        }

    run(tmp_path, test, max_body_bytes=4096)
