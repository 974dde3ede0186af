"""Command-line flags with `PAGEMESH_*` environment variables as defaults.

Every service builds its frozen config from its flags once, at start; a flag `--max-queue`
defaults to `$PAGEMESH_MAX_QUEUE` when that is set (what compose files use), else to the code's
default.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_name(flag: str) -> str:
    return "PAGEMESH_" + flag.lstrip("-").replace("-", "_").upper()


def add(
    parser: argparse.ArgumentParser, flag: str, default: Any = None, *, aliases: tuple[str, ...] = (), **kwargs
) -> None:
    """`parser.add_argument(flag, *aliases, ...)` whose default comes from the environment when
    set (the environment variable is named after `flag`)."""
    raw = os.environ.get(env_name(flag))
    kind = kwargs.get("type")
    if raw is not None:
        if kwargs.get("action") in ("store_true", argparse.BooleanOptionalAction):
            default = raw.lower() in ("1", "true", "yes", "on")
        else:
            default = kind(raw) if kind else raw
    help_text = kwargs.pop("help", "")
    kwargs["help"] = f"{help_text} [env {env_name(flag)}]".strip()
    parser.add_argument(flag, *aliases, default=default, **kwargs)


# every process's --drain-timeout (common/process.py drains; the flag is declared by each config,
# which must stay free of zmq: the scheduler's core imports its config)
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_HELP = "seconds a SIGTERM lets requests in flight finish before stopping (0: stop at once)"
