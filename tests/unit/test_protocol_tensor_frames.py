"""KV pages as tensor frames: zero-copy both ways, the checksum, and what the receiver refuses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagemesh.common.protocol import (
    KVPagesHeader,
    ProtocolError,
    decode,
    decode_tensor_frames,
    encode_tensor_frames,
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


def address_of(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0]


def kv_tensors(dtype: torch.dtype, layers: int = 2, pages: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(pages, 2, 16, 2, 8, generator=g).to(dtype) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_frames_round_trip(dtype):
    header = dataclasses.replace(HEADER, dtype=str(dtype).removeprefix("torch."))
    tensors = kv_tensors(dtype)
    frames = encode_tensor_frames(header, tensors)
    assert len(frames) == 2 + 2
    received = [bytes(f) for f in frames]  # what a socket hands over
    got_header = decode(received)
    assert got_header.checksum != 0 and got_header == dataclasses.replace(header, checksum=got_header.checksum)
    out = decode_tensor_frames(got_header, received[2:])
    for a, b in zip(tensors, out, strict=True):
        assert b.dtype == dtype and b.shape == a.shape and torch.equal(a, b)


def test_tensor_frames_send_contiguous_cpu_tensors_without_copy():
    tensors = kv_tensors(torch.bfloat16)
    frames = encode_tensor_frames(HEADER, tensors)
    assert [address_of(f) for f in frames[2:]] == [t.data_ptr() for t in tensors]


def test_decoded_tensors_share_the_frame_memory():
    frames = encode_tensor_frames(dataclasses.replace(HEADER, dtype="float16"), kv_tensors(torch.float16))
    received = [bytearray(f) for f in frames[2:]]  # writable, like a zmq frame
    out = decode_tensor_frames(decode(frames), received)
    assert out[0].data_ptr() == address_of(received[0])
    received[0][0:2] = b"\x00\x3c"  # fp16 1.0 written into the frame shows up in the tensor
    assert out[0].flatten()[0].item() == 1.0


def test_misaligned_frame_is_copied_and_still_correct():
    tensors = kv_tensors(torch.float32)
    frames = encode_tensor_frames(dataclasses.replace(HEADER, dtype="float32"), tensors)
    shifted = [memoryview(bytearray(b"x") + bytes(f))[1:] for f in frames[2:]]
    out = decode_tensor_frames(decode(frames), shifted)
    assert all(torch.equal(a, b) for a, b in zip(tensors, out))


def test_tensor_frames_strided_and_empty():
    strided = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in kv_tensors(torch.float32)]
    header = dataclasses.replace(HEADER, dtype="float32")
    out = decode_tensor_frames(decode(f := encode_tensor_frames(header, strided)), f[2:])
    assert all(torch.equal(a, b) for a, b in zip(strided, out))
    empty = dataclasses.replace(HEADER, num_pages=0, page_indices=[], dtype="float32")
    frames = encode_tensor_frames(empty, kv_tensors(torch.float32, pages=0))
    assert [t.shape[0] for t in decode_tensor_frames(decode(frames), frames[2:])] == [0, 0]


def test_tensor_frames_reject_bad_checksum_size_count_and_dtype():
    frames = encode_tensor_frames(HEADER, kv_tensors(torch.bfloat16))
    header, tensor_frames = decode(frames), [bytes(f) for f in frames[2:]]
    flipped = bytearray(tensor_frames[1])
    flipped[100] ^= 1
    with pytest.raises(ProtocolError, match="checksum"):
        decode_tensor_frames(header, [tensor_frames[0], bytes(flipped)])
    with pytest.raises(ProtocolError, match="bytes"):
        decode_tensor_frames(header, [tensor_frames[0], tensor_frames[1][:-2]])
    with pytest.raises(ProtocolError, match="frames declared"):
        decode_tensor_frames(header, tensor_frames[:1])
    with pytest.raises(ProtocolError, match="bytes"):  # header claims fp32 for bf16 bytes
        decode_tensor_frames(dataclasses.replace(header, dtype="float32"), tensor_frames)
    with pytest.raises(ProtocolError, match="bytes"):  # header claims another page shape
        decode_tensor_frames(dataclasses.replace(header, page_shape=[2, 16, 2, 4]), tensor_frames)
    with pytest.raises(ValueError, match="header says"):
        encode_tensor_frames(HEADER, kv_tensors(torch.float16))
    with pytest.raises(ValueError, match="header says"):
        encode_tensor_frames(HEADER, kv_tensors(torch.bfloat16, pages=2))
    with pytest.raises(ValueError, match="2 layers declared"):
        encode_tensor_frames(HEADER, kv_tensors(torch.bfloat16, layers=1))
