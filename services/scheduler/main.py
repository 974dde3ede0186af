"""`pagemesh scheduler`: the registry and placement service."""

from __future__ import annotations

import argparse

from common.cli_args import add
from common.logging import configure_logging
from common.process import run_until_signalled
from services.scheduler.config import SchedulerConfig
from services.scheduler.placement import PLACEMENTS, PlacementPolicy
from services.scheduler.service import SchedulerService


def parse(argv: list[str]) -> SchedulerConfig:
    parser = argparse.ArgumentParser(prog="pagemesh scheduler", description=__doc__)
    add(parser, "--address", "tcp://127.0.0.1:5557", help="Router bind address")
    add(parser, "--ready-address", None)
    add(parser, "--heartbeat-timeout", 5.0, type=float, help="seconds of silence before a worker is dropped")
    add(parser, "--max-queue", 256, type=int, help="queued requests before 503")
    add(parser, "--placement", "prefix", choices=PLACEMENTS, help="how to pick workers (see placement.py)")
    add(parser, "--prefix-weight", 1.0, type=float, help="prefix placement: weight of the cached share of the prompt")
    add(parser, "--load-weight", 4.0, type=float, help="prefix placement: weight of running / max running")
    args = parser.parse_args(argv)
    try:
        policy = PlacementPolicy(args.placement, args.prefix_weight, args.load_weight)
    except ValueError as e:
        parser.error(str(e))
    return SchedulerConfig(args.address, args.ready_address, args.heartbeat_timeout, args.max_queue, policy)


def main(argv: list[str]) -> None:
    config = parse(argv)
    configure_logging("scheduler", "scheduler")
    service = SchedulerService(config)
    try:
        run_until_signalled(service.run())
    finally:
        service.close()
