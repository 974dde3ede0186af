"""The embedded digits model's sample quality, per sampler and step count, judged by the project's
own digit classifier (nothing downloaded).

    python -m pagemesh.bench.diffusion.quality --out DIR [--per-class 30] [--steps 10,25,50,100]

For each sampler and step count it generates `per-class` images of every digit (seeded) and
reports the share the classifier recognises as the digit asked for, and the Fréchet distance in
the classifier's feature space against the 300 held-out real digits (the training split against
the held-out one gives the floor at this sample size). It also writes a PNG grid per sampler
(a row per digit) and DIR/digits_quality.md with the tables and the command.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch
from PIL import Image

from pagemesh.bench.diffusion.classifier import digit_classifier, frechet_distance
from pagemesh.bench.diffusion.sample import SCHEDULERS, sample
from pagemesh.workers.diffusion.pipelines.dit import DiTPipelineModel
from pagemesh.workers.diffusion.pipelines.embedded import DIGITS_PATH
from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES, heldout_split, train_split

# The shipped scheduler config clips nothing; this is what x0 thresholding would do instead.
THRESHOLDING = {"thresholding": True, "dynamic_thresholding_ratio": 0.995, "sample_max_value": 1.0, "clip_sample": True}


def judge(pipeline: DiTPipelineModel, latents: torch.Tensor, classes: list[int]) -> tuple[float, float]:
    """(class accuracy, Fréchet distance to the held-out digits) of generated latents."""
    images = pipeline.decode(latents).permute(0, 3, 1, 2).float() / 127.5 - 1  # the data's [-1, 1]
    clf = digit_classifier()
    accuracy = float((clf.predict(images) == torch.tensor(classes)).float().mean())
    return accuracy, frechet_distance(clf.features(images), clf.features(heldout_split().images))


def save_grid(pipeline: DiTPipelineModel, latents: torch.Tensor, columns: int, path: Path, cell: int = 32) -> None:
    """Images in class-major order -> one PNG, a row per class, each image upscaled to `cell`
    with a grey gap between images."""
    pixels = pipeline.decode(latents)[..., 0].numpy()  # [n, 8, 8]
    rows, pitch = len(pixels) // columns, cell + 4
    grid = Image.new("L", (columns * pitch + 4, rows * pitch + 4), color=96)
    for i, img in enumerate(pixels):
        tile = Image.fromarray(img).resize((cell, cell), Image.NEAREST)
        grid.paste(tile, (4 + (i % columns) * pitch, 4 + (i // columns) * pitch))
    grid.save(path)


def run(out: Path, *, folder: Path, per_class: int, step_counts: list[int], seed: int) -> str:
    pipeline = DiTPipelineModel.from_folder(folder)
    clf = digit_classifier()
    classes = [c for c in range(NUM_CLASSES) for _ in range(per_class)]
    guidance, default_steps = pipeline.default_guidance, pipeline.default_steps
    real_floor = frechet_distance(
        clf.features(train_split().images[: len(classes)]), clf.features(heldout_split().images)
    )
    lines = [
        "# Embedded digits DiT: sample quality",
        "",
        f"Command: `{shlex.join(['python', '-m', 'pagemesh.bench.diffusion.quality', *sys.argv[1:]])}`",
        "",
        f"Model: `{folder.name}`, {sum(p.numel() for p in pipeline.transformer.parameters()):,} parameters. "
        f"Judge: a CNN trained on the training split, {clf.heldout_accuracy:.1%} accurate on the 300 held-out "
        f"real digits. {per_class} images per digit ({len(classes)} per cell), seed {seed}. "
        f"FD: Fréchet distance in the judge's 64-d feature space to the held-out digits; "
        f"{len(classes)} real training digits score {real_floor:.1f} (the floor at this sample size). "
        f"Seconds: a cell's wall time (with its guidance rows) on {torch.get_num_threads()} CPU thread(s).",
        "",
        f"## Samplers x steps (guidance {guidance:g})",
        "",
        "| sampler | steps | accuracy | FD | seconds |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]

    def cell(sampler: str, steps: int, scale: float, overrides: dict | None = None) -> tuple[float, float, float]:
        start = time.perf_counter()
        latents = sample(
            pipeline,
            classes,
            sampler=sampler,
            steps=steps,
            guidance_scale=scale,
            seed=seed,
            scheduler_overrides=overrides,
        )
        accuracy, fd = judge(pipeline, latents, classes)
        print(f"{sampler} {steps} steps g={scale:g} {overrides or ''}: {accuracy:.1%} FD {fd:.1f}", flush=True)
        return accuracy, fd, time.perf_counter() - start

    for sampler in SCHEDULERS:
        for steps in step_counts:
            accuracy, fd, seconds = cell(sampler, steps, guidance)
            lines.append(f"| {sampler} | {steps} | {accuracy:.1%} | {fd:.1f} | {seconds:.1f} |")
        grid_classes = [c for c in range(NUM_CLASSES) for _ in range(10)]
        latents = sample(
            pipeline, grid_classes, sampler=sampler, steps=default_steps, guidance_scale=guidance, seed=seed
        )
        save_grid(pipeline, latents, 10, out / f"digits_{sampler.replace('+', 'p')}.png")

    lines += [
        "",
        f"## Guidance (ddim, {default_steps} steps)",
        "",
        "| guidance | accuracy | FD |",
        "| ---: | ---: | ---: |",
    ]
    for scale in (1.0, 1.5, 2.0, 3.0, 4.0):
        accuracy, fd, _ = cell("ddim", default_steps, scale)
        lines.append(f"| {scale:g} | {accuracy:.1%} | {fd:.1f} |")

    lines += [
        "",
        "## With x0 thresholding (`thresholding=True, clip_sample=True`; the shipped config has neither)",
        "",
        "| sampler | steps | accuracy | FD |",
        "| --- | ---: | ---: | ---: |",
    ]
    for sampler in [s for s in SCHEDULERS if s != "euler"]:  # Euler has no x0 to threshold
        for steps in (25, 50):
            accuracy, fd, _ = cell(sampler, steps, guidance, THRESHOLDING)
            lines.append(f"| {sampler} | {steps} | {accuracy:.1%} | {fd:.1f} |")
    grids = " ".join(f"`digits_{s.replace('+', 'p')}.png`" for s in SCHEDULERS)
    lines += ["", f"Grids ({default_steps} steps, a row per digit 0-9): {grids}", ""]
    report = "\n".join(lines)
    (out / "digits_quality.md").write_text(report)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--folder", type=Path, default=DIGITS_PATH)
    parser.add_argument("--per-class", type=int, default=30)
    parser.add_argument("--steps", default="10,25,50,100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = [int(s) for s in args.steps.split(",")]
    print(run(args.out, folder=args.folder, per_class=args.per_class, step_counts=steps, seed=args.seed))


if __name__ == "__main__":
    main()
