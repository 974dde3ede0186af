"""Scheduler process configuration and its command-line flags (declared once: `pagemesh up`
passes the same flags on to the scheduler it starts)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagemesh.common.cli_args import DEFAULT_DRAIN_TIMEOUT_S, DRAIN_TIMEOUT_HELP, add
from pagemesh.common.lora import lora_modules
from pagemesh.common.messages import WorkerKind
from pagemesh.services.scheduler.placement import PLACEMENTS, PlacementPolicy


@dataclass(frozen=True)
class SchedulerConfig:
    address: str  # Router bind: tokenizers, gateways and workers connect here
    ready_address: str | None = None
    heartbeat_timeout: float = 5.0  # a worker silent this long leaves placement
    step_timeout: float = 300.0  # a worker inside one step this long (it heartbeats) is hung
    max_queue: int = 256  # requests waiting for a worker; more are refused with 503
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    placement: PlacementPolicy = PlacementPolicy()
    max_migrations: int = 3  # times one request moves to another worker after losing its own
    # after a worker is lost, requests no live worker can serve wait this long for one to come
    # back (a supervisor's or compose's restart) before they are refused; 0: refused at once
    worker_return_wait: float = 30.0
    # the kinds the mesh serves: it is ready when each can take a request. Empty: the kinds of the
    # workers registered so far (an LLM mesh's, or a diffusion-only mesh's)
    serves: tuple[WorkerKind, ...] = ()
    lora_modules: tuple[tuple[str, str], ...] = ()  # the LoRA adapters the mesh starts with (name, folder)


# the policy flags, as `add_policy_arguments` declares them (dest names)
POLICY_FLAGS = (
    "heartbeat_timeout",
    "step_timeout",
    "drain_timeout",
    "max_queue",
    "placement",
    "prefix_weight",
    "load_weight",
    "max_migrations",
    "worker_return_wait",
)


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """The scheduler's policy flags (everything but its addresses)."""
    add(parser, "--heartbeat-timeout", 5.0, type=float, help="seconds of silence before a worker is dropped")
    add(
        parser,
        "--step-timeout",
        300.0,
        type=float,
        help="seconds a worker may spend in one step (it heartbeats meanwhile) before it counts as hung and is dropped",
    )
    add(parser, "--drain-timeout", DEFAULT_DRAIN_TIMEOUT_S, type=float, help=DRAIN_TIMEOUT_HELP)
    add(parser, "--max-queue", 256, type=int, help="queued requests before 503")
    add(parser, "--placement", "prefix", choices=PLACEMENTS, help="how to pick workers (see placement.py)")
    add(parser, "--prefix-weight", 1.0, type=float, help="prefix placement: weight of the cached share of the prompt")
    add(parser, "--load-weight", 4.0, type=float, help="prefix placement: weight of running / max running")
    add(
        parser,
        "--max-migrations",
        3,
        type=int,
        help="times a request moves to another worker when its worker dies (an image or a transcription starts "
        "over there; 0: it fails instead)",
    )
    add(
        parser,
        "--worker-return-wait",
        30.0,
        type=float,
        help="seconds after a worker is lost during which requests that no live worker can serve wait in the "
        "queue for one to come back (restarted), instead of a 503 at once (0: at once)",
    )


def policy_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The policy flags of `args`, as a command line for a scheduler process."""
    argv: list[str] = []
    for name in POLICY_FLAGS:
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv


def add_serves_argument(parser: argparse.ArgumentParser) -> None:
    add(
        parser,
        "--serves",
        "",
        help="comma-separated kinds the mesh serves (llm, diffusion, audio): /ready waits until each has a usable "
        "pool. Default: the kinds of the workers registered so far",
    )


def parse_serves(text: str) -> tuple[WorkerKind, ...]:
    """`llm,diffusion` -> the kinds; an unknown one raises ValueError naming the known ones."""
    known = {k.value: k for k in WorkerKind}
    kinds = []
    for name in filter(None, (part.strip() for part in text.split(","))):
        if name not in known:
            raise ValueError(f"--serves: unknown kind {name!r} (known: {', '.join(sorted(known))})")
        kinds.append(known[name])
    return tuple(dict.fromkeys(kinds))


def add_lora_modules_argument(parser: argparse.ArgumentParser) -> None:
    add(
        parser,
        "--lora-modules",
        None,
        nargs="+",
        metavar="NAME=PATH",
        help="the LoRA adapters the mesh starts with, as the workers' flag (the scheduler loads them on every "
        "LLM worker that lacks one)",
    )


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SchedulerConfig:
    try:
        policy = PlacementPolicy(args.placement, args.prefix_weight, args.load_weight)
        serves = parse_serves(getattr(args, "serves", ""))
        loras = lora_modules(getattr(args, "lora_modules", None))
    except ValueError as e:
        parser.error(str(e))
    if args.max_migrations < 0:
        parser.error("--max-migrations: must be >= 0")
    if not args.worker_return_wait >= 0:
        parser.error("--worker-return-wait: must be >= 0")
    return SchedulerConfig(
        address=args.address,
        ready_address=args.ready_address,
        heartbeat_timeout=args.heartbeat_timeout,
        step_timeout=args.step_timeout,
        max_queue=args.max_queue,
        drain_timeout=args.drain_timeout,
        placement=policy,
        max_migrations=args.max_migrations,
        worker_return_wait=args.worker_return_wait,
        serves=serves,
        lora_modules=loras,
    )
