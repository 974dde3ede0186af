"""Fits TeaCache's rescaling polynomial for a model and writes it into the model folder's pagemesh.json.

    python -m pagemesh.workers.diffusion.training.fit_teacache --model digits-dit
    python -m pagemesh.workers.diffusion.training.fit_teacache --folder DIR [--trajectories 320] [--steps 25,50]

TeaCache (Liu et al. 2024) skips the whole transformer at a step when the change it accumulates
since the last computed step is small. What it can observe before running any block is the first
block's timestep-modulated input; what matters is the model output. The two move differently
(and by model), so the input's relative L1 change x is mapped through a polynomial p fitted per
model to estimate the output's relative L1 change y, and the threshold is set in units of y.

This runs the model uncached (its block-level forward, which is `denoise` bit for bit) over
`trajectories` images: every prompt the model knows (a DiT: one per class), seeded noise, each
sampler x step count x guidance scale in turn. Every row (cond and uncond rows alike: each decides
on its own in the engine) gives, at each step where a cache policy may skip (past the warm-up,
before the cool-down: cache_policy.in_full_window), the pair

    x = relative L1 change of the modulated input from the previous step
    y = relative L1 change of the model output from the previous step

measured as engine/feature_cache.py measures its signals. y ~ p(x) is fitted by least squares
(numpy.polyfit, degree 4 as TeaCache), and its R² reported: over all pairs, and fitted on the
even-numbered images and judged on the odd ones (held out); beside the R² of the raw change
(p(x) = x, what an unfitted model accumulates).

writes, into DIR/pagemesh.json (every other key as it was):

    "teacache_coefficients": [c4, c3, c2, c1, c0]    highest degree first, as numpy.polyfit
    "teacache_fit": {what it was fitted on: samplers, steps, guidance, trajectories, pairs,
                     x range, R², seed, seconds, threads, torch}

cache_policy.rescaled applies it: the teacache decision accumulates max(p(x), 0). Seeded: the
same command gives the same coefficients on the same torch build.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagemesh.common.messages import ImageParams
from pagemesh.workers.diffusion.engine.cache_policy import in_full_window
from pagemesh.workers.diffusion.engine.engine import guide
from pagemesh.workers.diffusion.engine.feature_cache import relative_l1
from pagemesh.workers.diffusion.engine.samplers import RequestSampler
from pagemesh.workers.diffusion.pipelines.common import SERVING_FILE
from pagemesh.workers.diffusion.pipelines.embedded import EMBEDDED_MODELS

# Prompts for a text-conditioned model (a class-conditional DiT uses its own labels instead).
CAPTIONS = (
    "a cat sitting on a red mat",
    "a photograph of a mountain lake at sunrise",
    "an oil painting of a ship in a storm",
    "a bowl of fruit on a wooden table",
    "a city street at night, neon lights, rain",
    "a portrait of an old man with a beard",
    "a watercolor of a fox in the snow",
    "a bright red sports car in the desert",
)


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    trajectories: int = 320  # images, spread evenly over the sampler x steps x guidance groups
    samplers: tuple[str, ...] = ("dpmsolver++", "ddim")
    steps: tuple[int, ...] = (25, 50)
    guidance: tuple[float, ...] = (1.5, 4.0)
    degree: int = 4
    batch_images: int = 64  # images per forward (2 rows each with guidance)
    seed: int = 0


@dataclass
class Pairs:
    """The (x, y) pairs, each with the image it came from."""

    x: list[float]
    y: list[float]
    image: list[int]


def prompts_of(pipeline) -> list[str]:
    """One prompt per class of a class-conditional DiT (its first label), else `CAPTIONS`."""
    labels = getattr(pipeline, "labels", None)
    if labels is None:
        return list(CAPTIONS)
    first: dict[int, str] = {}
    for label, class_id in labels.by_label.items():
        first.setdefault(class_id, label)
    return [first[c] for c in sorted(first)]


@torch.no_grad()
def collect(pipeline, config: FitConfig, log=print) -> tuple[Pairs, list[dict]]:
    """Runs every group uncached and gathers its pairs; also what each group was."""
    bf = pipeline.block_forward
    if bf is None:
        raise SystemExit(f"{pipeline.name} has no block-level forward: TeaCache does not apply")
    prompts = prompts_of(pipeline)
    groups = [(s, n, g) for s in config.samplers for n in config.steps for g in config.guidance]
    pairs, described, image = Pairs([], [], []), [], 0
    for number, (sampler_name, steps, guidance) in enumerate(groups):
        count = config.trajectories // len(groups) + (number < config.trajectories % len(groups))
        for start in range(0, count, config.batch_images):
            images = min(config.batch_images, count - start)
            seeds = [config.seed * 1_000_003 + image + i for i in range(images)]
            batch_prompts = [prompts[(image + i) % len(prompts)] for i in range(images)]
            _run_batch(pipeline, bf, pairs, image, batch_prompts, seeds, sampler_name, steps, guidance)
            image += images
        described.append({"sampler": sampler_name, "steps": steps, "guidance": guidance, "images": count})
        log(f"  {sampler_name} {steps} steps guidance {guidance:g}: {count} images, {len(pairs.x)} pairs so far")
    return pairs, described


def _run_batch(pipeline, bf, pairs: Pairs, first_image, prompts, seeds, sampler_name, steps, guidance) -> None:
    """`len(prompts)` images in lockstep (one sampler per image, as the engine's requests have)."""
    n = len(prompts)
    resolved = pipeline.resolve(
        ImageParams(
            prompt=prompts[0],
            negative_prompt=None,
            n=1,
            width=None,
            height=None,
            num_inference_steps=steps,
            guidance_scale=guidance,
            sampler=sampler_name,
            seed=seeds[0],
            cache=None,
        )
    )
    encoded = [pipeline.encode_prompt(p, None) for p in prompts]
    guided = guidance > 1.0
    rows = [c for c, _ in encoded] + ([u for _, u in encoded] if guided else [])
    cond = pipeline.stack(rows)
    samplers = [
        RequestSampler(sampler_name, pipeline.scheduler_config, steps, [torch.Generator().manual_seed(s)])
        for s in seeds
    ]
    latents = [s.initial_latents(resolved.latent_shape, pipeline.device) for s in samplers]
    row_image = [first_image + i for i in range(n)] * (2 if guided else 1)
    previous: tuple[torch.Tensor, torch.Tensor] | None = None
    for step in range(len(samplers[0].timesteps)):
        inputs = torch.cat([s.model_input(x) for s, x in zip(samplers, latents)])
        if guided:
            inputs = torch.cat([inputs, inputs])
        timesteps = torch.stack([s.timestep.to(torch.float32) for s in samplers] * (2 if guided else 1))
        hidden, block_rows = bf.embed(inputs.to(pipeline.dtype), timesteps.to(pipeline.device), cond)
        modulated = bf.modulated_input(hidden, block_rows).float()
        out = bf.final(bf.blocks(hidden, block_rows, 0, bf.num_blocks), block_rows).float()
        if previous is not None and not in_full_window(step, steps):
            pairs.x += relative_l1(modulated, previous[0])
            pairs.y += relative_l1(out, previous[1])
            pairs.image += row_image
        previous = (modulated, out)
        for i, sampler in enumerate(samplers):
            part = out[i : i + 1]
            if guided:
                part = guide(part, out[n + i : n + i + 1], guidance, latents[i].shape[1])
            latents[i] = sampler.step(part, latents[i])


def r_squared(y: np.ndarray, predicted: np.ndarray) -> float:
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else float("nan")


def fit(pairs: Pairs, degree: int) -> tuple[list[float], dict]:
    """The polynomial (highest degree first) and how well it fits."""
    x, y, image = np.array(pairs.x), np.array(pairs.y), np.array(pairs.image)
    if len(x) <= degree:
        raise SystemExit(f"{len(x)} pairs cannot fit a degree-{degree} polynomial: more trajectories or steps")
    coefficients = np.polyfit(x, y, degree)
    even = image % 2 == 0
    held_out = float("nan")
    if even.sum() > degree and (~even).any():
        held_out = r_squared(y[~even], np.polyval(np.polyfit(x[even], y[even], degree), x[~even]))
    quality = {
        "pairs": int(len(x)),
        "x_range": [float(x.min()), float(x.max())],
        "y_range": [float(y.min()), float(y.max())],
        "r2": round(r_squared(y, np.polyval(coefficients, x)), 6),
        "r2_held_out": round(held_out, 6),
        "r2_raw_change": round(r_squared(y, x), 6),  # p(x) = x: what the unfitted model accumulates
    }
    return [float(c) for c in coefficients], quality


def write(folder: Path, coefficients: list[float], fitted: dict) -> Path:
    """Into folder/pagemesh.json: the coefficients and what they were fitted on, the rest kept."""
    file = folder / SERVING_FILE
    serving = json.loads(file.read_text()) if file.exists() else {}
    serving["teacache_coefficients"] = coefficients
    serving["teacache_fit"] = fitted
    file.write_text(json.dumps(serving, indent=2) + "\n")
    return file


def run(folder: Path, config: FitConfig, *, threads: int, log=print) -> tuple[list[float], dict]:
    from pagemesh.workers.diffusion.pipelines.loader import load_pipeline

    began = time.perf_counter()
    torch.manual_seed(config.seed)
    pipeline = load_pipeline(str(folder))
    log(f"{pipeline.name}: {config.trajectories} trajectories over {folder}")
    pairs, _ = collect(pipeline, config, log)
    coefficients, quality = fit(pairs, config.degree)
    fitted = {
        "samplers": list(config.samplers),
        "steps": list(config.steps),
        "guidance": list(config.guidance),
        "trajectories": config.trajectories,  # images, spread evenly over the groups
        "degree": config.degree,
        **quality,
        "seed": config.seed,
        "seconds": round(time.perf_counter() - began, 1),
        "threads": threads,
        "torch": torch.__version__,
    }
    file = write(folder, coefficients, fitted)
    log(f"coefficients {coefficients}")
    q = quality
    log(
        f"R² {q['r2']:.4f} (held out {q['r2_held_out']:.4f}; the raw change's {q['r2_raw_change']:.4f})"
        f" on {q['pairs']} pairs, x in [{q['x_range'][0]:.4g}, {q['x_range'][1]:.4g}] -> {file}"
    )
    return coefficients, fitted


def _numbers(text: str, kind):
    return tuple(kind(v) for v in text.split(",") if v.strip())


def main(argv: list[str] | None = None) -> None:
    defaults = FitConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", choices=sorted(EMBEDDED_MODELS), help="an embedded model (its folder is written)")
    where.add_argument("--folder", type=Path, help="a model folder (diffusers' layout)")
    parser.add_argument("--trajectories", type=int, default=defaults.trajectories)
    parser.add_argument("--samplers", default=",".join(defaults.samplers))
    parser.add_argument("--steps", default=",".join(map(str, defaults.steps)), help="step counts, e.g. 25,50")
    parser.add_argument("--guidance", default=",".join(f"{g:g}" for g in defaults.guidance), help="e.g. 1.5,4")
    parser.add_argument("--degree", type=int, default=defaults.degree)
    parser.add_argument("--batch-images", type=int, default=defaults.batch_images)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=1)  # 2 threads on a shared 2-core machine: 10x slower
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = FitConfig(
        trajectories=args.trajectories,
        samplers=_numbers(args.samplers, str),
        steps=_numbers(args.steps, int),
        guidance=_numbers(args.guidance, float),
        degree=args.degree,
        batch_images=args.batch_images,
        seed=args.seed,
    )
    folder = EMBEDDED_MODELS[args.model] if args.model else args.folder
    run(Path(folder), config, threads=args.threads)


if __name__ == "__main__":
    main()
