"""One or more instances of every message class, for the codec's round-trip and mutation tests."""

from __future__ import annotations

from common import protocol as p
from common.protocol import (
    AbortRequest,
    ClusterStatus,
    DecodeTask,
    GenerateRequest,
    GenerateTask,
    Heartbeat,
    HeldRequest,
    ImageModelInfo,
    ImageParams,
    ImageRequest,
    ImageResult,
    ImageTask,
    KVPagesAck,
    KVPagesHeader,
    KVPoolInfo,
    KVPoolLoad,
    Ping,
    Pong,
    PrefillTask,
    PrefixCacheUpdate,
    Ready,
    Registered,
    RegisterWorker,
    RequestDone,
    RequestFailed,
    RequestStarted,
    ScheduleRequest,
    StatusRequest,
    TextDelta,
    TextDeltaBatch,
    TokenDelta,
    TokenDeltaBatch,
    TokenLogprob,
    UnknownWorker,
    WorkerStatus,
    WorkerStopped,
)
from common.sampling import SamplingParams

SP = SamplingParams(
    n=2,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    seed=7,
    max_tokens=32,
    stop_token_ids=(2, 3),
    stop=("\n\n",),
    logprobs=2,
    logit_bias=((3, -100.0), (17, 2.5)),
)
LP = TokenLogprob(token_id=11, logprob=-0.25, top_ids=[11, 12], top_logprobs=[-0.25, -1.5])
TEXT_DELTA = TextDelta(
    request_id="r1",
    index=1,
    text="héllo ✓",
    token_ids=[11, 12],
    logprobs=[LP, LP],
    finish_reason="stop",
    prompt_tokens=5,
    completion_tokens=2,
)
TOKEN_DELTA = TokenDelta(
    request_id="r1", index=0, token_ids=[11], logprobs=[LP], finish_reason=None, num_prompt_tokens=5
)
HEADER = KVPagesHeader(
    request_id="r1",
    seq_index=0,
    num_tokens=40,
    layer_start=0,
    layer_end=2,
    num_pages=3,
    dtype="bfloat16",
    page_shape=[2, 16, 2, 8],
    checksum=0,
    first_token_ids=[11],
    last=False,
    page_indices=[0, 1, 2],
)

IMAGES = ImageModelInfo(
    sizes=["256x256", "8x8"],
    samplers=["ddim", "ddpm"],
    default_sampler="ddim",
    default_steps=50,
    max_steps=1000,
    conditioning="a digit 0-9",
)
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

