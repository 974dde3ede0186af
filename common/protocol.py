"""Every message that crosses a process boundary, and its wire codec.

A message is a small frozen dataclass registered under a type tag. On the wire it is a list
of ZeroMQ frames:

    frame 0   tag            the class name, ASCII (receivers route before decoding the body)
    frame 1   body           msgpack: [PROTOCOL_VERSION, {field name: value, ...}]
    frame 2.. tensor frames  only for messages with `TENSOR_FRAMES` (KV pages), raw bytes

`decode()` is the trust boundary: it checks the tag, the version, that every declared field is
present (and nothing else), each value's type against the field's annotation, and size bounds.
Anything malformed raises `ProtocolError` and nothing else. Receivers route by `type(msg)`;
`MESSAGE_TYPES` maps tag -> class. No pickle, no eval: msgpack of plain values only.

torch is imported lazily, inside the tensor-frame helpers only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
import warnings
import zlib
from collections.abc import Callable, Sequence

import msgpack

from pagemesh.common.messages import *  # noqa: F401,F403 - re-exported: the protocol's vocabulary
from pagemesh.common.messages import (  # noqa: F401
    MAX_ID,
    MESSAGE_CLASSES,
    MESSAGE_TYPES,
    TAGS,
    ImageEmbedsHeader,
    KVPagesHeader,
    Message,
    ProtocolError,
)
from pagemesh.common.sampling import SamplingParams

# 2: RegisterWorker.instance, UnknownWorker; 3: Ping, Pong, AbortRequest.worker_id, prompt logprobs,
# RegisterWorker.held; 4: messages by channel, enums, worker kinds, KVPoolInfo/KVPoolLoad, RequestStarted;
# 5: the image channel (ImageRequest, ImageTask, ImageResult), RegisterWorker.images;
# 6: Heartbeat.produced/.feature_cache/.busy_s, WorkerStopped, MigrateRequest, ResumeState,
# ScheduleRequest.resume, GenerateTask.output_token_ids, TokenDelta.num_cached_tokens,
# TextDelta.cached_tokens, RegisterWorker.ranks, WorkerStatus.produced/.feature_cache/.ranks,
# ClusterStatus.migrations; 7: KVPagesHeader.tp_rank/.tp_size/.kv_scales, SamplingParams.speculative,
# SpeculationLoad, Heartbeat.speculation, WorkerStatus.speculation; 8: RegisterWorker.pipeline_stages;
# 9: the tokenize channel (TokenizeRequest/Result, DetokenizeRequest/Result), EmbedRequest,
# EmbeddingBatch, ScheduleRequest.pooling, GenerateTask.pooling, GenerateRequest.tools/
# .chat_template_kwargs/.skip_special_tokens, SamplingParams.structured; 10: SamplingParams.lora;
# 11: bytes fields, ImageInput, GenerateRequest.images, ScheduleRequest/GenerateTask/PrefillTask/DecodeTask.images,
# TranscriptionRequest/Task/Result; 12: ResumedChoice, ResumeState.choices, GenerateTask.resumed_choices;
# 13: SpeculationLoad.accepted_per_pos; 14: KVEventBatch and KVEventsResync in place of PrefixCacheUpdate;
# 15: ClusterStatus.kv_event_*; 16: PrefillTask.resumed/.kept_id, DecodeTask.output_token_ids/.resumed_choices,
# AbortRequest.moved_to (an exact resume)
PROTOCOL_VERSION = 16

MAX_STR_LEN = 4 << 20  # characters; a prompt of ~1M tokens of text fits
MAX_TOKEN_IDS = 1 << 20  # length of any list[int] (token ids, page indices, shapes)
MAX_LIST_LEN = 1 << 16  # length of any other list (deltas per batch, chat messages, ...)
MAX_DICT_LEN = 64  # entries in a dict field (a chat message: role, content, name)
MAX_TAG_LEN = 64
MAX_BYTES_LEN = 32 << 20  # a bytes field (an image file as the client sent it)

# --------------------------------------------------------------------------- codec

# msgpack's own bounds: a coarse first guard, so a tiny body cannot claim a huge container.
# The validators below apply the exact per-field limits.
_UNPACK_OPTIONS = dict(
    raw=False,
    strict_map_key=True,
    use_list=True,
    max_bin_len=MAX_BYTES_LEN,
    max_ext_len=0,
    max_str_len=4 * MAX_STR_LEN,  # UTF-8 bytes
    max_array_len=max(MAX_TOKEN_IDS, MAX_LIST_LEN),
    max_map_len=max(MAX_DICT_LEN, 32),  # 32 >= the fields of any message or SamplingParams
)


def encode(msg: Message) -> list[bytes]:
    """[tag, msgpack body]. Messages with tensor frames go through `encode_tensor_frames`."""
    cls = type(msg)
    try:
        tag = TAGS[cls]
    except KeyError:
        raise TypeError(f"not a registered message: {cls.__name__}") from None
    body = msgpack.packb([PROTOCOL_VERSION, _ENCODERS[cls](msg)], use_bin_type=True)
    return [tag, body]


def decode(frames: Sequence[object]) -> Message:
    """Validate and build a message from frames (bytes, memoryview or any buffer).

    Tensor frames after the body are counted here but decoded by `decode_tensor_frames`.
    Raises ProtocolError on anything malformed.
    """
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
    tag = _frame_bytes(frames[0], MAX_TAG_LEN, "tag")
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise ProtocolError(f"unknown message tag {tag!r}")
    try:
        body = msgpack.unpackb(frames[1], **_UNPACK_OPTIONS)
    except Exception as e:  # msgpack raises many types (ValueError, TypeError, StackError, ...)
        raise ProtocolError(f"{cls.__name__}: undecodable body ({type(e).__name__}: {e})") from None
    if type(body) is not list or len(body) != 2:
        raise ProtocolError(f"{cls.__name__}: body must be [version, fields]")
    if type(body[0]) is not int or body[0] != PROTOCOL_VERSION:
        raise ProtocolError(f"{cls.__name__}: protocol version {body[0]!r}, expected {PROTOCOL_VERSION}")
    try:
        msg = _DECODERS[cls](body[1])
    except _Invalid as e:
        raise ProtocolError(f"{cls.__name__}{''.join(reversed(e.path))}: {e.why}") from None
    extra = len(frames) - 2
    expected = msg.num_frames if getattr(cls, "TENSOR_FRAMES", False) else 0
    if extra != expected:
        raise ProtocolError(f"{cls.__name__}: expected {expected} tensor frames, got {extra}")
    return msg


def _frame_bytes(frame: object, limit: int, what: str) -> bytes:
    try:
        view = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"{what} frame is not a buffer") from None
    if view.nbytes > limit:
        raise ProtocolError(f"{what} frame too long ({view.nbytes} bytes)")
    return view.tobytes()


# --------------------------------------------------------------------------- field codecs
# Built once at import from each dataclass's annotations. An encoder turns a value into plain
# msgpack values (None = pass through as is); a decoder checks a plain value and rebuilds it.

_Codec = Callable[[object], object]


class _Invalid(ProtocolError):
    """Raised by field decoders; `decode` turns it into a ProtocolError naming the field path."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why, self.path = why, []


