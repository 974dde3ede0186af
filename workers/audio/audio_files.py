"""Audio file bytes -> float32 mono samples at 16 kHz, Whisper's input.

Takes WAV (RIFF/WAVE, plain or WAVE_FORMAT_EXTENSIBLE): integer PCM of 8 (unsigned), 16, 24 or 32
bits, or IEEE float of 32 or 64 bits; any number of channels (averaged to one) and any sample rate
from 1 to 768 kHz (resampled with scipy's polyphase filter, `resample_poly`, whose filter grows
with the rate: a header claiming gigahertz would ask for hundreds of GiB). Integer samples are
scaled to [-1, 1) by their full scale (int16 / 32768). Anything else, an empty clip, or one longer than Whisper's
30 s window is a ValueError that says so.

    RIFF <size> WAVE  { <chunk id> <size, u32 LE> <payload, padded to even> }*
                        "fmt ": format, channels, rate, byte rate, block align, bits [, extensible]
                        "data": interleaved frames
"""

from __future__ import annotations

import struct
from math import gcd

import numpy as np

SAMPLE_RATE = 16_000
MIN_RATE, MAX_RATE = 1_000, 768_000  # Hz a file may have
MAX_SECONDS = 30.0
ACCEPTED = "WAV (RIFF/WAVE) with PCM 8/16/24/32-bit or float 32/64-bit samples"

_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


def decode_audio(data: bytes) -> np.ndarray:
    """The file's samples as float32 mono at 16 kHz (see the module docstring)."""
    audio_format, channels, rate, bits, frames = _parse_wav(data)
    if audio_format == _PCM and bits in (8, 16, 24, 32):
        samples = _pcm_to_float(frames, bits)
    elif audio_format == _FLOAT and bits in (32, 64):
        samples = np.frombuffer(frames, dtype="<f4" if bits == 32 else "<f8").astype(np.float64)
    else:
        kind = {_PCM: "PCM", _FLOAT: "float"}.get(audio_format, f"format {audio_format:#x}")
        raise ValueError(f"audio: {bits}-bit {kind} WAV is not supported; accepted: {ACCEPTED}")
    num_frames = samples.size // channels
    if num_frames == 0:
        raise ValueError("audio: the WAV file holds no samples")
    if num_frames / rate > MAX_SECONDS:
        raise ValueError(
            f"audio: the clip is {num_frames / rate:.2f} s long; Whisper's window is {MAX_SECONDS:.0f} s "
            "(longer audio must be split into clips first)"
        )
    mono = samples[: num_frames * channels].reshape(num_frames, channels).mean(axis=1)
    if rate != SAMPLE_RATE:
        from scipy.signal import resample_poly

        common = gcd(rate, SAMPLE_RATE)
        mono = resample_poly(mono, SAMPLE_RATE // common, rate // common)
    return mono.astype(np.float32)


def _parse_wav(data: bytes) -> tuple[int, int, int, int, bytes]:
    """(format, channels, rate, bits per sample, the data chunk's bytes, whole frames only)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError(f"audio: not a WAV file; accepted: {ACCEPTED}")
    fmt, frames, offset = None, None, 12
    while offset + 8 <= len(data):
        chunk_id, size = struct.unpack_from("<4sI", data, offset)
        payload = data[offset + 8 : offset + 8 + size]  # a streamed file's data size may overshoot
        if chunk_id == b"fmt ":
            fmt = payload
        elif chunk_id == b"data":
            frames = payload
            break
        offset += 8 + size + (size & 1)
    if fmt is None or len(fmt) < 16 or frames is None:
        raise ValueError(f"audio: a WAV file without a complete fmt and data chunk; accepted: {ACCEPTED}")
    audio_format, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if audio_format == _EXTENSIBLE and len(fmt) >= 26:
        audio_format = struct.unpack_from("<H", fmt, 24)[0]  # the sub-format GUID's first two bytes
    if channels < 1 or rate < 1 or bits % 8 or block_align != channels * bits // 8:
        raise ValueError(f"audio: a WAV header that does not add up ({channels} channels, {rate} Hz, {bits} bits)")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"audio: a sample rate of {rate} Hz is not supported (1 kHz to 768 kHz)")
    return audio_format, channels, rate, bits, frames[: len(frames) - len(frames) % block_align]


def _pcm_to_float(frames: bytes, bits: int) -> np.ndarray:
    if bits == 8:  # unsigned, 128 is silence
        return (np.frombuffer(frames, dtype=np.uint8).astype(np.float64) - 128.0) / 128.0
    if bits == 24:  # three little-endian bytes: put them in the top of an int32 to keep the sign
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3)
        wide = np.zeros((raw.shape[0], 4), dtype=np.uint8)
        wide[:, 1:] = raw
        return wide.view("<i4").ravel().astype(np.float64) / 2.0**31
    dtype = "<i2" if bits == 16 else "<i4"
    return np.frombuffer(frames, dtype=dtype).astype(np.float64) / 2.0 ** (bits - 1)
