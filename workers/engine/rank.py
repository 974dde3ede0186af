"""A follower rank of a tensor- or pipeline-parallel worker (rank 1 .. N×M-1), started by rank 0
(`pagemesh.workers.engine.tensor_parallel.FollowerRanks`), never by hand.

    load this rank's shard → join the group → loop: read a step from stdin → run it
                                               (or a KV page command: gather / scatter pages)
It exits when its stdin ends (rank 0 closed it or died) or its parent changes; a collective
that fails (another rank gone mid-step) raises, and it exits with an error.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

PARENT_POLL_S = 0.5


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagemesh.workers.engine.rank", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True, help="tensor-parallel ranks of each stage")
    parser.add_argument("--pipeline-size", type=int, default=1, help="pipeline stages")
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--device", required=True, choices=["cpu", "cuda"])
    parser.add_argument("--num-pages", type=int, required=True)
    parser.add_argument("--page-size", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--shm-path", default=None, help="the shared-memory all-reduce's file")
    parser.add_argument("--shm-numel", type=int, default=0)
    parser.add_argument("--quantization", default="none", help="as the worker's --quantization")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the worker's --kv-cache-dtype")
    parser.add_argument("--batch-invariant", action="store_true", help="as the worker's --batch-invariant")
    parser.add_argument("--enable-expert-parallel", action="store_true", help="as the worker's flag")
    parser.add_argument("--kv-calibration-ids", default="", help="an fp8 pool's calibration tokens, comma-separated")
    parser.add_argument("--lora", default=None, help="LoRA slots: max_loras,max_rank,max_cpu_loras (rank 0's)")
    return parser.parse_args(argv)


def _exit_when_orphaned(parent: int) -> None:
    """Rank 0 killed outright leaves no one to close our stdin on some paths (a grandchild
    holding it): its pid going away is the other sign."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def main(argv: list[str]) -> None:
    args = parse(argv)
    # Ctrl-C reaches the whole process group: rank 0 shuts down and closes our pipe, which is
    # our signal to leave; a follower that died of the SIGINT first would look like a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    from pagemesh.common.cpu_threads import prepare_worker_threads

    prepare_worker_threads()  # as rank 0's (which passed it on already, unless started otherwise)
    import torch

    from pagemesh.common.model_config import read_model_config
    from pagemesh.workers.engine.backend import select_backend
    from pagemesh.workers.engine.kv_quant import kv_storage_dtype
    from pagemesh.workers.engine.kv_relay import decode_kv_command, follow_kv_command, is_kv_command
    from pagemesh.workers.engine.model_input import decode_model_input
    from pagemesh.workers.engine.model_runner import ModelRunner
    from pagemesh.workers.engine.pipeline_parallel import StagePipe, join_stage_groups, stage_group, stage_layers
    from pagemesh.workers.engine.tensor_parallel import (
        COLLECTIVE_TIMEOUT_S,
        follower_step,
        init_group,
        rank_context,
        read_frame,
    )
    from pagemesh.workers.model.loader import load_model

    try:  # the worker's JSON lines; a GPU machine without structlog gets plain stdlib logging
        from pagemesh.common.logging import configure_logging

        configure_logging("worker-rank", f"rank{args.rank}")
    except ImportError:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger(f"pagemesh.rank{args.rank}")
    torch.set_num_threads(args.threads)
    # on CUDA this rank sees one GPU, its own: rank 0 named it in CUDA_VISIBLE_DEVICES (common/gpus.py)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    dtype = getattr(torch, args.dtype)
    stage, tp_rank = divmod(args.rank, args.world_size)
    cfg = read_model_config(Path(args.model))
    pipe, group, layers = None, None, None
    if args.pipeline_size > 1:
        pipe = StagePipe(args.rank, args.world_size, args.pipeline_size, cfg, dtype, device, COLLECTIVE_TIMEOUT_S)
        group = stage_group(stage, args.world_size) if args.world_size > 1 else None
        layers = stage_layers(cfg.num_layers, args.pipeline_size, stage)
    tp = rank_context(
        tp_rank, args.world_size, args.shm_path, args.shm_numel, dtype, group, args.enable_expert_parallel
    )
    model = load_model(Path(args.model), dtype, device, tp, layers, args.quantization)
    world = args.world_size * args.pipeline_size
    init_group(args.rank, world, args.init_method, args.device)
    join_stage_groups(args.rank, args.world_size, args.pipeline_size, group)
    # after the group is up: an fp8 pool's calibration pass is a forward of every rank together
    # (its all-reduces, its stage-to-stage activations), as rank 0 makes its runner now
    runner = ModelRunner(
        model,
        args.num_pages,
        args.page_size,
        device,
        cuda_graphs=False,
        backend=select_backend(device, dtype, args.batch_invariant),
        pipe=pipe,
        kv_dtype=kv_storage_dtype(args.kv_cache_dtype, dtype),
        kv_calibration_ids=[int(t) for t in args.kv_calibration_ids.split(",") if t],
        lora=tuple(int(x) for x in args.lora.split(",")) if args.lora else None,
    )
    computes_logits = pipe is not None and pipe.sends_logits
    log.info(
        "rank %d of %d ready: stage %d (layers %s), tp rank %d (pid %d)",
        args.rank,
        world,
        stage,
        model.layer_range,
        tp_rank,
        os.getpid(),
    )
    stdin = sys.stdin.buffer
    steps = 0
    while (frame := read_frame(stdin)) is not None:
        if is_kv_command(frame):  # a KV handoff's pages, in or out (workers/engine/kv_relay.py)
            follow_kv_command(decode_kv_command(frame), runner.kv_cache)
            continue
        runner.execute(follower_step(decode_model_input(frame), computes_logits))
        steps += 1
    log.info("rank %d done after %d steps", args.rank, steps)
    # Leave without tearing the process group down: gloo's teardown can wait on peers that are
    # leaving too, and this rank holds nothing that needs a clean close.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