def _type_name(v: object) -> str:
    return type(v).__name__


def _dec_int(v):
    if type(v) is not int:
        raise _Invalid(f"expected int, got {_type_name(v)}")
    return v


def _dec_float(v):
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise _Invalid(f"expected float, got {_type_name(v)}")


def _dec_str(v):
    if type(v) is not str:
        raise _Invalid(f"expected str, got {_type_name(v)}")
    if len(v) > MAX_STR_LEN:
        raise _Invalid(f"string longer than {MAX_STR_LEN}")
    return v


def _dec_bytes(v):
    if type(v) is not bytes:
        raise _Invalid(f"expected bytes, got {_type_name(v)}")
    return v  # msgpack's max_bin_len bounds it


def _dec_bool(v):
    if type(v) is not bool:
        raise _Invalid(f"expected bool, got {_type_name(v)}")
    return v


def _dec_ids(v):
    """list[int]: ids and sizes, the only long lists; checked in bulk for speed."""
    if type(v) is not list:
        raise _Invalid(f"expected list, got {_type_name(v)}")
    if len(v) > MAX_TOKEN_IDS:
        raise _Invalid(f"more than {MAX_TOKEN_IDS} items")
    if v and not (all(type(x) is int for x in v) and 0 <= min(v) and max(v) <= MAX_ID):
        raise _Invalid(f"expected integers in [0, {MAX_ID}]")
    return v


def _dec_floats(v):
    """list[float]: vectors (an embedding, KV scales, logprobs), checked in bulk for speed; an
    int item is taken as a float, as a single float field takes it."""
    if type(v) is not list:
        raise _Invalid(f"expected list, got {_type_name(v)}")
    if len(v) > MAX_LIST_LEN:
        raise _Invalid(f"more than {MAX_LIST_LEN} items")
    if all(type(x) is float for x in v):
        return v
    return _FLOAT_ITEMS(v)


def _dec_sampling(v):
    if type(v) is not dict:
        raise _Invalid(f"expected map, got {_type_name(v)}")
    try:
        return SamplingParams.from_dict(v)
    except (ValueError, TypeError) as e:
        raise _Invalid(str(e)) from None


