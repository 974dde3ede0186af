"""The speech-to-text engine (workers/audio/) against Hugging Face transformers in fp32.

The tiny random Whisper checkpoint and HF's greedy tokens on it, the oracle, token for token, are
tests/audio_checkpoints.py's.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import wave

import numpy as np
import pytest
import torch

from pagemesh.tests.audio_checkpoints import (
    EN,
    EOS,
    MAX_TARGET,
    NO_TIMESTAMPS,
    PROMPT_LEN,
    RATE,
    START,
    TRANSCRIBE,
    hf_greedy,
    save_tiny_whisper,
)
from pagemesh.workers.audio.audio_files import decode_audio
from pagemesh.workers.audio.decoding_rules import DecoderPrompt, default_prompt
from pagemesh.workers.audio.engine import AudioEngine

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def whisper_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper_tiny")
    save_tiny_whisper(folder, tied=False)
    return folder


@pytest.fixture(scope="module")
def hf_whisper(whisper_folder):
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(whisper_folder, dtype=torch.float32).eval()
    return model, WhisperFeatureExtractor.from_pretrained(whisper_folder)


@pytest.fixture(scope="module")
def clips():
    """Four seeded clips of 0.5, 1.5, 2.5 and 6.25 s: sines of different pitch over noise."""
    rng = np.random.default_rng(0)
    out = []
    for freq, seconds in [(220, 0.5), (440, 1.5), (880, 2.5), (150, 6.25)]:
        t = np.arange(int(seconds * RATE)) / RATE
        out.append((0.5 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32))
    return out


def run(engine, collect=None, languages=None) -> dict[str, list[int]]:
    """Step until every request ends; tokens per request (and finish reasons, languages)."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if collect is not None and out.finished:
                collect[out.request_id] = out.finish_reason
            if languages is not None and out.language_token_id is not None:
                languages[out.request_id] = out.language_token_id
    return tokens


def assert_all_pages_free(engine) -> None:
    engine.check_invariants()
    assert engine.num_free_pages == engine.num_usable_pages
    assert not engine.has_unfinished()


# ---- the engine against HF ------------------------------------------------------------------------
def test_batched_greedy_equals_hf(whisper_folder, hf_whisper, clips):
    engine = AudioEngine(whisper_folder)
    for i, clip in enumerate(clips):
        engine.admit(f"clip{i}", clip, max_tokens=24)
    reasons, languages = {}, {}
    tokens = run(engine, reasons, languages)
    expected = hf_greedy(hf_whisper, clips, 24)
    assert [tokens[f"clip{i}"] for i in range(4)] == expected
    assert len({tuple(t) for t in expected}) == 4  # the audio steers the tokens
    model, extractor = hf_whisper
    features = torch.from_numpy(extractor(clips, sampling_rate=RATE, return_tensors="np").input_features)
    assert [languages[f"clip{i}"] for i in range(4)] == model.detect_language(features).tolist()
    assert reasons == {f"clip{i}": "stop" if expected[i][-1] == EOS else "length" for i in range(4)}
    assert_all_pages_free(engine)


def test_encoder_and_cross_kv_run_once_per_request(whisper_folder, clips):
    engine = AudioEngine(whisper_folder)
    calls: dict[str, list[int]] = {"encoder": [], "cross_k": [], "cross_v": [], "self_k": []}

    def count(name):
        return lambda module, args, out: calls[name].append(args[0].shape[0])

    engine.model.encoder.register_forward_hook(count("encoder"))
    for layer in engine.model.decoder.layers:
        layer.encoder_attn.k_proj.register_forward_hook(count("cross_k"))
        layer.encoder_attn.v_proj.register_forward_hook(count("cross_v"))
        layer.self_attn.k_proj.register_forward_hook(count("self_k"))
    for i, clip in enumerate(clips):
        engine.admit(f"clip{i}", clip, max_tokens=24)
    tokens = run(engine)
    longest = max(len(t) for t in tokens.values())
    assert longest == 24
    # one step detects the languages, one feeds the rest of the prompts and picks the first tokens
    assert engine.stats.decoder_steps == 1 + longest
    assert calls["encoder"] == [4]  # one batched call over the four clips
    assert calls["cross_k"] == calls["cross_v"] == [4 * 1500] * 2  # once per decoder layer, all four requests
    assert len(calls["self_k"]) == 2 * engine.stats.decoder_steps  # the decoder's own K/V: every step
    assert engine.stats.encoder_batches == 1
    assert engine.stats.encoded_requests == engine.stats.cross_kv_writes == 4
    assert engine.stats.decoder_rows == 4 * 1 + 4 * 3 + sum(len(t) - 1 for t in tokens.values())


