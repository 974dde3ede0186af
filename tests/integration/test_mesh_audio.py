"""Speech to text through the real mesh: `pagemesh up --audio 1` with no LLM or diffusion worker,
the official `openai` client, and the tiny random Whisper of tests/audio_checkpoints.py (with a
word-level tokenizer: token i is `w{i}`), whose oracle is Hugging Face's greedy tokens on the same
file, decoded by the folder's tokenizer.json.

    one mesh (module): an espeak-ng sentence and a synthetic clip transcribe to the oracle's text,
        as json and as text; bad input is a 400 naming the field and the worker serves on; two
        transcriptions at once are both right; /v1/models lists the audio model
    separate processes: a killed audio worker fails its request with a 503, the other serves on
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import math
import shutil
import subprocess
import time
import urllib.request

import numpy as np
import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, LATE_S, SeparateProcesses, metrics, per_worker, running_mesh, wait_until
from pagemesh.tests.audio_checkpoints import (
    MAX_TARGET,
    PROMPT_LEN,
    RATE,
    hf_greedy,
    save_tiny_whisper,
    transcript_of,
    wav_16bit,
    write_tokenizer,
)

pytestmark = pytest.mark.slow

MODEL = "whisper-tiny-random"  # the folder's name: the model's served name
# fp32 on the CPU, as the oracle runs (on a GPU the worker would pick bf16 on CUDA): every process
# reads its flags' defaults from PAGEMESH_*, and only the audio worker has these two that matter
CPU_FP32 = {"PAGEMESH_DEVICE": "cpu", "PAGEMESH_DTYPE": "float32"}
HEARTBEAT_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def whisper_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("audio") / MODEL
    folder.mkdir()
    save_tiny_whisper(folder, tied=False)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def oracle(whisper_folder):
    """file bytes -> (the text HF's greedy tokens give, the usage's seconds)."""
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    from pagemesh.workers.audio.audio_files import decode_audio

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the mesh's processes share the machine's cores
    hf = (
        WhisperForConditionalGeneration.from_pretrained(whisper_folder, dtype=torch.float32).eval(),
        WhisperFeatureExtractor.from_pretrained(whisper_folder),
    )

    def expected(data: bytes) -> tuple[str, int]:
        samples = decode_audio(data)  # what the worker decodes the file to
        [tokens] = hf_greedy(hf, [samples], MAX_TARGET - PROMPT_LEN)  # the whole decoder: max_tokens is not set
        return transcript_of(whisper_folder, tokens), math.ceil(samples.size / RATE)

    yield expected
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def mesh(whisper_folder):
    flags = ("--audio", "1", "--audio-model", str(whisper_folder), "--audio-threads", "1")
    with running_mesh(*flags, "--prefill", "0", "--decode", "0", "--diffusion", "0", env=CPU_FP32) as url:
        yield url


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def synthetic_wav(freq: float, seconds: float, seed: int) -> bytes:
    """A sine over noise, 16-bit at 16 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    noise = 0.05 * np.random.default_rng(seed).standard_normal(t.size)
    return wav_16bit(0.5 * np.sin(2 * np.pi * freq * t) + noise)


@pytest.fixture(scope="module")
def speech_wav(tmp_path_factory) -> bytes:
    """espeak-ng's "hello world, this is a test" (22050 Hz: the worker resamples it)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (Debian package espeak-ng): no speech to synthesise")
    path = tmp_path_factory.mktemp("speech") / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(path), "hello world, this is a test"], check=True, capture_output=True)
    return path.read_bytes()


def transcribe(client, data: bytes, **kwargs):
    return client.audio.transcriptions.create(model=MODEL, file=("clip.wav", io.BytesIO(data)), **kwargs)


def test_speech_and_a_synthetic_clip_transcribe_to_hf_greedy_text(client, oracle, speech_wav):
    tone = synthetic_wav(440, 1.5, seed=1)
    for data in (speech_wav, tone):
        text, seconds = oracle(data)
        result = transcribe(client, data)
        assert result.text == text and text  # the word-level tokenizer: text names the ids
        assert result.usage.model_dump() == {"type": "duration", "seconds": seconds}
    assert oracle(speech_wav)[0] != oracle(tone)[0]  # the audio steers the text


def test_response_format_text_is_the_text_alone(client, oracle, speech_wav):
    assert transcribe(client, speech_wav, response_format="text") == oracle(speech_wav)[0]


@pytest.mark.parametrize(
    "data, kwargs, param, says",
    [
        (b"ID3\x03 an mp3, or anything but a WAV" * 8, {}, "file", "file: not a WAV file; accepted: WAV"),
        (None, {"temperature": 0.5}, "temperature", "only 0 is supported"),
        (None, {"language": "fr"}, "language", "language: not supported"),
        (None, {"response_format": "srt"}, "response_format", "'srt' is not supported"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_the_worker_serves_on(client, oracle, data, kwargs, param, says):
    tone = synthetic_wav(880, 0.5, seed=3)
    with pytest.raises(openai.BadRequestError) as e:
        transcribe(client, data or tone, **kwargs)
    error = e.value.body
    assert error["param"] == param and says in error["message"], error
    assert transcribe(client, tone).text == oracle(tone)[0]


def test_an_unknown_model_is_a_404_and_models_lists_the_audio_model(mesh, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.audio.transcriptions.create(model="whisper-1", file=("a.wav", io.BytesIO(synthetic_wav(300, 0.2, 3))))
    assert e.value.body["param"] == "model" and f"audio models served: {MODEL}." in e.value.body["message"]
    with urllib.request.urlopen(mesh + "/v1/models") as r:
        cards = {card["id"]: card["kind"] for card in json.load(r)["data"]}
    assert cards[MODEL] == "audio"


def test_two_transcriptions_at_once_are_both_right(client, oracle):
    clips = [synthetic_wav(150, 6.25, seed=4), synthetic_wav(660, 2.5, seed=5)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(lambda data: transcribe(client, data).text, clips))
    assert texts == [oracle(data)[0] for data in clips]
    assert texts[0] != texts[1]


def test_a_killed_audio_workers_request_starts_over_on_the_other(tmp_path, whisper_folder, oracle, monkeypatch):
    monkeypatch.setenv("PAGEMESH_TEST_STEP_DELAY_S", "0.1")  # ~60 steps: a request runs for seconds
    for name, value in CPU_FP32.items():
        monkeypatch.setenv(name, value)
    flags = ("--audio", "2", "--audio-model", str(whisper_folder), "--audio-threads", "1")
    procs = SeparateProcesses(str(tmp_path), *flags, "--prefill", "0", "--decode", "0", "--heartbeat-timeout", "2")
    try:
        procs.start()
        client = openai.OpenAI(base_url=procs.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)

        def running() -> dict[str, float]:
            return per_worker(metrics(procs.url), "pagemesh_num_requests_running")

        tone = synthetic_wav(440, 1.5, seed=1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(transcribe, client, tone)
            assert wait_until(lambda: sum(running().values()) == 1)
            victim = max(running().items(), key=lambda kv: kv[1])[0]
            procs.kill(victim)
            killed_at = time.monotonic()
            heard = pending.result(timeout=HANG_S)  # on the other worker, from the start: no error
        assert heard.text == oracle(tone)[0]
        assert time.monotonic() - killed_at < HEARTBEAT_TIMEOUT_S + LATE_S
    finally:
        procs.stop()
