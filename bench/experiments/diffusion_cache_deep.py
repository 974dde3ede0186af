"""diffusion-cache's sweeps on a deeper variant of the digits DiT: 12 thinner blocks instead of 4,
so that the block interval and First-Block-Cache always pay (block 0) is a twelfth of the stack,
not a quarter. Same seeds, policies and step twins as diffusion-cache; no load section (the
batching experiment covers load).

The variant ships as an experiment asset, trained by the embedded model's own script:

    python -m pagemesh.workers.diffusion.training.train_digits --out bench/experiments/assets/digits-dit-deep \\
        --layers 12 --head-dim 12 --steps 2500

(its pagemesh.json's "trained" records the run). It is not served by `pagemesh up` by name; any
worker can serve it with `--diffusion-model bench/experiments/assets/digits-dit-deep`.
"""

from __future__ import annotations

from pathlib import Path

from pagemesh.bench.experiments.diffusion_cache import QUICK_SWEEPS, SWEEPS, run_on

DEEP_PATH = Path(__file__).resolve().parent / "assets" / "digits-dit-deep"
DEEP_NAME = "digits-dit-deep"


def run(ctx):
    from pagemesh.workers.diffusion.pipelines.dit import DiTPipelineModel

    pipeline = DiTPipelineModel.from_folder(DEEP_PATH, name=DEEP_NAME)
    return run_on(ctx, pipeline, QUICK_SWEEPS if ctx.quick else SWEEPS, with_load=False)
