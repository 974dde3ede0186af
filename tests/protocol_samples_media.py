"""The media channels' samples for the codec's tests (tests/protocol_samples.py imports them):
images drawn, images read (multimodal prompts, an encoder pool's rows), audio transcribed."""

from __future__ import annotations

from pagemesh.common.protocol import (
    EncodeTask,
    GenerateTask,
    ImageEmbedsHeader,
    ImageInput,
    ImageParams,
    ImageRequest,
    ImageResult,
    ImageTask,
    ScheduleRequest,
    TranscriptionRequest,
    TranscriptionResult,
    TranscriptionTask,
)
from pagemesh.common.sampling import SamplingParams

IMAGE_PARAMS = ImageParams(
    prompt="a handwritten 3",
    negative_prompt=None,
    n=2,
    width=256,
    height=256,
    num_inference_steps=20,
    guidance_scale=2.0,
    sampler="ddim",
    seed=7,
)

IMAGE_SAMPLES = [
    ImageRequest(request_id="i1", model=None, params=IMAGE_PARAMS, reply_to="ipc:///gw", arrival_time=3.5),
    ImageRequest(
        request_id="i2",
        model="digits-dit",
        params=ImageParams(
            prompt="7",
            negative_prompt="1",
            n=1,
            width=None,
            height=None,
            num_inference_steps=None,
            guidance_scale=None,
            sampler=None,
            seed=None,
        ),
        reply_to="ipc:///gw",
        arrival_time=3.5,
    ),
    ImageTask(request_id="i1", params=IMAGE_PARAMS, reply_to="ipc:///gw", queued_s=0.25),
    ImageResult(
        request_id="i1",
        images=["iVBORw0KGgo=", "iVBORw0KGgo="],
        width=256,
        height=256,
        native_width=8,
        native_height=8,
        steps=20,
        sampler="ddim",
        seed=7,
        queued_s=0.1,
        compute_s=0.5,
        batched_with=3,
        cache="fbcache:0.08",
        cache_over_budget=False,
        blocks_computed=600,
        blocks_skipped=200,
    ),
]

AUDIO_SAMPLES = [
    TranscriptionRequest(
        request_id="t1", model=None, audio=b"RIFF\x00\x01WAVE", max_tokens=None, reply_to="ipc:///gw", arrival_time=3.5
    ),
    TranscriptionRequest(
        request_id="t2", model="whisper-tiny", audio=b"RIFF", max_tokens=64, reply_to="ipc:///gw", arrival_time=3.5
    ),
    TranscriptionTask(request_id="t1", audio=b"RIFF\x00\x01WAVE", max_tokens=None, reply_to="ipc:///gw", queued_s=0.25),
    TranscriptionResult(
        request_id="t1", text="héllo wörld ✓", audio_seconds=2.5, tokens=7, queued_s=0.25, compute_s=0.5
    ),
]


IMAGE_INPUT = ImageInput(digest="ab" * 32, offset=1, length=3, data=b"\x89PNG\r\n\x1a\n", grid=[1, 4, 6])
MULTIMODAL_SAMPLES = [
    ScheduleRequest(
        request_id="m1",
        prompt_token_ids=[5, 9, 9, 9, 6],
        sampling=SamplingParams(),
        reply_to="tok-0",
        arrival_time=1.5,
        images=[IMAGE_INPUT],
    ),
    GenerateTask(
        request_id="m1",
        prompt_token_ids=[5, 9, 9, 9, 6],
        sampling=SamplingParams(),
        reply_to="tok-0",
        images=[IMAGE_INPUT],
        encoder_id="encoder-0",
    ),
    EncodeTask(request_id="m1", images=[IMAGE_INPUT], target_worker_id="mixed-0", target_endpoint="ipc:///embeds"),
    ImageEmbedsHeader(request_id="m1", digest="ab" * 32, dtype="bfloat16", shape=[3, 64], checksum=12345),
]
