"""The gateway's configuration, built once from flags (and PAGEMESH_* variables)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from common import cli_args
from common.model_config import DEFAULT_MAX_MODEL_LEN_CAP, default_max_model_len
from common.model_files import model_aliases, resolve_model_path, served_model_name

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class GatewayConfig:
    """host/port: the HTTP listener. tokenizer_address and scheduler_address: Routers this
    gateway's Dealers connect to; reply_address: its Pull bind, where text and errors come back.
    model_names: the names a request's `model` may use (served name first, then its aliases and
    the path). max_model_len: the context length /v1/models reports (the tokenizer enforces it).
    startup_wait: a generation request that comes before the mesh was ever ready waits up to this
    many seconds for it, then gets 503 with Retry-After; 0 turns the check off (tests' fakes)."""

    host: str
    port: int
    tokenizer_address: str
    scheduler_address: str
    reply_address: str
    model: Path
    model_names: tuple[str, ...]
    max_body_bytes: int
    request_timeout: float
    name: str
    ready_address: str | None
    log_level: str
    max_model_len: int = DEFAULT_MAX_MODEL_LEN_CAP
    startup_wait: float = 0.0

    @property
    def served_model(self) -> str:
        return self.model_names[0]


def parse_args(argv: list[str]) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="pagemesh gateway", description="OpenAI-compatible HTTP gateway")
    cli_args.add(parser, "--host", "127.0.0.1", help="HTTP listen host")
    cli_args.add(parser, "--port", 8000, type=int, help="HTTP listen port (0: any free port)")
    cli_args.add(parser, "--tokenizer-address", help="tokenizer Router address")
    cli_args.add(parser, "--scheduler-address", help="scheduler Router address (aborts, status)")
    cli_args.add(parser, "--reply-address", help="Pull bind address for replies from tokenizers")
    cli_args.add(parser, "--model", None, help="GGUF file or HF folder (default: the embedded model)")
    cli_args.add(parser, "--max-model-len", None, type=int, help="context length (default: the model's, capped)")
    cli_args.add(parser, "--max-body-bytes", DEFAULT_MAX_BODY_BYTES, type=int, help="larger bodies get 413")
    cli_args.add(parser, "--request-timeout", 600.0, type=float, help="seconds a request may take in all")
    cli_args.add(
        parser,
        "--startup-wait",
        10.0,
        type=float,
        help="seconds a request waits for a mesh that is still starting before a 503 with Retry-After",
    )
    cli_args.add(
        parser,
        "--name",
        f"gateway-{socket.gethostname()}-{os.getpid()}",
        help="replica name (also its Dealer identity)",
    )
    cli_args.add(parser, "--ready-address", None, help="push Ready here once serving")
    cli_args.add(parser, "--log-level", "INFO", help="DEBUG, INFO, WARNING or ERROR")
    args = parser.parse_args(argv)
    for flag in ("tokenizer_address", "scheduler_address", "reply_address"):  # no defaults: flag or env
        if getattr(args, flag) is None:
            parser.error(f"--{flag.replace('_', '-')} is required")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    if args.max_body_bytes < 1024:
        parser.error("--max-body-bytes must be at least 1024")
    if not args.request_timeout > 0:
        parser.error("--request-timeout must be positive")
    if not args.startup_wait >= 0:
        parser.error("--startup-wait must be >= 0")
    model = resolve_model_path(args.model)
    names = [served_model_name(model), *model_aliases(model), str(model)] + ([args.model] if args.model else [])
    return GatewayConfig(
        host=args.host,
        port=args.port,
        tokenizer_address=args.tokenizer_address,
        scheduler_address=args.scheduler_address,
        reply_address=args.reply_address,
        model=model,
        model_names=tuple(dict.fromkeys(names)),
        max_model_len=args.max_model_len or default_max_model_len(model),
        startup_wait=args.startup_wait,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        name=args.name,
        ready_address=args.ready_address,
        log_level=args.log_level,
    )