def _dec_list(item: _Codec, as_tuple: bool) -> _Codec:
    def dec(v):
        if type(v) is not list:
            raise _Invalid(f"expected list, got {_type_name(v)}")
        if len(v) > MAX_LIST_LEN:
            raise _Invalid(f"more than {MAX_LIST_LEN} items")
        out, i = [], 0
        try:
            for i, x in enumerate(v):  # noqa: B007 - `i` names the bad item in the except below
                out.append(item(x))
        except _Invalid as e:
            e.path.append(f"[{i}]")
            raise
        return tuple(out) if as_tuple else out

    return dec


_FLOAT_ITEMS = _dec_list(_dec_float, as_tuple=False)  # item by item: names the bad one


def _dec_dict(item: _Codec) -> _Codec:
    def dec(v):
        if type(v) is not dict:
            raise _Invalid(f"expected map, got {_type_name(v)}")
        if len(v) > MAX_DICT_LEN:
            raise _Invalid(f"more than {MAX_DICT_LEN} entries")
        out = {}
        for k, x in v.items():
            try:
                out[_dec_str(k)] = item(x)
            except _Invalid as e:
                e.path.append(f"[{k!r}]")
                raise
        return out

    return dec


def _dec_optional(inner: _Codec) -> _Codec:
    return lambda v: None if v is None else inner(v)


def _dec_dataclass(cls: type) -> _Codec:
    decoders = tuple((f.name, _decoder_for(t)) for f, t in _field_types(cls))
    names = {name for name, _ in decoders}
    check = getattr(cls, "_check", None)

    def dec(v):
        if type(v) is not dict:
            raise _Invalid(f"expected map, got {_type_name(v)}")
        if v.keys() != names:
            missing, extra = sorted(names - v.keys()), sorted(map(repr, v.keys() - names))
            raise _Invalid(f"missing fields {missing}, unexpected fields {extra}")
        kwargs = {}
        for name, d in decoders:
            try:
                kwargs[name] = d(v[name])
            except _Invalid as e:
                e.path.append(f".{name}")
                raise
        obj = cls(**kwargs)
        if check is not None:
            try:
                check(obj)
            except ProtocolError as e:
                raise _Invalid(str(e)) from None
        return obj

    return dec


_SCALAR_DECODERS: dict[object, _Codec] = {
    int: _dec_int,
    float: _dec_float,
    str: _dec_str,
    bool: _dec_bool,
    bytes: _dec_bytes,
    SamplingParams: _dec_sampling,
}


def _dec_enum(cls: type[enum.Enum]) -> _Codec:
    values = {m.value: m for m in cls}

    def dec(v):
        member = values.get(v) if type(v) is str else None
        if member is None:
            raise _Invalid(f"expected one of {sorted(values)}, got {v!r}")
        return member

    return dec


def _decoder_for(tp: object) -> _Codec:
    if tp in _SCALAR_DECODERS:
        return _SCALAR_DECODERS[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _dec_enum(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        return _dec_optional(_decoder_for(next(a for a in args if a is not type(None))))
    if origin is list and args == (int,):
        return _dec_ids
    if origin is list and args == (float,):
        return _dec_floats
    if origin is list and len(args) == 1:
        return _dec_list(_decoder_for(args[0]), as_tuple=False)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _dec_list(_decoder_for(args[0]), as_tuple=True)
    if origin is dict and len(args) == 2 and args[0] is str:
        return _dec_dict(_decoder_for(args[1]))
    if dataclasses.is_dataclass(tp):
        return _dec_dataclass(tp)
    raise TypeError(f"protocol: unsupported field type {tp!r}")


def _encoder_for(tp: object) -> _Codec | None:
    """None where msgpack takes the value as it is (scalars, lists of scalars, dicts of str)."""
    if tp is SamplingParams:
        return SamplingParams.to_dict
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda v: v.value if isinstance(v, enum.Enum) else v  # a plain str is checked on decode
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = _encoder_for(next(a for a in args if a is not type(None)))
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin in (list, tuple) and args:
        inner = _encoder_for(args[0])
        return None if inner is None else (lambda v: [inner(x) for x in v])
    if dataclasses.is_dataclass(tp):
        return _enc_dataclass(tp)
    return None


def _enc_dataclass(cls: type) -> _Codec:
    encoders = tuple((f.name, _encoder_for(t)) for f, t in _field_types(cls))

    def enc(obj):
        return {name: getattr(obj, name) if e is None else e(getattr(obj, name)) for name, e in encoders}

    return enc


def _field_types(cls: type) -> list[tuple[dataclasses.Field, object]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


_ENCODERS: dict[type, _Codec] = {cls: _enc_dataclass(cls) for cls in MESSAGE_CLASSES}
_DECODERS: dict[type, _Codec] = {cls: _dec_dataclass(cls) for cls in MESSAGE_CLASSES}


# --------------------------------------------------------------------------- tensor frames
# Checksum: zlib.crc32 measured at ~2.3 ms per 10 MB here (~4.4 GB/s; adler32 was slower at
# ~3.1 ms), well under the cost of moving the bytes; it catches truncation and reordering.


def encode_tensor_frames(header: KVPagesHeader, tensors: Sequence[object]) -> list[bytes | memoryview]:
    """[tag, body, *one frame per layer]: the header with `checksum` filled in, then the bytes
    of each tensor. Contiguous CPU tensors are sent without a copy (a memoryview of their
    memory): the caller must not modify them until the send has completed. GPU or strided
    tensors are copied to contiguous CPU memory first.
    """
    import torch

    header._check()
    if len(tensors) != header.num_frames:
        raise ValueError(f"KVPagesHeader: {header.num_frames} layers declared, {len(tensors)} tensors given")
    shape = (header.num_pages, *header.page_shape)
    views, checksum = [], 0
    for i, t in enumerate(tensors):
        if tuple(t.shape) != shape or str(t.dtype) != f"torch.{header.dtype}":
            raise ValueError(f"tensor {i}: {t.dtype} {tuple(t.shape)}, header says {header.dtype} {shape}")
        t = t.detach().to("cpu").contiguous()
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # keeps `t` alive
        checksum = zlib.crc32(view, checksum)
        views.append(view)
    return [*encode(dataclasses.replace(header, checksum=checksum)), *views]


def decode_tensor_frames(header: KVPagesHeader, frames: Sequence[object]) -> list:
    """Tensors of shape [num_pages, *page_shape] built on the frames' memory without copying
    (the tensors keep the frames alive). Checks frame count, sizes and the checksum; raises
    ProtocolError on a mismatch. Treat the tensors as read-only; copy them into the pool.
    """
    import torch

    if len(frames) != header.num_frames:
        raise ProtocolError(f"KV {header.request_id}: {header.num_frames} tensor frames declared, got {len(frames)}")
    dtype = getattr(torch, header.dtype)
    shape = (header.num_pages, *header.page_shape)
    nbytes = math.prod(shape) * dtype.itemsize
    views, checksum = [], 0
    for i, frame in enumerate(frames):
        try:
            view = memoryview(frame).cast("B")
        except (TypeError, ValueError):
            raise ProtocolError(f"KV {header.request_id}: tensor frame {i} is not a byte buffer") from None
        if view.nbytes != nbytes:
            raise ProtocolError(
                f"KV {header.request_id}: tensor frame {i} has {view.nbytes} bytes, shape {shape} {header.dtype} "
                f"needs {nbytes}"
            )
        checksum = zlib.crc32(view, checksum)
        views.append(view)
    if checksum != header.checksum:
        raise ProtocolError(f"KV {header.request_id}: checksum mismatch ({checksum:#010x} != {header.checksum:#010x})")
    return [_tensor_from_view(torch, v, dtype, shape) for v in views]


def _tensor_from_view(torch, view: memoryview, dtype, shape: tuple[int, ...]):
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if view.readonly:  # e.g. bytes: fine, the caller only reads; torch would warn once
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            raw = torch.frombuffer(view, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(view, dtype=torch.uint8)
    if raw.data_ptr() % dtype.itemsize:  # misaligned buffer: one copy beats unaligned kernels
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def encode_image_embeds(request_id: str, digest: str, rows) -> list[bytes | memoryview]:
    """[tag, body, frame]: one image's rows (a torch tensor [placeholders, hidden]) after an
    ImageEmbedsHeader naming their dtype, shape and checksum (the frame is a view of a
    contiguous CPU copy: sent without another copy)."""
    import torch

    t = rows.detach().to("cpu").contiguous()
    view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    header = ImageEmbedsHeader(
        request_id=request_id,
        digest=digest,
        dtype=str(t.dtype).removeprefix("torch."),
        shape=list(t.shape),
        checksum=zlib.crc32(view),
    )
    return [*encode(header), view]


def decode_image_embeds(header: ImageEmbedsHeader, frames: Sequence[object]):
    """The rows of an ImageEmbedsHeader's frame (checked: size and checksum), on its memory."""
    import torch

    dtype = getattr(torch, header.dtype)
    view = memoryview(frames[0]).cast("B") if len(frames) == 1 else None
    if view is None or view.nbytes != math.prod(header.shape) * dtype.itemsize:
        raise ProtocolError(f"image rows {header.request_id}: the frame does not hold {header.shape} {header.dtype}")
    if zlib.crc32(view) != header.checksum:
        raise ProtocolError(f"image rows {header.request_id}: checksum mismatch")
    return _tensor_from_view(torch, view, dtype, tuple(header.shape))
