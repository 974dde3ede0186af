"""What every message module shares: the registry, the enums of the wire, the size bounds.

    @message   a frozen, slotted, keyword-only dataclass that travels on its own: registered
               under its class name, which is its tag on the wire (frame 0)
    @record    the same kind of dataclass, but only ever inside a message (no tag)

A channel's module (requests, worker_control, kv_transfer, liveness, ...) declares its classes
with these decorators; `pagemesh.common.messages` imports every channel module, so importing it fills
the registry. The codec (`pagemesh.common.protocol`) builds its encoders and decoders from the registry.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import typing

MAX_ID = (1 << 31) - 1  # list[int] fields hold ids and sizes: 0 <= x <= MAX_ID

_T = typing.TypeVar("_T", bound=type)
REGISTRY: dict[bytes, type] = {}  # tag -> message class, in declaration order


class ProtocolError(ValueError):
    """A frame list that is not a valid message of this protocol version."""


def record(cls: _T) -> _T:
    """A frozen, keyword-only dataclass carried inside messages."""
    return dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)


def message(cls: _T) -> _T:
    """A frozen, keyword-only dataclass registered as a message under its class name."""
    cls = record(cls)
    tag = cls.__name__.encode("ascii")
    if tag in REGISTRY:
        raise TypeError(f"message {cls.__name__} registered twice")
    REGISTRY[tag] = cls
    return cls


class WorkerKind(enum.StrEnum):
    """What a worker serves."""

    LLM = "llm"
    DIFFUSION = "diffusion"
    ENCODER = "encoder"  # a multimodal model's vision tower, as a pool of its own (messages/encoder.py)
    AUDIO = "audio"  # speech to text (messages/audio.py)


class WorkerRole(enum.StrEnum):
    """An LLM worker's part in a request: the prompt, the decode after it, or both. A worker of
    another kind (diffusion, encoder, audio) does the whole request: `mixed`."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


class FinishReason(enum.StrEnum):
    """Why a choice ended, as OpenAI names it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Pooling(enum.StrEnum):
    """How an embedding request's prompt becomes one vector: the final-norm hidden state of its
    last token (vLLM's default for a causal LM), or the mean over all its tokens; L2-normalised."""

    LAST = "last"
    MEAN = "mean"


class DoneReason(enum.StrEnum):
    """Why a request left a worker (RequestDone)."""

    FINISHED = "finished"  # generated to its end (or, on a prefill worker, ended at its first token)
    HANDED_OFF = "handed_off"  # prefill worker: the decode worker took its pages
    REJECTED = "rejected"  # the worker refused it (RequestDone.detail says why)
    KV_REJECTED = "kv_rejected"  # the decode worker refused the KV pages
    KV_TIMEOUT = "kv_timeout"  # the handoff did not complete in time
    INVALID = "invalid"  # the worker found the request invalid and told the client itself (a 400)

    @property
    def failed(self) -> bool:
        """The request ends with an error for its client."""
        return self in (DoneReason.REJECTED, DoneReason.KV_REJECTED, DoneReason.KV_TIMEOUT)


def check_json_text(text: str | None, kind: type, where: str) -> None:
    """A message field that carries JSON text (tools, template kwargs): None, or JSON of a `kind`
    (list: of objects)."""
    if text is None:
        return
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise ProtocolError(f"{where}: not JSON") from None
    if not isinstance(value, kind) or (kind is list and not all(isinstance(x, dict) for x in value)):
        raise ProtocolError(f"{where}: expected JSON of {'objects' if kind is list else 'an object'}")
