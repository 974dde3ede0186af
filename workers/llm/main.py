"""`pagemesh worker --role prefill|decode|mixed`: one engine serving the mesh."""

from __future__ import annotations

import argparse

from pagemesh.common.cli_args import add
from pagemesh.common.cpu_threads import prepare_worker_threads
from pagemesh.common.logging import configure_logging
from pagemesh.common.messages import WorkerRole
from pagemesh.common.process import run_until_signalled
from pagemesh.workers.engine.config import add_engine_arguments, engine_config_from_args
from pagemesh.workers.llm.config import LLMWorkerConfig
from pagemesh.workers.shell.config import add_shell_arguments, shell_config_from_args


def parse(argv: list[str]) -> LLMWorkerConfig:
    parser = argparse.ArgumentParser(prog="pagemesh worker", description=__doc__)
    add(parser, "--role", "mixed", choices=[r.value for r in WorkerRole])
    add_shell_arguments(parser)
    add(parser, "--kv-address", None, help="decode role: bind address for incoming KV pages")
    add(parser, "--kv-advertise", None, help="address prefill workers use to reach --kv-address")
    add(parser, "--embeds-address", None, help="bind address for image rows from encoder workers (--encoder N)")
    add(parser, "--transfer-timeout", 30.0, type=float, help="seconds before an unacknowledged KV handoff is dropped")
    add(parser, "--threads", None, type=int, help="torch CPU threads (default: all cores)")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return LLMWorkerConfig(
            shell=shell_config_from_args(args, args.role),
            role=WorkerRole(args.role),
            engine=engine_config_from_args(args),
            kv_address=args.kv_address,
            kv_advertise=args.kv_advertise or args.kv_address,
            embeds_address=args.embeds_address,
            transfer_timeout=args.transfer_timeout,
            threads=args.threads,
        )
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str]) -> None:
    prepare_worker_threads()  # OpenMP's waits: before torch loads it (common/cpu_threads.py)
    import torch

    from pagemesh.workers.engine.engine import Engine
    from pagemesh.workers.engine.tensor_parallel import threads_per_rank
    from pagemesh.workers.llm.worker import LLMWorker
    from pagemesh.workers.shell.shell import WorkerShell
    from pagemesh.workers.shell.step_threads import step_threads_for

    config = parse(argv)
    configure_logging("worker", config.shell.worker_id)
    ranks = config.engine.tensor_parallel_size * config.engine.pipeline_parallel_size
    if config.threads or ranks > 1:  # tensor- and pipeline-parallel ranks share the worker's cores out
        torch.set_num_threads(threads_per_rank(ranks, config.threads))
    engine = Engine(config.engine)
    if engine.step_trace is not None:
        engine.step_trace.record_role(config.role.value)
    try:
        # PAGEMESH_THREAD_POLICY=adaptive: a single-rank worker only (the ranks of -tp/-pp wait for each other)
        threads = step_threads_for(engine.device) if ranks == 1 else None
        shell = WorkerShell(config.shell, lambda ctx: LLMWorker(config, engine, ctx, threads))
        try:
            run_until_signalled(shell.run(), drain=shell.drain)
        finally:
            shell.close()
    finally:
        engine.close()
