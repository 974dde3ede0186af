"""`pagemesh encoder`: one encoder worker, a multimodal model's vision tower serving the mesh."""

from __future__ import annotations

import argparse

from pagemesh.common.cli_args import add
from pagemesh.common.cpu_threads import prepare_worker_threads
from pagemesh.common.logging import configure_logging
from pagemesh.common.model_files import resolve_model_path, served_model_name
from pagemesh.common.process import run_until_signalled
from pagemesh.workers.shell.config import add_shell_arguments, shell_config_from_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagemesh encoder", description=__doc__)
    add_shell_arguments(parser)
    add(parser, "--model", None, help="a multimodal model's folder (LLaVA, Qwen2-VL, digits-vlm)")
    add(parser, "--dtype", "auto", help="auto (as the LLM workers: bf16 where it is fast), float32, bfloat16")
    add(parser, "--device", "auto", help="auto, cpu or cuda")
    add(parser, "--threads", None, type=int, help="torch CPU threads")
    args = parser.parse_args(argv)
    args.model_path = resolve_model_path(args.model)
    if not (args.model_path / "config.json").exists():
        parser.error(f"--model: {args.model_path} is not a multimodal model folder")
    return args


def main(argv: list[str]) -> None:
    prepare_worker_threads()
    import torch

    from pagemesh.workers.encoder.worker import EncoderWorker
    from pagemesh.workers.model.vision.encoder import ImageEncoder
    from pagemesh.workers.shell.shell import WorkerShell

    args = parse(argv)
    shell_config = shell_config_from_args(args, "encoder")
    configure_logging("encoder", shell_config.worker_id)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    )
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32}.get(args.dtype) or getattr(
        torch, args.dtype
    )
    from pagemesh.workers.model.loader import hf_folder_weights

    encoder = ImageEncoder(args.model_path, dtype, device)
    encoder.load(hf_folder_weights(args.model_path))
    shell = WorkerShell(shell_config, lambda ctx: EncoderWorker(encoder, served_model_name(args.model_path), ctx))
    try:
        run_until_signalled(shell.run(), drain=shell.drain)
    finally:
        shell.close()
