"""The in-process diffusion engine: requests batched at every denoising step (ORCA for diffusion),
with request-level and serial batching as baselines.

    engine = DiffusionEngine(pipeline, EngineConfig(batching="step"))
    engine.add(ImageJob(request_id="r1", params=params, arrival=time.monotonic()))
    while engine.has_work():
        for done in engine.step(): ...

    config.py   EngineConfig (no torch)          batcher.py  which requests share a forward (pure)
    samplers.py one diffusers scheduler a request jobs.py     ImageJob, FinishedJob, EngineFull
    engine.py   DiffusionEngine                  stats.py    running totals

The names load lazily (as `kernels/__init__.py` does), so `pagemesh.workers.diffusion.engine.batcher` and
`.config` import without torch.
"""

from importlib import import_module

_HOME = {
    "DiffusionEngine": "pagemesh.workers.diffusion.engine.engine",
    "EngineConfig": "pagemesh.workers.diffusion.engine.config",
    "ImageJob": "pagemesh.workers.diffusion.engine.jobs",
    "FinishedJob": "pagemesh.workers.diffusion.engine.jobs",
    "EngineFull": "pagemesh.workers.diffusion.engine.jobs",
    "InvalidImageRequest": "pagemesh.workers.diffusion.pipelines.base",
    "SAMPLERS": "pagemesh.workers.diffusion.engine.samplers",
    "DiffusionStats": "pagemesh.workers.diffusion.engine.stats",
}

__all__ = list(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(import_module(_HOME[name]), name)
    raise AttributeError(f"module 'pagemesh.workers.diffusion.engine' has no attribute {name!r}")
