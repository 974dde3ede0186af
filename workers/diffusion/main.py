"""`pagemesh diffusion`: one diffusion worker serving the mesh (images, batched per denoising step)."""

from __future__ import annotations

from pagemesh.common.cpu_threads import prepare_worker_threads
from pagemesh.common.logging import configure_logging
from pagemesh.common.process import run_until_signalled
from pagemesh.workers.diffusion.config import DiffusionWorkerConfig, parse_diffusion


def resolve_device(config: DiffusionWorkerConfig):
    """(device, dtype) from the flags: auto = CUDA when there is one, bf16 there and fp32 on CPU."""
    import torch

    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("pagemesh diffusion: --diffusion-device cuda, but torch sees no CUDA device")
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, config.dtype)
    return device, dtype


def build_engine(config: DiffusionWorkerConfig):
    from pagemesh.workers.diffusion.engine import DiffusionEngine, EngineConfig
    from pagemesh.workers.diffusion.pipelines.loader import load_pipeline

    device, dtype = resolve_device(config)
    pipeline = load_pipeline(config.model, name=config.served_model_name, device=device, dtype=dtype)
    return DiffusionEngine(
        pipeline,
        EngineConfig(
            batching=config.batching,
            max_running=config.max_running,
            max_batch_rows=config.max_batch_rows,
            max_waiting=config.max_waiting,
            request_wait_s=config.request_wait,
            cache=config.cache,
            cache_budget_bytes=int(config.cache_budget_mb * 2**20),
        ),
    )


def main(argv: list[str]) -> None:
    prepare_worker_threads()  # OpenMP's waits: before torch loads it (common/cpu_threads.py)
    import torch

    from pagemesh.workers.diffusion.worker import DiffusionWorker
    from pagemesh.workers.shell.shell import WorkerShell
    from pagemesh.workers.shell.step_threads import step_threads_for

    config = parse_diffusion(argv)
    configure_logging("diffusion", config.shell.worker_id)
    if config.threads:
        torch.set_num_threads(config.threads)
    engine = build_engine(config)
    threads = step_threads_for(engine.pipeline.device)
    shell = WorkerShell(config.shell, lambda ctx: DiffusionWorker(engine, ctx, threads))
    try:
        run_until_signalled(shell.run(), drain=shell.drain)
    finally:
        shell.close()
