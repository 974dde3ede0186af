"""DeepCache against simply running fewer denoising steps, on the embedded class-conditional digits
U-Net (digits-unet), through the diffusion engine: diffusion-cache's seeds, guidance and
fewer-steps twins with the one cache a U-Net serves, interval:N (each request keeps its own deep
feature and each row decides per step: engine/deep_cache.py). No load section (diffusion-batching
covers load).

Speed: the fraction of U-Net block evaluations against the full uncached run (one row through one
down, mid or up block is one evaluation; CFG rows count), and wall time per image, batched and
alone. Fidelity: PSNR and SSIM of each image against the uncached image of the same seed and
noise; class accuracy of the project's digit classifier and the Fréchet distance (FD) in its
feature space to the 300 held-out real digits. Fewer steps are run at the step count that costs
the same block fraction as each cache setting (equal compute), so each cache row has its
fewer-steps twin.
"""

from __future__ import annotations

from pagemesh.bench.experiments.diffusion_cache import run_on

MODEL = "digits-unet"
# sampler -> (full steps, policies, images per digit): under 2 minutes on one thread of this
# machine's shared CPU (the report header records the wall time)
SWEEPS = {
    "dpmsolver++": (25, ["interval:2", "interval:3", "interval:4", "interval:5"], 40),
    "ddim": (50, ["interval:2", "interval:3", "interval:5"], 20),
}
QUICK_SWEEPS = {"dpmsolver++": (10, ["interval:2", "interval:3"], 1)}


def load_unet():
    """digits-unet with its DeepCache split (set here if the pipeline does not set it itself)."""
    from pagemesh.workers.diffusion.pipelines.loader import load_pipeline
    from pagemesh.workers.diffusion.pipelines.unet import unet_deep_cache

    pipeline = load_pipeline(MODEL)
    if getattr(pipeline, "deep_cache_forward", None) is None:
        pipeline.deep_cache_forward = unet_deep_cache(pipeline.unet)
        print(f"  {MODEL}: the pipeline has no deep_cache_forward; set from unet_deep_cache", flush=True)
    if pipeline.deep_cache_forward is None:
        raise ValueError(f"{MODEL}: its U-Net has no DeepCache split")
    return pipeline


def warm_up(pipeline) -> None:
    """One small batch through the whole forward and through the DeepCache split, so that the
    first timed run (the reference) does not pay the first calls' costs."""
    from pagemesh.bench.experiments.diffusion_cache import generate

    for cache in ("none", "interval:2"):
        generate(pipeline, "dpmsolver++", 5, cache, 1, seed=0)


def path_note(pipeline, per_class: int, reps: int) -> str:
    """interval:1 (DeepCache's split computing every step: the uncached images) against the
    uncached forward, alone and batched: what the split's own path costs or saves, apart from
    any caching."""
    from pagemesh.bench.experiments.diffusion_cache import generate, time_alone

    steps = SWEEPS["dpmsolver++"][0]
    alone = {cache: time_alone(pipeline, "dpmsolver++", steps, cache, reps) for cache in ("none", "interval:1")}
    batched = {
        cache: generate(pipeline, "dpmsolver++", steps, cache, per_class, seed=0).seconds / (10 * per_class) * 1e3
        for cache in ("none", "interval:1")
    }
    return (
        f"- **The split's own path.** interval:1 (the DeepCache split computing every step, so the uncached "
        f"images) ran one image alone (dpmsolver++ {steps} steps) in {alone['interval:1']:.0f} ms against the "
        f"uncached forward's {alone['none']:.0f} ms (medians of {reps}, "
        f"{alone['interval:1'] / alone['none'] - 1:+.0%}), and {batched['interval:1']:.1f} against "
        f"{batched['none']:.1f} ms per image batched ({10 * per_class} images, "
        f"{batched['interval:1'] / batched['none'] - 1:+.0%}): the split calls the U-Net's blocks itself "
        "(pipelines/unet.py), not through diffusers' UNet2DModel.forward, so every interval row's time includes "
        "that difference beside what its cache skips."
    )


def run(ctx):
    pipeline = load_unet()
    warm_up(pipeline)
    report = run_on(ctx, pipeline, QUICK_SWEEPS if ctx.quick else SWEEPS, with_load=False)
    if not ctx.quick:
        report.text(path_note(pipeline, SWEEPS["dpmsolver++"][2], reps=5))
    return report