def test_request_joining_mid_decode_equals_hf(whisper_folder, hf_whisper, clips):
    engine = AudioEngine(whisper_folder)
    english = [START, EN, TRANSCRIBE, NO_TIMESTAMPS]
    tokens: dict[str, list[int]] = {}

    def step() -> int:  # the rows the step ran
        rows = engine.stats.decoder_rows
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return engine.stats.decoder_rows - rows

    engine.admit("first", clips[3], max_tokens=20)
    for _ in range(6):
        step()
    assert len(tokens["first"]) == 5
    engine.admit("second", clips[1], max_tokens=20)
    engine.admit("english", clips[0], max_tokens=20, prompt_ids=english)
    # first: its next token; second: <|startoftranscript|>, to detect its language; english: its whole prompt
    assert step() == 1 + 1 + 4
    assert step() == 1 + 3 + 1  # second's prompt after its language, as a chunk beside two one-token rows
    while engine.has_unfinished():
        step()
    assert tokens["first"] == hf_greedy(hf_whisper, [clips[3]], 20)[0]
    assert tokens["second"] == hf_greedy(hf_whisper, [clips[1]], 20)[0]
    assert tokens["english"] == hf_greedy(hf_whisper, [clips[0]], 20, prompt_ids=english)[0]
    assert_all_pages_free(engine)


