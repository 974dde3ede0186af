"""The gateway's configuration, built once from flags (and PAGEMESH_* variables)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from pagemesh.common import cli_args
from pagemesh.common.cli_args import DEFAULT_DRAIN_TIMEOUT_S, DRAIN_TIMEOUT_HELP
from pagemesh.common.model_config import DEFAULT_MAX_MODEL_LEN_CAP, default_max_model_len
from pagemesh.common.model_files import model_aliases, resolve_model_path, served_model_name
from pagemesh.gateway.auth import key_problem, read_key_file
from pagemesh.gateway.media import MediaPolicy, add_media_arguments, media_policy
from pagemesh.gateway.reasoning import REASONING_PARSERS
from pagemesh.gateway.tool_calls import TOOL_CALL_PARSERS

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_HEADER_BYTES = 8190  # aiohttp's own default for a header line and the request line


@dataclass(frozen=True)
class GatewayConfig:
    """host/port: the HTTP listener. tokenizer_address and scheduler_address: Routers this
    gateway's Dealers connect to; reply_address: its Pull bind, where text and errors come back.
    model_names: the names a request's `model` may use (served name first, then its aliases and
    the path; or the --served-model-name names alone). max_model_len: the context length
    /v1/models reports (the tokenizer enforces it).
    api_keys: the keys `/v1/*` accepts (none: open); the per-key limits are None when off.
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
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never in a log line
    metrics_require_key: bool = False
    max_concurrent_requests_per_key: int | None = None
    max_tokens_per_minute_per_key: int | None = None
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_model_len: int = DEFAULT_MAX_MODEL_LEN_CAP
    startup_wait: float = 0.0
    enable_auto_tool_choice: bool = False  # tool_choice "auto" is served (needs tool_call_parser)
    tool_call_parser: str | None = None  # gateway/tool_calls: how calls are found in a chat answer
    reasoning_parser: str | None = None  # gateway/reasoning.py: how thinking is split from content
    enable_lora: bool = False  # a request's `model` may name a LoRA adapter; the load/unload routes (gateway/lora.py)
    media: MediaPolicy = MediaPolicy()  # images in chat messages: limits, local files (gateway/media.py)

    @property
    def served_model(self) -> str:
        return self.model_names[0]

    @property
    def tokenizer_addresses(self) -> list[str]:
        """One address per tokenizer replica (--tokenizer-address is comma-separated)."""
        return [address.strip() for address in self.tokenizer_address.split(",") if address.strip()]


def parse_args(argv: list[str]) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="pagemesh gateway", description="OpenAI-compatible HTTP gateway")
    cli_args.add(parser, "--host", "127.0.0.1", help="HTTP listen host")
    cli_args.add(parser, "--port", 8000, type=int, help="HTTP listen port (0: any free port)")
    cli_args.add(
        parser,
        "--tokenizer-address",
        help="tokenizer Router address; several replicas: their addresses, comma-separated (a stream whose "
        "tokenizer is lost goes on through another)",
    )
    cli_args.add(parser, "--scheduler-address", help="scheduler Router address (aborts, status)")
    cli_args.add(parser, "--reply-address", help="Pull bind address for replies from tokenizers")
    cli_args.add(parser, "--model", None, help="GGUF file or HF folder (default: the embedded model)")
    cli_args.add(
        parser,
        "--served-model-name",
        None,
        nargs="+",
        metavar="NAME",
        help="the ids the model is served under, as vLLM: the first is reported, every one is accepted in a "
        "request's `model` (default: the model's own id, its aliases and its path)",
    )
    cli_args.add(parser, "--max-model-len", None, type=int, help="context length (default: the model's, capped)")
    cli_args.add(
        parser,
        "--enable-lora",
        False,
        action="store_true",
        help="LoRA adapters are served: a request's `model` may name one, POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter load and unload them on every LLM worker",
    )
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
    cli_args.add(parser, "--drain-timeout", DEFAULT_DRAIN_TIMEOUT_S, type=float, help=DRAIN_TIMEOUT_HELP)
    add_auth_arguments(parser)
    add_chat_output_arguments(parser)
    add_media_arguments(parser)
    cli_args.add(
        parser,
        "--max-header-bytes",
        DEFAULT_MAX_HEADER_BYTES,
        type=int,
        help="longest request line or header line; longer gets 431",
    )
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
    if args.max_header_bytes < 1024:
        parser.error("--max-header-bytes must be at least 1024")
    api_keys = api_keys_from_args(parser, args)
    check_chat_output_arguments(parser, args)
    if not args.startup_wait >= 0:
        parser.error("--startup-wait must be >= 0")
    model = resolve_model_path(args.model)
    names = accepted_model_names(model, args.model, args.served_model_name)
    return GatewayConfig(
        host=args.host,
        port=args.port,
        tokenizer_address=args.tokenizer_address,
        scheduler_address=args.scheduler_address,
        reply_address=args.reply_address,
        model=model,
        model_names=names,
        max_model_len=args.max_model_len or default_max_model_len(model),
        startup_wait=args.startup_wait,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        name=args.name,
        ready_address=args.ready_address,
        log_level=args.log_level,
        drain_timeout=args.drain_timeout,
        api_keys=api_keys,
        metrics_require_key=args.metrics_require_key,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        max_tokens_per_minute_per_key=args.max_tokens_per_minute_per_key,
        max_header_bytes=args.max_header_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_lora=args.enable_lora,
        media=media_policy(parser, args),
    )


