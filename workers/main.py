"""`pagemesh worker --role prefill|decode|mixed`: one engine serving the mesh."""

from __future__ import annotations

import argparse

import torch

from common.cli_args import add
from common.logging import configure_logging
from common.process import run_until_signalled
from workers.config import WorkerConfig, default_worker_id
from workers.engine.config import add_engine_arguments, engine_config_from_args
from workers.engine.engine import Engine
from workers.service import WorkerService


def parse(argv: list[str]) -> WorkerConfig:
    parser = argparse.ArgumentParser(prog="pagemesh worker", description=__doc__)
    add(parser, "--role", "mixed", choices=["prefill", "decode", "mixed"])
    add(parser, "--worker-id", None, help="unique name (default: role-host-pid)")
    add(parser, "--scheduler-address", "tcp://127.0.0.1:5557")
    add(parser, "--kv-address", None, help="decode role: bind address for incoming KV pages")
    add(parser, "--kv-advertise", None, help="address prefill workers use to reach --kv-address")
    add(parser, "--ready-address", None, help="launcher's address for the READY message")
    add(parser, "--heartbeat-interval", 0.25, type=float)
    add(parser, "--transfer-timeout", 30.0, type=float, help="seconds before an unacknowledged KV handoff is dropped")
    add(parser, "--threads", None, type=int, help="torch CPU threads (default: all cores)")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    return WorkerConfig(
        role=args.role,
        worker_id=args.worker_id or default_worker_id(args.role),
        scheduler_address=args.scheduler_address,
        kv_address=args.kv_address,
        kv_advertise=args.kv_advertise or args.kv_address,
        ready_address=args.ready_address,
        engine=engine_config_from_args(args),
        heartbeat_interval=args.heartbeat_interval,
        transfer_timeout=args.transfer_timeout,
        threads=args.threads,
    )


def main(argv: list[str]) -> None:
    config = parse(argv)
    configure_logging("worker", config.worker_id)
    if config.threads:
        torch.set_num_threads(config.threads)
    engine = Engine(config.engine)
    service = WorkerService(config, engine)
    try:
        run_until_signalled(service.run())
    finally:
        service.close()
