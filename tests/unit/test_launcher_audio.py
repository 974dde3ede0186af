"""`pagemesh up --audio N --audio-model FOLDER`: the flags' checks, the audio workers in the plan
(their own command, threads, the scheduler's --serves), one GPU each on CUDA, and drained with the
other workers."""

from __future__ import annotations

import asyncio

import pytest

from pagemesh.services import launcher
from pagemesh.workers.audio.main import parse as parse_audio


@pytest.fixture
def whisper(tmp_path):
    folder = tmp_path / "whisper-tiny"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "preprocessor_config.json").write_text("{}")
    return folder


def parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        launcher.parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_audio_flags_are_checked_before_anything_starts(capsys, tmp_path, whisper):
    assert parse_error(["--audio", "1"], capsys).endswith(
        "error: --audio: give the Whisper model's folder with --audio-model"
    )
    assert parse_error(["--audio-model", str(whisper)], capsys).endswith(
        "error: --audio-model: give the number of audio workers with --audio N"
    )
    assert parse_error(["--audio", "1", "--audio-model", str(tmp_path / "none")], capsys).endswith(
        f"error: --audio-model: {tmp_path / 'none'} is not a Whisper model folder (no config.json, "
        "preprocessor_config.json, tokenizer.json)"
    )
    assert parse_error(["--audio", "-1"], capsys).endswith(
        "error: --diffusion, --diffusion-student, --encoder, --audio: must be >= 0"
    )
    flags = ["--audio", "1", "--audio-model", str(whisper), "--audio-threads", "0"]
    assert parse_error(flags, capsys).endswith("error: --audio-threads: must be >= 1")
    assert launcher.parse([]).audio == 0  # none by default
    (whisper / "tokenizer.json").unlink()
    assert parse_error(["--audio", "1", "--audio-model", str(whisper)], capsys).endswith(
        f"error: --audio-model: {whisper} is not a Whisper model folder (no tokenizer.json)"
    )


def test_a_mesh_of_audio_workers_alone_plans_them_with_their_threads_and_serves_audio(tmp_path, whisper):
    flags = ["--prefill", "0", "--decode", "0", "--diffusion", "0", "--audio", "2", "--audio-threads", "3"]
    args = launcher.parse([*flags, "--audio-model", str(whisper)])
    procs = dict(launcher.plan(args, str(tmp_path)))
    assert list(procs) == ["scheduler", "tokenizer", "audio-0", "audio-1", "gateway"]
    scheduler = procs["scheduler"]
    assert scheduler[scheduler.index("--serves") + 1] == "audio"
    audio = procs["audio-1"]
    assert audio[:8] == [
        "audio",
        "--worker-id",
        "audio-1",
        "--scheduler-address",
        scheduler[2],
        "--threads",
        "3",
        "--model",
    ]
    parsed = parse_audio(audio[1:])
    assert (parsed.model_path, parsed.threads, parsed.worker_id, parsed.max_batch) == (whisper, 3, "audio-1", 16)


def test_audio_beside_llm_workers_serves_both_and_takes_an_llm_workers_threads(tmp_path, whisper):
    args = launcher.parse(
        ["--mixed", "2", "--diffusion", "0", "--audio", "1", "--audio-model", str(whisper), "--threads-per-worker", "5"]
    )
    procs = dict(launcher.plan(args, str(tmp_path)))
    scheduler = procs["scheduler"]
    assert scheduler[scheduler.index("--serves") + 1] == "llm,audio"
    assert procs["audio-0"][procs["audio-0"].index("--threads") + 1] == "5"


def test_an_audio_worker_gets_a_gpu_of_its_own_in_turn(monkeypatch, tmp_path, whisper):
    monkeypatch.setattr(launcher, "nvidia_gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = launcher.parse(["--mixed", "1", "--diffusion", "0", "--audio", "2", "--audio-model", str(whisper)])
    procs = launcher.on_gpus(args, launcher.plan(args, str(tmp_path)))
    env = {name: e["CUDA_VISIBLE_DEVICES"] for name, _, e in procs if e}
    assert env == {"mixed-0": "0", "audio-0": "1", "audio-1": "0"}
    argv = {name: a for name, a, _ in procs}
    assert "--gpu-memory-utilization" not in argv["audio-0"]


def test_audio_workers_drain_with_the_other_workers(monkeypatch, tmp_path, whisper):
    args = launcher.parse(
        ["--mixed", "1", "--diffusion", "0", "--audio", "1", "--audio-model", str(whisper), "--run-dir", str(tmp_path)]
    )
    mesh = launcher.Mesh(args)
    order = []

    async def drain_in_order(children, groups, timeout, hurry):
        order.extend(groups)

    monkeypatch.setattr(launcher, "drain_in_order", drain_in_order)
    asyncio.run(mesh.drain(asyncio.Event()))
    assert order == [["gateway"], ["mixed-0", "audio-0"]]
