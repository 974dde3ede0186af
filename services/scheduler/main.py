"""`pagemesh scheduler`: the registry and placement service."""

from __future__ import annotations

import argparse

from pagemesh.common.cli_args import add
from pagemesh.common.logging import configure_logging
from pagemesh.common.process import run_until_signalled
from pagemesh.services.scheduler.config import (
    SchedulerConfig,
    add_lora_modules_argument,
    add_policy_arguments,
    add_serves_argument,
    config_from_args,
)
from pagemesh.services.scheduler.service import SchedulerService


def parse(argv: list[str]) -> SchedulerConfig:
    parser = argparse.ArgumentParser(prog="pagemesh scheduler", description=__doc__)
    add(parser, "--address", "tcp://127.0.0.1:5557", help="Router bind address")
    add(parser, "--ready-address", None)
    add_policy_arguments(parser)
    add_serves_argument(parser)
    add_lora_modules_argument(parser)
    return config_from_args(parser.parse_args(argv), parser)


def main(argv: list[str]) -> None:
    config = parse(argv)
    configure_logging("scheduler", "scheduler")
    service = SchedulerService(config)
    try:
        run_until_signalled(service.run(), drain=service.drain)
    finally:
        service.close()