def accepted_model_names(model: Path, model_arg: str | None, served: str | list[str] | None) -> tuple[str, ...]:
    """The names a request's `model` may use, the reported one first: the --served-model-name
    names when given (a list, or $PAGEMESH_SERVED_MODEL_NAME's space-separated names), as vLLM
    serves them, only those; else the model's own id, its aliases, its path and --model as given."""
    given = served.split() if isinstance(served, str) else served or []
    names = given or [served_model_name(model), *model_aliases(model), str(model)] + ([model_arg] if model_arg else [])
    return tuple(dict.fromkeys(names))


def add_chat_output_arguments(parser: argparse.ArgumentParser) -> None:
    """How chat answers are read, in vLLM's spellings (`pagemesh gateway` and `pagemesh up`)."""
    cli_args.add(
        parser,
        "--enable-auto-tool-choice",
        False,
        action="store_true",
        help='serve tool_choice "auto": the model may call tools, --tool-call-parser finds the calls',
    )
    cli_args.add(
        parser,
        "--tool-call-parser",
        None,
        choices=sorted(TOOL_CALL_PARSERS),
        help="how tool calls are written in the model's answers (with --enable-auto-tool-choice)",
    )
    cli_args.add(
        parser,
        "--reasoning-parser",
        None,
        choices=REASONING_PARSERS,
        help="split the answer's <think>...</think> into reasoning_content",
    )


def check_chat_output_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")


def chat_output_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The gateway's flags for what `pagemesh up` was given."""
    argv = ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    for flag in ("tool_call_parser", "reasoning_parser"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    return argv


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of API keys and per-key limits (`pagemesh gateway` and `pagemesh up`)."""
    # repeatable, so not through cli_args.add: $PAGEMESH_API_KEY (one key) is read when no key flag is given
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="an API key /v1/* accepts as `Authorization: Bearer KEY` (repeatable; prefer --api-key-file: "
        "a flag shows in the process list) [env PAGEMESH_API_KEY]",
    )
    cli_args.add(parser, "--api-key-file", None, help="file of API keys, one per line")
    cli_args.add(
        parser,
        "--metrics-require-key",
        False,
        action="store_true",
        help="/metrics, /status and the status page need an API key too (default: open, for scrapers and "
        "browsers that send none)",
    )
    cli_args.add(
        parser, "--max-concurrent-requests-per-key", None, type=int, help="requests in flight per key (429 over it)"
    )
    cli_args.add(
        parser,
        "--max-tokens-per-minute-per-key",
        None,
        type=int,
        help="prompt + completion tokens per minute per key (429 over it)",
    )


def api_keys_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    """The keys the flags give (checked; errors through `parser.error`), also checking the limits."""
    keys = list(args.api_key or [])
    if not keys and not args.api_key_file and os.environ.get("PAGEMESH_API_KEY"):  # the default of both flags
        keys.append(os.environ["PAGEMESH_API_KEY"].strip())
    if args.api_key_file:
        try:
            keys += read_key_file(args.api_key_file)
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"--api-key-file: cannot read {args.api_key_file}: {e}")
        if not keys:
            parser.error(f"--api-key-file: {args.api_key_file} holds no keys")
    for key in keys:
        if problem := key_problem(key):
            parser.error(f"--api-key: {problem}")
    for flag in ("max_concurrent_requests_per_key", "max_tokens_per_minute_per_key"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.metrics_require_key and not keys:
        parser.error("--metrics-require-key needs API keys (--api-key or --api-key-file)")
    return tuple(dict.fromkeys(keys))


def auth_args_to_argv(args: argparse.Namespace, keys: tuple[str, ...], key_file: Path) -> list[str]:
    """The gateway's flags for what `pagemesh up` was given: the keys go through `key_file`
    (written here, readable by its owner only), never on a command line others can list."""
    argv = []
    if keys:
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(f"{key}\n" for key in keys))
        argv += ["--api-key-file", str(key_file)]
    if args.metrics_require_key:
        argv.append("--metrics-require-key")
    for flag in ("max_concurrent_requests_per_key", "max_tokens_per_minute_per_key"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv
