"""What every worker process is configured with, whatever its kind."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

from pagemesh.common.cli_args import DEFAULT_DRAIN_TIMEOUT_S, DRAIN_TIMEOUT_HELP, add


@dataclass(frozen=True, kw_only=True)
class ShellConfig:
    worker_id: str
    scheduler_address: str
    ready_address: str | None = None
    heartbeat_interval: float = 0.25
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def add_shell_arguments(parser: argparse.ArgumentParser) -> None:
    add(parser, "--worker-id", None, help="unique name (default: role-host-pid)")
    add(parser, "--scheduler-address", "tcp://127.0.0.1:5557")
    add(parser, "--ready-address", None, help="launcher's address for the READY message")
    add(parser, "--heartbeat-interval", 0.25, type=float)
    add(parser, "--drain-timeout", DEFAULT_DRAIN_TIMEOUT_S, type=float, help=DRAIN_TIMEOUT_HELP)


def shell_config_from_args(args: argparse.Namespace, role: str) -> ShellConfig:
    return ShellConfig(
        worker_id=args.worker_id or default_worker_id(role),
        scheduler_address=args.scheduler_address,
        ready_address=args.ready_address,
        heartbeat_interval=args.heartbeat_interval,
        drain_timeout=args.drain_timeout,
    )