SAMPLES = [
    GenerateRequest(
        request_id="r1",
        model="smollm",
        prompt_text="Hi",
        prompt_token_ids=None,
        messages=None,
        sampling=SP,
        stream=True,
        reply_to="ipc:///tmp/gw",
        arrival_time=1712.5,
        include_stop_str_in_output=False,
    ),
    GenerateRequest(
        request_id="r2",
        model="smollm",
        prompt_text=None,
        prompt_token_ids=[1, 2, 3],
        messages=None,
        sampling=SamplingParams(),
        stream=False,
        reply_to="gw-0",
        arrival_time=0.0,
        include_stop_str_in_output=True,
    ),
    GenerateRequest(
        request_id="r3",
        model="smollm",
        prompt_text=None,
        prompt_token_ids=None,
        messages=[{"role": "user", "content": "Hi"}],
        sampling=SP,
        stream=True,
        reply_to="gw",
        arrival_time=1.0,
        include_stop_str_in_output=False,
    ),
    TextDeltaBatch(deltas=[TEXT_DELTA]),
    TextDeltaBatch(
        deltas=[
            TextDelta(
                request_id="r1",
                index=0,
                text="Hi",
                token_ids=[11],
                logprobs=None,
                finish_reason=None,
                prompt_tokens=3,
                completion_tokens=1,
                queue_time_s=0.25,
                prompt_token_ids=[1, 2, 3],
                prompt_logprobs=[LP, LP],
            )
        ]
    ),
    TextDeltaBatch(
        deltas=[
            TextDelta(
                request_id="r1",
                index=0,
                text="",
                token_ids=[],
                logprobs=None,
                finish_reason=None,
                prompt_tokens=5,
                completion_tokens=0,
            )
        ]
    ),
    TextDeltaBatch(deltas=[TEXT_DELTA, TEXT_DELTA]),
    TextDeltaBatch(deltas=[]),
    RequestFailed(
        request_id="r1",
        status=400,
        error_type="invalid_request_error",
        message="prompt too long",
        param="prompt",
        code=None,
    ),
    RequestFailed(
        request_id="r1", status=503, error_type="server_error", message="no workers", param=None, code="overloaded"
    ),
    AbortRequest(request_id="r1", reason="client disconnected"),
    AbortRequest(request_id="r1", reason="unknown to the tokenizer", worker_id="d0"),
    ScheduleRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SP, reply_to="tok-0", arrival_time=12.25),
    PrefillTask(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=SP,
        reply_to="tok-0",
        decode_worker_id="d0",
        decode_kv_endpoint="tcp://10.0.0.2:7001",
    ),
    PrefillTask(
        request_id="r1",
        prompt_token_ids=list(range(40)),
        sampling=SP,
        reply_to="tok-0",
        decode_worker_id="d0",
        decode_kv_endpoint="tcp://10.0.0.2:7001",
        queued_s=0.5,
        skip_pages=2,
    ),
    DecodeTask(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SP, reply_to="tok-0", prefill_worker_id="p0"),
    DecodeTask(
        request_id="r1",
        prompt_token_ids=list(range(40)),
        sampling=SP,
        reply_to="tok-0",
        prefill_worker_id="p0",
        skip_pages=2,
    ),
    GenerateTask(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SP, reply_to="tok-0"),
    RegisterWorker(
        worker_id="p0",
        kind="llm",
        role="prefill",
        model="smollm",
        max_running=64,
        kv=KVPoolInfo(page_size=16, num_pages=1000, kv_endpoint="tcp://10.0.0.1:7000"),
        instance="9f2c",
    ),
    RegisterWorker(
        worker_id="x0", kind="diffusion", role="mixed", model="digits-dit", max_running=16, kv=None, images=IMAGES
    ),
    RegisterWorker(
        worker_id="p0",
        kind="llm",
        role="prefill",
        model="smollm",
        max_running=64,
        kv=KVPoolInfo(page_size=16, num_pages=1000, kv_endpoint=""),
        instance="9f2c",
        held=[HeldRequest(request_id="r1", reply_to="ipc:///tok-out")],
    ),
    Registered(worker_id="p0"),
    UnknownWorker(worker_id="p0"),
    Heartbeat(
        worker_id="p0",
        running=3,
        waiting=1,
        time=99.5,
        requests_finished=0,
        kv=KVPoolLoad(free_pages=900, used_pages=100, total_pages=1000, bytes_sent=4096, bytes_received=0),
    ),
    Heartbeat(worker_id="x0", running=1, waiting=0, time=1.5, requests_finished=2, kv=None, busy_s=7.25),
    WorkerStopped(worker_id="p0", instance="9f2c", error="RuntimeError: the forward pass failed"),
    WorkerStopped(worker_id="d0", instance="77aa"),
    PrefixCacheUpdate(worker_id="p0", added=(0, 1 << 40, p.MAX_PAGE_HASH), removed=(7,)),
    PrefixCacheUpdate(worker_id="d0", added=(), removed=()),
    RequestDone(worker_id="p0", request_id="r1", reason="finished"),
    RequestDone(worker_id="p0", request_id="r1", reason="rejected", detail="prompt: too long"),
    TokenDeltaBatch(worker_id="d0", deltas=[], started=[RequestStarted(request_id="r1", num_prompt_tokens=5)]),
    TokenDeltaBatch(
        worker_id="d0",
        deltas=[
            TokenDelta(
                request_id="r1",
                index=0,
                token_ids=[11],
                logprobs=None,
                finish_reason=None,
                num_prompt_tokens=3,
                queue_time_s=0.5,
                prompt_logprobs=[LP, LP],
            )
        ],
        started=[RequestStarted(request_id="r1", num_prompt_tokens=3)],
    ),
    TokenDeltaBatch(
        worker_id="d0",
        deltas=[
            TOKEN_DELTA,
            TokenDelta(
                request_id="r2", index=1, token_ids=[5, 6], logprobs=None, finish_reason="length", num_prompt_tokens=3
            ),
        ],
    ),
    HEADER,
    KVPagesAck(request_id="r1", ok=True, error=None),
    KVPagesAck(request_id="r1", ok=False, error="out of pages"),
    Ready(service="worker", name="p0"),
    Ping(sender="tok-0"),
    Ping(sender="tok-0", address="ipc:///tok-out"),
    Pong(service="scheduler", instance="5d41402abc4b2a76"),
    StatusRequest(requester="gw-1"),
    ClusterStatus(
        ready=False,
        workers=[
            WorkerStatus(
                worker_id="p0",
                kind="llm",
                role="prefill",
                alive=False,
                running=0,
                waiting=0,
                requests_finished=0,
                kv=KVPoolLoad(free_pages=0, used_pages=0, total_pages=100, bytes_sent=8192, bytes_received=0),
            )
        ],
        queued=0,
    ),
    ClusterStatus(
        ready=True,
        workers=[
            WorkerStatus(
                worker_id="d0",
                kind="llm",
                role="decode",
                alive=True,
                running=2,
                waiting=0,
                requests_finished=0,
                kv=KVPoolLoad(free_pages=0, used_pages=10, total_pages=100, bytes_sent=0, bytes_received=8192),
            )
        ],
        queued=3,
    ),
    *IMAGE_SAMPLES,
]