def test_stop_at_an_end_token_and_at_max_target_positions(whisper_folder, hf_whisper, clips, tmp_path):
    expected = hf_greedy(hf_whisper, [clips[2]], MAX_TARGET - PROMPT_LEN)[0]
    engine = AudioEngine(whisper_folder)
    engine.admit("long", clips[2], max_tokens=1000)  # capped: the sequence fills the decoder's positions
    reasons = {}
    assert run(engine, reasons)["long"] == expected
    assert len(expected) == MAX_TARGET - PROMPT_LEN and reasons == {"long": "length"}
    # the same checkpoint whose end token is one the clip produces mid-way: it stops there, end token included
    end = expected[7]
    folder = tmp_path / "other_end"
    shutil.copytree(whisper_folder, folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = end
        (folder / name).write_text(json.dumps(config))
    engine = AudioEngine(folder)
    engine.admit("short", clips[2], max_tokens=1000)
    reasons = {}
    assert run(engine, reasons)["short"] == expected[: expected.index(end) + 1]
    assert reasons == {"short": "stop"}
    assert_all_pages_free(engine)


def test_abort_and_finish_free_every_page(whisper_folder, clips):
    engine = AudioEngine(whisper_folder, max_batch=2)
    free = engine.num_free_pages
    for i, clip in enumerate(clips[:3]):
        engine.admit(f"r{i}", clip, max_tokens=8)
    assert engine.step() == []  # the language detection step of r0 and r1; r2 waits for a slot
    engine.check_invariants()
    per_request = free - engine.num_free_pages
    assert per_request % 2 == 0 and per_request // 2 == -(-1500 // 16) + 1  # cross pages + one self page each
    engine.abort("r2")  # waiting: leaves the queue, held nothing
    engine.abort("r0")  # running: its pages go back now
    engine.check_invariants()
    assert free - engine.num_free_pages == per_request // 2
    outputs = run(engine)
    assert set(outputs) == {"r1"} and len(outputs["r1"]) == 8
    assert_all_pages_free(engine)
    engine.admit("r0", clips[0], max_tokens=8)  # an ended id may come again
    engine.step()
    engine.abort("r0")
    assert_all_pages_free(engine)


def test_admit_refuses_impossible_requests(whisper_folder, clips):
    engine = AudioEngine(whisper_folder, num_pages=1 + 94 + 4)  # one request of up to 64 tokens
    engine.admit("a", clips[0], max_tokens=4)
    cases = [
        (("a", clips[0], 4), "already admitted"),
        (("b", np.zeros(0, np.float32), 4), "non-empty"),
        (("b", np.zeros((2, 100), np.float32), 4), "mono"),
        (("b", np.zeros(30 * RATE + 1, np.float32), 4), "30 s"),
        (("b", clips[0], 0), "max_tokens"),
        (("b", clips[0], 4, [START, 300]), "prompt_ids"),
        (("b", clips[0], 4, [START] * MAX_TARGET), "no room"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.admit(*args)
    small = AudioEngine(whisper_folder, num_pages=1 + 94 + 1)
    small.admit("fits", clips[0], max_tokens=13)  # K/V of 4 + 13 - 1 tokens (the last is never fed): one page
    with pytest.raises(ValueError, match="needs 96 KV pages, the pool has 95"):
        small.admit("too long", clips[0], max_tokens=14)
    run(small)  # the pool holds one such request at a time: a second waits for the first to end
    small.admit("x", clips[0], max_tokens=13)
    small.admit("y", clips[1], max_tokens=13)
    small.step()
    assert small.stats.encoded_requests == 2  # "fits", then "x" alone
    assert set(run(small)) == {"x", "y"}
    assert_all_pages_free(small)


def test_spoken_sentence_equals_hf(tmp_path, clips):
    """Real speech (espeak-ng's "hello world, this is a test", 22050 Hz) through audio_files and a
    checkpoint whose output projection is its token embedding (tied, as in real Whisper)."""
    from safetensors.torch import load_file
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (Debian package espeak-ng): no speech to synthesise")
    wav = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "hello world, this is a test"], check=True, capture_output=True)
    with wave.open(str(wav)) as w:
        rate, frames = w.getframerate(), w.getnframes()
    samples = decode_audio(wav.read_bytes())
    assert samples.dtype == np.float32 and samples.size == -(-frames * RATE // rate)
    folder = tmp_path / "tied"
    save_tiny_whisper(folder, tied=True)
    assert "proj_out.weight" not in load_file(folder / "model.safetensors")  # tied: the embedding is the head
    hf = (
        WhisperForConditionalGeneration.from_pretrained(folder).eval(),
        WhisperFeatureExtractor.from_pretrained(folder),
    )
    engine = AudioEngine(folder)
    engine.admit("speech", samples, max_tokens=16)
    engine.admit("noise", clips[1], max_tokens=16)
    tokens = run(engine)
    assert [tokens["speech"], tokens["noise"]] == hf_greedy(hf, [samples, clips[1]], 16)
    assert tokens["speech"] != tokens["noise"]


def test_default_prompt_of_real_whisper_generation_configs():
    """The values of openai/whisper-small's and whisper-tiny.en's generation_config.json."""
    small = default_prompt(50258, [[1, None], [2, 50359]], {"<|en|>": 50259, "<|de|>": 50261}, 50363)
    assert small == DecoderPrompt(head=(50258,), language_ids=(50259, 50261), after_language=(50359, 50363))
    assert small.length == 4
    assert default_prompt(50257, [[1, 50362]], None, 50362) == DecoderPrompt(head=(50257, 50362))
    assert default_prompt(50258, None, {"<|en|>": 50259}, 50363).after_language == (50363,)
    assert default_prompt(7, None, None, None) == DecoderPrompt(head=(7,))
    with pytest.raises(ValueError, match="skip position 1"):
        default_prompt(7, [[2, 5]], None, None)


# ---- audio files ---------------------------------------------------------------------------------
def wav_bytes(frames: np.ndarray, rate: int, width: int) -> bytes:
    """A PCM WAV (stdlib `wave`) of integer frames [n, channels]."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(frames.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 3:
            raw = frames.astype("<i4").reshape(-1, 1).view(np.uint8)[:, :3].tobytes()
        else:
            raw = frames.astype({1: np.uint8, 2: "<i2", 4: "<i4"}[width]).tobytes()
        w.writeframes(raw)
    return buffer.getvalue()


def riff(audio_format: int, channels: int, rate: int, bits: int, data: bytes) -> bytes:
    """A WAV written by hand (formats `wave` does not write)."""
    align = channels * bits // 8
    fmt = struct.pack("<HHIIHH", audio_format, channels, rate, rate * align, align, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_wav_stereo_44k_16bit_is_averaged_and_resampled():
    t = np.arange(44_100) / 44_100
    left, right = 16384 * np.sin(2 * np.pi * 440 * t), 8192 * np.sin(2 * np.pi * 440 * t)
    samples = decode_audio(wav_bytes(np.round(np.stack([left, right], axis=1)), 44_100, 2))
    assert samples.dtype == np.float32 and samples.shape == (16_000,)
    expected = 0.375 * np.sin(2 * np.pi * 440 * np.arange(16_000) / RATE)
    np.testing.assert_allclose(samples[200:-200], expected[200:-200], atol=2e-3)


def test_wav_mono_8k_8bit_is_upsampled():
    t = np.arange(4000) / 8000
    samples = decode_audio(wav_bytes(np.round(128 + 100 * np.sin(2 * np.pi * 200 * t))[:, None], 8000, 1))
    assert samples.dtype == np.float32 and samples.shape == (8000,)
    expected = 100 / 128 * np.sin(2 * np.pi * 200 * np.arange(8000) / RATE)
    np.testing.assert_allclose(samples[200:-200], expected[200:-200], atol=1e-2)


def test_wav_sample_formats_at_16k_decode_exactly():
    def decoded(data: bytes) -> list[float]:
        return decode_audio(data).tolist()

    assert decoded(wav_bytes(np.array([[128], [192], [0], [255]]), RATE, 1)) == [0, 0.5, -1, 127 / 128]
    assert decoded(wav_bytes(np.array([[0], [16384], [-32768], [32767]]), RATE, 2)) == [0, 0.5, -1, 32767 / 32768]
    assert decoded(wav_bytes(np.array([[0], [1 << 22], [-(1 << 23)], [-1]]), RATE, 3)) == [0, 0.5, -1, -(2.0**-23)]
    assert decoded(wav_bytes(np.array([[1 << 30], [-(1 << 31)]]), RATE, 4)) == [0.5, -1]
    floats = np.array([0.25, -0.75, 1.5], dtype="<f4").tobytes()
    assert decoded(riff(3, 1, RATE, 32, floats)) == [0.25, -0.75, 1.5]
    assert decoded(riff(3, 1, RATE, 64, np.array([0.125], dtype="<f8").tobytes())) == [0.125]
    assert decoded(riff(1, 2, RATE, 16, np.array([100, 300], dtype="<i2").tobytes())) == [200 / 32768]


def test_wav_refusals_name_the_problem():
    with pytest.raises(ValueError, match="not a WAV file; accepted: WAV .*PCM 8/16/24/32-bit"):
        decode_audio(b"ID3\x03 this is an mp3, or garbage" * 4)
    with pytest.raises(ValueError, match="not a WAV"):
        decode_audio(b"")
    with pytest.raises(ValueError, match="no samples"):
        decode_audio(riff(1, 1, RATE, 16, b""))
    with pytest.raises(ValueError, match="31.00 s long; Whisper's window is 30 s"):
        decode_audio(wav_bytes(np.full((31 * 8000, 1), 128), 8000, 1))
    assert decode_audio(wav_bytes(np.full((30 * 8000, 1), 128), 8000, 1)).shape == (30 * RATE,)
    with pytest.raises(ValueError, match="16-bit format 0x2 WAV is not supported"):
        decode_audio(riff(2, 1, RATE, 16, b"\0\0"))
    with pytest.raises(ValueError, match="without a complete fmt and data chunk"):
        decode_audio(b"RIFF\x04\0\0\0WAVE")
    # a rate whose resampling filter would not fit in memory (a crafted header): refused first
    with pytest.raises(ValueError, match="a sample rate of 4000000007 Hz is not supported"):
        decode_audio(riff(1, 1, 4_000_000_007, 8, b"\x80" * 100))
    with pytest.raises(ValueError, match="a sample rate of 999 Hz is not supported"):
        decode_audio(riff(1, 1, 999, 8, b"\x80" * 100))
