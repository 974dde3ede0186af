"""Every message that crosses a process boundary: small frozen keyword-only dataclasses, one
module per channel, one registry (tag -> class) that the codec (`pagemesh.common.protocol`) reads.

    base.py            the @message / @record decorators, the registry, the wire's enums
    requests.py        gateway ⇄ tokenizer ⇄ scheduler, and worker -> tokenizer tokens
    worker_control.py  scheduler ⇄ workers: registration, heartbeats, tasks, endings
    kv_transfer.py     prefill worker -> decode worker: KV pages and their acknowledgement
    liveness.py        READY, Ping/Pong, the mesh's status
    images.py          gateway ⇄ scheduler ⇄ diffusion workers: image requests and results
    tokenize.py        gateway ⇄ tokenizer calls answered at once: tokenize, detokenize
    lora.py            gateway ⇄ scheduler ⇄ LLM workers: LoRA adapters loaded and unloaded at run time
    encoder.py         scheduler ──▶ encoder workers ──image rows──▶ LLM workers (--encoder N)
    audio.py           gateway ⇄ scheduler ⇄ audio workers: transcriptions (--audio N)
A new channel is a new module imported here.
"""

from __future__ import annotations

import typing

from pagemesh.common.messages.audio import TranscriptionRequest, TranscriptionResult, TranscriptionTask
from pagemesh.common.messages.base import (
    MAX_ID,
    REGISTRY,
    DoneReason,
    FinishReason,
    Pooling,
    ProtocolError,
    WorkerKind,
    WorkerRole,
    message,
    record,
)
from pagemesh.common.messages.encoder import EncodeTask, ImageEmbedsHeader
from pagemesh.common.messages.images import (
    MAX_IMAGES,
    FeatureCacheLoad,
    ImageModelInfo,
    ImageParams,
    ImageRequest,
    ImageResult,
    ImageTask,
)
from pagemesh.common.messages.kv_transfer import KV_DTYPES, KVPagesAck, KVPagesHeader
from pagemesh.common.messages.liveness import ClusterStatus, Ping, Pong, Ready, StatusRequest, WorkerStatus
from pagemesh.common.messages.lora import (
    LoRAAdapter,
    LoRAAdapterDone,
    LoRAAdapterReply,
    LoRAAdapterRequest,
    LoRAAdapterTask,
    LoRALoad,
    LoRAOp,
)
from pagemesh.common.messages.requests import (
    AbortRequest,
    Embedding,
    EmbeddingBatch,
    EmbedRequest,
    GenerateRequest,
    ImageInput,
    MigrateRequest,
    RequestFailed,
    RequestStarted,
    ResumedChoice,
    ResumedText,
    ResumeState,
    ScheduleRequest,
    TextDelta,
    TextDeltaBatch,
    TokenDelta,
    TokenDeltaBatch,
    TokenLogprob,
)
from pagemesh.common.messages.tokenize import DetokenizeRequest, DetokenizeResult, TokenizeRequest, TokenizeResult
from pagemesh.common.messages.worker_control import (
    MAX_KV_EVENT_BYTES,
    DecodeTask,
    GenerateTask,
    Heartbeat,
    HeldRequest,
    KVEventBatch,
    KVEventsResync,
    KVPoolInfo,
    KVPoolLoad,
    PrefillTask,
    Registered,
    RegisterWorker,
    RequestDone,
    SpeculationLoad,
    UnknownWorker,
    WorkerStopped,
)

MESSAGE_TYPES: dict[bytes, type] = dict(REGISTRY)  # tag -> class
MESSAGE_CLASSES: tuple[type, ...] = tuple(MESSAGE_TYPES.values())
TAGS: dict[type, bytes] = {cls: tag for tag, cls in MESSAGE_TYPES.items()}
Message = typing.Union[MESSAGE_CLASSES]  # noqa: UP007 - built from the registry

__all__ = [
    "MAX_ID",
    "MAX_KV_EVENT_BYTES",
    "KV_DTYPES",
    "MESSAGE_CLASSES",
    "MESSAGE_TYPES",
    "TAGS",
    "Message",
    "ProtocolError",
    "message",
    "record",
    "DoneReason",
    "FinishReason",
    "Pooling",
    "WorkerKind",
    "WorkerRole",
    "AbortRequest",
    "EmbedRequest",
    "Embedding",
    "EmbeddingBatch",
    "GenerateRequest",
    "ImageInput",
    "EncodeTask",
    "ImageEmbedsHeader",
    "MigrateRequest",
    "RequestFailed",
    "RequestStarted",
    "ResumedChoice",
    "ResumedText",
    "ResumeState",
    "ScheduleRequest",
    "TextDelta",
    "TextDeltaBatch",
    "TokenDelta",
    "TokenDeltaBatch",
    "TokenLogprob",
    "DetokenizeRequest",
    "DetokenizeResult",
    "TokenizeRequest",
    "TokenizeResult",
    "DecodeTask",
    "GenerateTask",
    "HeldRequest",
    "Heartbeat",
    "KVPoolInfo",
    "KVPoolLoad",
    "PrefillTask",
    "KVEventBatch",
    "KVEventsResync",
    "Registered",
    "RegisterWorker",
    "RequestDone",
    "SpeculationLoad",
    "UnknownWorker",
    "WorkerStopped",
    "KVPagesAck",
    "KVPagesHeader",
    "ClusterStatus",
    "Ping",
    "Pong",
    "Ready",
    "StatusRequest",
    "WorkerStatus",
    "LoRAAdapter",
    "LoRAAdapterDone",
    "LoRAAdapterReply",
    "LoRAAdapterRequest",
    "LoRAAdapterTask",
    "LoRALoad",
    "LoRAOp",
    "MAX_IMAGES",
    "FeatureCacheLoad",
    "ImageModelInfo",
    "ImageParams",
    "ImageRequest",
    "ImageResult",
    "ImageTask",
    "TranscriptionRequest",
    "TranscriptionResult",
    "TranscriptionTask",
]
