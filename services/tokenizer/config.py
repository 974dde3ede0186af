"""The tokenizer service's configuration, built once from flags (and PAGEMESH_* variables)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from pagemesh.common import cli_args
from pagemesh.common.cli_args import DEFAULT_DRAIN_TIMEOUT_S, DRAIN_TIMEOUT_HELP
from pagemesh.common.model_config import DEFAULT_MAX_MODEL_LEN_CAP, default_max_model_len
from pagemesh.common.model_files import resolve_model_path


@dataclass(frozen=True)
class TokenizerConfig:
    """address: Router bind for gateways; output_address: Pull bind for workers' token batches
    (the `reply_to` of every ScheduleRequest); scheduler_address: where the Dealer connects."""

    model: Path
    address: str
    output_address: str
    scheduler_address: str
    max_model_len: int
    name: str
    ready_address: str | None
    log_level: str
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    chat_template: str | None = None  # the template's text, instead of the model's own


def parse_args(argv: list[str]) -> TokenizerConfig:
    parser = argparse.ArgumentParser(prog="pagemesh tokenizer", description="tokenizer service")
    cli_args.add(parser, "--model", None, help="GGUF file or HF folder (default: the embedded model)")
    cli_args.add(parser, "--address", help="Router bind address for gateways")
    cli_args.add(parser, "--output-address", help="Pull bind address for workers' tokens")
    cli_args.add(parser, "--scheduler-address", help="scheduler Router address")
    cli_args.add(
        parser,
        "--max-model-len",
        None,
        type=int,
        help=f"context length (default: the model's, capped at {DEFAULT_MAX_MODEL_LEN_CAP})",
    )
    cli_args.add(
        parser,
        "--name",
        f"tokenizer-{socket.gethostname()}-{os.getpid()}",
        help="replica name (also its Dealer identity at the scheduler)",
    )
    cli_args.add(parser, "--ready-address", None, help="push Ready here once serving")
    cli_args.add(parser, "--log-level", "INFO", help="DEBUG, INFO, WARNING or ERROR")
    cli_args.add(parser, "--drain-timeout", DEFAULT_DRAIN_TIMEOUT_S, type=float, help=DRAIN_TIMEOUT_HELP)
    cli_args.add(parser, "--chat-template", None, help=CHAT_TEMPLATE_HELP)
    args = parser.parse_args(argv)
    for flag in ("address", "output_address", "scheduler_address"):  # no defaults: flag or env
        if getattr(args, flag) is None:
            parser.error(f"--{flag.replace('_', '-')} is required")
    model = resolve_model_path(args.model)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = default_max_model_len(model)
    if max_model_len < 2:
        parser.error("--max-model-len must be at least 2")
    return TokenizerConfig(
        model=model,
        address=args.address,
        output_address=args.output_address,
        scheduler_address=args.scheduler_address,
        max_model_len=max_model_len,
        name=args.name,
        ready_address=args.ready_address,
        log_level=args.log_level,
        drain_timeout=args.drain_timeout,
        chat_template=read_chat_template(parser, args.chat_template),
    )


CHAT_TEMPLATE_HELP = "a Jinja chat template, a file's path or the template itself, instead of the model's (as vLLM)"


def read_chat_template(parser: argparse.ArgumentParser, value: str | None) -> str | None:
    """--chat-template's text: the file it names, or else the value itself if it is a template
    (it has a `{`)."""
    if value is None:
        return None
    try:
        text = Path(value).expanduser().read_text(encoding="utf-8")
    except OSError:  # no such file (or a name no file can have: a template)
        text = None
    except UnicodeDecodeError as e:
        parser.error(f"--chat-template: cannot read {value}: {e}")
    if text is not None:
        return text
    if "{" not in value:
        parser.error(f"--chat-template: {value} is no file (nor a template)")
    return value
