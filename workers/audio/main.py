"""`pagemesh audio`: one audio worker, a Whisper model transcribing for the mesh (speech to text)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagemesh.common.cli_args import add
from pagemesh.common.cpu_threads import prepare_worker_threads
from pagemesh.common.logging import configure_logging
from pagemesh.common.model_files import served_model_name
from pagemesh.common.process import run_until_signalled
from pagemesh.workers.shell.config import add_shell_arguments, shell_config_from_args

# what the worker loads from a Whisper folder (besides the weights): checked before it starts
WHISPER_FILES = ("config.json", "preprocessor_config.json", "tokenizer.json")


def missing_whisper_files(folder: Path) -> list[str]:
    return [name for name in WHISPER_FILES if not (folder / name).is_file()]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagemesh audio", description=__doc__)
    add_shell_arguments(parser)
    add(parser, "--model", None, help="a Whisper model's Hugging Face folder (weights, configs, tokenizer.json)")
    add(parser, "--dtype", "auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    add(parser, "--device", "auto", help="auto, cpu or cuda")
    add(parser, "--threads", None, type=int, help="torch CPU threads")
    add(parser, "--max-batch", 16, type=int, help="requests decoded together (the rest wait on the worker)")
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model: required (a Whisper model folder)")
    args.model_path = Path(args.model).expanduser().resolve()
    if missing := missing_whisper_files(args.model_path):
        parser.error(f"--model: {args.model_path} is not a Whisper model folder (no {', '.join(missing)})")
    if args.max_batch < 1:
        parser.error("--max-batch: must be >= 1")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        parser.error("--dtype: one of auto, float32, bfloat16, float16")
    return args


def main(argv: list[str]) -> None:
    prepare_worker_threads()  # OpenMP's waits: before torch loads it (common/cpu_threads.py)
    import torch

    from pagemesh.workers.audio.engine import AudioEngine
    from pagemesh.workers.audio.transcript import TranscriptDecoder
    from pagemesh.workers.audio.worker import AudioWorker
    from pagemesh.workers.shell.shell import WorkerShell

    args = parse(argv)
    shell_config = shell_config_from_args(args, "audio")
    configure_logging("audio", shell_config.worker_id)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("pagemesh audio: --device cuda, but torch sees no CUDA device")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32}.get(args.dtype) or getattr(
        torch, args.dtype
    )
    engine = AudioEngine(args.model_path, dtype, device, max_batch=args.max_batch)
    transcripts = TranscriptDecoder.from_folder(args.model_path)
    model = served_model_name(args.model_path)
    shell = WorkerShell(shell_config, lambda ctx: AudioWorker(engine, transcripts, model, ctx))
    try:
        run_until_signalled(shell.run(), drain=shell.drain)
    finally:
        shell.close()
