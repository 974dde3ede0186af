"""`pagemesh scheduler`: the registry and placement service."""

from __future__ import annotations

import argparse

from common.cli_args import add
from common.logging import configure_logging
from common.process import run_until_signalled
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService


def parse(argv: list[str]) -> SchedulerConfig:
    parser = argparse.ArgumentParser(prog="pagemesh scheduler", description=__doc__)
    add(parser, "--address", "tcp://127.0.0.1:5557", help="Router bind address")
    add(parser, "--ready-address", None)
    add(parser, "--heartbeat-timeout", 3.0, type=float, help="seconds of silence before a worker is dropped")
    add(parser, "--max-queue", 256, type=int, help="queued requests before 503")
    args = parser.parse_args(argv)
    return SchedulerConfig(args.address, args.ready_address, args.heartbeat_timeout, args.max_queue)


def main(argv: list[str]) -> None:
    config = parse(argv)
    configure_logging("scheduler", "scheduler")
    service = SchedulerService(config)
    try:
        run_until_signalled(service.run())
    finally:
        service.close()
