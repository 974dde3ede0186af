"""Fewer denoising steps: samplers and a few-step student on the embedded digits DiT.

DDIM (Song et al., ICLR 2021) takes the DDPM-trained model's deterministic path in far fewer
steps than DDPM's 1000; DPM-Solver++ (Lu et al., 2022) and UniPC (Zhao et al., NeurIPS 2023) are
higher-order solvers of the same ODE for 5-20 steps; a progressively distilled student (Salimans
& Ho, ICLR 2022) is retrained to answer in 1-4; a consistency model (consistency distillation,
Song et al., ICML 2023, as latent consistency models do it, Luo et al. 2023) maps any point of
the guided teacher's trajectory to its end in one step, and samples in more by LCM's multistep
sampling (x0 = f(x_t, t), noised afresh to the next timestep). Each cell draws the same seeded
noise for the same digits; the project's classifier judges the images (bench/diffusion/classifier.py: the
share recognised as the digit asked for, and the Fréchet distance in its 64-d feature space
to the 300 held-out real digits, which neither model trained on).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagemesh.bench.experiments.report import Report, new_figure

TEACHER_SAMPLERS = ("ddpm", "ddim", "dpmsolver++", "unipc", "euler")
LABELS = {"ddpm": "DDPM", "ddim": "DDIM", "dpmsolver++": "DPM-Solver++ (2M)", "unipc": "UniPC", "euler": "Euler"}
STUDENT = "student"  # the few-step student, sampled by DDIM at its own step counts
CONSISTENCY = "consistency"  # the consistency model, sampled by LCM's multistep consistency sampling
DISTILLED = (STUDENT, CONSISTENCY)


@dataclass(frozen=True)
class Setup:
    per_class: int  # images of each digit per cell
    steps: dict[str, tuple[int, ...]]  # sampler (or STUDENT, CONSISTENCY) -> step counts
    grids: tuple[tuple[str, int], ...]  # the cells whose images are shown
    guidance: tuple[float, ...]  # the teacher's DDIM at 10 steps under these guidance scales too


FULL = Setup(
    per_class=10,
    steps={
        # The report must run in 5 minutes on one thread: DDPM at 1000 steps alone took 200 s of
        # that (2 s per image), so DDPM's reference is 250 steps, and DDIM's longest 100 (at 100
        # against 50 and 10 its path has converged).
        "ddpm": (250, 100, 50, 20, 10, 5),
        "ddim": (100, 50, 20, 10, 5, 4, 3, 2, 1),
        "dpmsolver++": (25, 20, 10, 5, 4, 3, 2),  # 25: the teacher's serving default
        "unipc": (20, 10, 5, 4, 3, 2),
        "euler": (50, 20, 10, 5),
        STUDENT: (1, 2, 3, 4, 8),
        CONSISTENCY: (1, 2, 4, 8),
    },
    grids=(
        ("ddpm", 250),
        ("ddim", 50),
        ("ddim", 2),
        ("dpmsolver++", 10),
        ("unipc", 10),
        ("euler", 20),
        (STUDENT, 1),
        (STUDENT, 4),
        (CONSISTENCY, 1),
        (CONSISTENCY, 4),
    ),
    guidance=(1.0, 1.5, 3.0),
)
QUICK = Setup(
    per_class=2,
    steps={
        "ddpm": (50,),
        "ddim": (10,),
        "dpmsolver++": (5,),
        "unipc": (5,),
        "euler": (10,),
        STUDENT: (1, 4),
        CONSISTENCY: (1, 4),
    },
    grids=(("ddim", 10), (STUDENT, 4), (CONSISTENCY, 1)),
    guidance=(1.5,),
)

# Public figures to set beside ours (CIFAR-10 32x32, unconditional FID against 50k real images,
# a different model, data set and judge: the trends compare, the numbers do not). Each was checked
# against the source named in its last cell (December 2026); "not confirmed" where it could not be.
ANCHORS = (
    ("DDPM (Ho et al. 2020)", "1000", "FID 3.17", "arXiv 2006.11239, abstract"),
    (
        "DDIM, η = 0 (Song et al. 2021, Table 1)",
        "50 / 1000",
        "FID 4.67 / 4.04; '10× to 50× faster' than DDPM",
        "ICLR 2021 paper: the 10-50× in the abstract; the Table 1 FIDs not confirmed",
    ),
    ("DPM-Solver (Lu et al. 2022)", "10 / 20", "FID 4.70 / 2.87", "arXiv 2206.00927, abstract (10 / 20 NFE)"),
    ("UniPC (Zhao et al. 2023)", "10", "FID 3.87", "the UniPC project page / abstract (10 NFE, unconditional)"),
    (
        "Progressive distillation (Salimans & Ho 2022)",
        "1 / 2 / 4 / 8",
        "FID 9.12 / 4.51 / 3.00 / 2.57",
        "arXiv 2202.00512: 3.0 at 4 steps in the abstract; 9.12 / 4.51 / 2.57 as Papers with Code lists them",
    ),
    ("Consistency distillation (Song et al. 2023)", "1", "FID 3.55", "arXiv 2303.01469, abstract"),
)


@dataclass(frozen=True)
class Cell:
    sampler: str
    steps: int
    accuracy: float
    fd: float
    rows_per_image: int  # model rows evaluated per image: steps, twice with guidance
    seconds_per_image: float
    latents: torch.Tensor
    guidance: float


def measure(pipeline, classes: list[int], sampler: str, steps: int, guidance: float, seed: int) -> Cell:
    from pagemesh.bench.diffusion.quality import judge
    from pagemesh.bench.diffusion.sample import sample

    start = time.perf_counter()
    if sampler == CONSISTENCY:
        latents = sample_consistency(pipeline, classes, steps=steps, seed=seed)
    else:
        latents = sample(
            pipeline,
            classes,
            sampler="ddim" if sampler == STUDENT else sampler,
            steps=steps,
            guidance_scale=guidance,
            seed=seed,
        )
    seconds = time.perf_counter() - start
    accuracy, fd = judge(pipeline, latents, classes)
    rows = steps * (2 if guidance > 1 else 1)
    print(f"  {sampler} {steps} steps g={guidance:g}: accuracy {accuracy:.1%} FD {fd:.1f} {seconds:.1f} s", flush=True)
    return Cell(sampler, steps, accuracy, fd, rows, seconds / len(classes), latents, guidance)


@torch.no_grad()
def sample_consistency(pipeline, classes: list[int], *, steps: int, seed: int) -> torch.Tensor:
    """The consistency model's images by the engine's "lcm" sampler (diffusers' LCMScheduler from
    the model's scheduler config), as bench/diffusion/sample.py's loop does the others: one
    scheduler and one generator for the batch, one row per image (guidance is distilled in)."""
    from pagemesh.workers.diffusion.engine.samplers import build_scheduler

    scheduler = build_scheduler("lcm", pipeline.scheduler_config)
    scheduler.set_timesteps(steps)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((len(classes), *pipeline.latent_shape), generator=gen) * scheduler.init_noise_sigma
    cond = pipeline.stack(classes)
    for t in scheduler.timesteps:
        out = pipeline.denoise(scheduler.scale_model_input(x, t), t.expand(len(classes)), cond).float()
        x = scheduler.step(out, t, x, generator=gen).prev_sample
    return x


def grid_image(pipeline, latents: torch.Tensor, columns: int, cell: int = 4, gap: int = 1):
    """Class-major images -> one uint8 array, a row per digit, each image `cell` times larger,
    with a grey line of `gap` pixels (before scaling) after each image."""
    pixels = pipeline.decode(latents)[..., 0]  # [n, 8, 8]
    pixels = torch.nn.functional.pad(pixels, (0, gap, 0, gap), value=96)
    n, h, w = pixels.shape
    tiles = pixels.view(n // columns, columns, h, w).permute(0, 2, 1, 3).reshape(n // columns * h, columns * w)
    return tiles.repeat_interleave(cell, 0).repeat_interleave(cell, 1).numpy()


def run(ctx) -> Report:
    from pagemesh.bench.diffusion.classifier import digit_classifier, frechet_distance
    from pagemesh.workers.diffusion.pipelines.embedded import DIGITS_NAME, LCM_NAME, STUDENT_NAME
    from pagemesh.workers.diffusion.pipelines.loader import load_pipeline
    from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES, heldout_split, train_split

    setup = QUICK if ctx.quick else FULL
    teacher, student, consistency = load_pipeline(DIGITS_NAME), load_pipeline(STUDENT_NAME), load_pipeline(LCM_NAME)
    models = {STUDENT: student, CONSISTENCY: consistency}
    classes = [c for c in range(NUM_CLASSES) for _ in range(setup.per_class)]
    clf = digit_classifier()
    train = train_split()
    real = torch.cat([train.images[train.labels == c][: setup.per_class] for c in range(NUM_CLASSES)])
    floor = frechet_distance(clf.features(real), clf.features(heldout_split().images))

    cells: list[Cell] = []
    for sampler, step_counts in setup.steps.items():
        pipeline = models.get(sampler, teacher)
        for steps in step_counts:
            cells.append(measure(pipeline, classes, sampler, steps, pipeline.default_guidance, ctx.seed))
    guided = [measure(teacher, classes, "ddim", 10, scale, ctx.seed) for scale in setup.guidance]

    params = sum(p.numel() for p in teacher.transformer.parameters())
    report = Report(
        ctx.name,
        "Diffusion samplers and a few-step student: steps against quality",
        ctx.command,
        model=f"{DIGITS_NAME} ({params:,} parameters, float32, CPU), {STUDENT_NAME} and {LCM_NAME}",
        seed=ctx.seed,
        threads=ctx.threads,
        started=ctx.started,
        load_at_start=ctx.load_at_start,
    )
    report.text(__doc__.split("\n", 1)[1])
    distilled = _student_record(student) + _consistency_record(consistency)
    report.text(
        f"{len(classes)} images per cell ({setup.per_class} of each digit), seed {ctx.seed}; the teacher at its "
        f"serving guidance {teacher.default_guidance:g} (a digit row and a null row per image), the student and the "
        f"consistency model at {student.default_guidance:g} (guidance distilled in: one row per image). The judge is "
        f"{clf.heldout_accuracy:.1%} accurate on the held-out real digits; {len(classes)} real training digits "
        f"score FD {floor:.1f} against them (the floor at this sample size; FD from {len(classes)} samples is "
        f"noisy, a few points either way). Seconds per image: one batch of all {len(classes)} images through the "
        f"bench's plain sampling loop (bench/diffusion/sample.py), divided by {len(classes)}; rows per image "
        "(model evaluations) do not depend on the machine. The teacher's scheduler config keeps a linear beta "
        "schedule with no clipping or thresholding, on which DPM-Solver++ and UniPC work in pixel space "
        "(with squaredcos_cap_v2 they gave noise unless x0 was thresholded; train_digits.py says why)." + distilled
    )
    report.table(
        ("model", "sampler", "steps", "rows / image", "accuracy", "FD", "ms / image"),
        [
            (
                {STUDENT: STUDENT_NAME, CONSISTENCY: LCM_NAME}.get(c.sampler, DIGITS_NAME),
                {STUDENT: "DDIM", CONSISTENCY: "LCM"}.get(c.sampler) or LABELS[c.sampler],
                c.steps,
                c.rows_per_image,
                f"{c.accuracy:.1%}",
                c.fd,
                c.seconds_per_image * 1000,
            )
            for c in cells
        ],
        caption="Steps against quality",
    )
    ddim10 = _find(cells, "ddim", 10)
    report.table(
        ("guidance", "rows / image", "accuracy", "FD"),
        [
            (f"{c.guidance:g}", c.rows_per_image, f"{c.accuracy:.1%}", c.fd)
            for c in sorted([*guided, *([ddim10] if ddim10 else [])], key=lambda c: c.guidance)
        ],
        caption=f"The teacher's DDIM at 10 steps under other guidance (its default: {teacher.default_guidance:g})",
    )
    report.figure("quality", _quality_figure(cells, floor), "Fréchet distance and accuracy against steps (log scale).")
    report.figure("speed", _speed_figure(cells, floor), "Fréchet distance against wall time per image.")
    for sampler, steps in setup.grids:
        match = next((c for c in cells if (c.sampler, c.steps) == (sampler, steps)), None)
        if match is not None:
            pipeline = models.get(sampler, teacher)
            report.figure(
                f"grid_{sampler.replace('+', 'p')}_{steps}",
                _grid_figure(pipeline, match, setup.per_class),
                f"{_name(sampler)} at {steps} steps: a row per digit 0-9 ({match.accuracy:.0%}, FD {match.fd:.1f}).",
            )
    report.table(
        ("method", "steps", "public figure (CIFAR-10)", "source"), ANCHORS, caption="Anchors from public sources"
    )
    report.text(_reading(cells, floor, teacher.default_guidance))
    report.key = _key(cells)
    return report


def _name(sampler: str) -> str:
    return {STUDENT: "student (DDIM)", CONSISTENCY: "consistency (LCM)"}.get(sampler) or LABELS[sampler]


def _student_record(student) -> str:
    import json

    from pagemesh.workers.diffusion.pipelines.embedded import STUDENT_PATH

    record = json.loads((STUDENT_PATH / "pagemesh.json").read_text()).get("distilled")
    if not record:
        return ""
    rounds = " → ".join(str(r["student_steps"]) for r in record["rounds"])
    return (
        f"\n\nThe student: {record['method']}, from `{record['teacher']}` under guidance {record['guidance']:g}, "
        f"DDIM {record['teacher_steps']} → {rounds} steps in {len(record['rounds'])} rounds, "
        f"{record['distill_seconds']:.0f} s on {record['threads']} CPU thread(s) "
        f"(`python -m pagemesh.workers.diffusion.training.distill_digits --out DIR`); it serves "
        f"{', '.join(map(str, record['serve_steps']))} steps (DDIM only, max_steps {student.max_steps})."
    )


def _consistency_record(consistency) -> str:
    import json

    from pagemesh.workers.diffusion.pipelines.embedded import LCM_PATH

    record = json.loads((LCM_PATH / "pagemesh.json").read_text()).get("distilled")
    if not record:
        return ""
    iterations = f"{record['warmup_iterations']} + {record['iterations']}"
    return (
        f"\n\nThe consistency model: {record['method']}, from `{record['teacher']}` under guidance "
        f"{record['guidance']:g}, N = {record['intervals']} DDIM intervals, {iterations} iterations of "
        f"{record['batch_size']} digits (v warm-up + consistency distillation), {record['distill_seconds']:.0f} s on "
        f"{record['threads']} CPU thread(s) (`python -m pagemesh.workers.diffusion.training.consistency_digits "
        f"--out DIR`); it serves LCM's sampler alone, {consistency.default_steps} step by default, max_steps "
        f"{consistency.max_steps}."
    )


def _series(cells: list[Cell]) -> dict[str, list[Cell]]:
    series: dict[str, list[Cell]] = {}
    for c in cells:
        series.setdefault(c.sampler, []).append(c)
    return {name: sorted(points, key=lambda c: c.steps) for name, points in series.items()}


def _quality_figure(cells: list[Cell], floor: float):
    figure, (fd_axis, acc_axis) = new_figure(2)
    for sampler, points in _series(cells).items():
        style = dict(marker="o", linestyle="--" if sampler in DISTILLED else "-", label=_name(sampler))
        fd_axis.plot([c.steps for c in points], [c.fd for c in points], **style)
        acc_axis.plot([c.steps for c in points], [100 * c.accuracy for c in points], **style)
    fd_axis.axhline(floor, color="grey", linestyle=":", label="real digits (floor)")
    fd_axis.set(xscale="log", yscale="log", xlabel="steps", ylabel="Fréchet distance (lower is better)")
    acc_axis.set(xscale="log", xlabel="steps", ylabel="classified as the digit asked (%)")
    fd_axis.legend(fontsize=8)
    return figure


def _speed_figure(cells: list[Cell], floor: float):
    figure, (axis,) = new_figure(1, width=6.5)
    for sampler, points in _series(cells).items():
        axis.plot(
            [1000 * c.seconds_per_image for c in points], [c.fd for c in points], marker="o", label=_name(sampler)
        )
        for c in points:
            axis.annotate(
                str(c.steps), (1000 * c.seconds_per_image, c.fd), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    axis.axhline(floor, color="grey", linestyle=":", label="real digits (floor)")
    axis.set(xscale="log", yscale="log", xlabel="ms per image (labels: steps)", ylabel="Fréchet distance")
    axis.legend(fontsize=8)
    return figure


def _grid_figure(pipeline, cell: Cell, columns: int):
    figure, (axis,) = new_figure(1, width=0.45 * columns + 0.4, height=4.9)
    axis.imshow(grid_image(pipeline, cell.latents, columns), cmap="gray", vmin=0, vmax=255)
    axis.set_title(f"{_name(cell.sampler)}, {cell.steps} steps", fontsize=9)
    axis.axis("off")
    return figure


def _find(cells: list[Cell], sampler: str, steps: int) -> Cell | None:
    return next((c for c in cells if (c.sampler, c.steps) == (sampler, steps)), None)


def _reading(cells: list[Cell], floor: float, guidance: float) -> str:
    """What this run's cells say, in figures taken from them."""
    lines = ["## Reading", ""]
    teacher = [c for c in cells if c.sampler not in DISTILLED]
    settled = [c for c in teacher if c.steps >= 5]
    if settled:
        fds = [c.fd for c in settled]
        lines.append(
            f"- **At 5 steps and more every sampler makes the same quality on these digits:** "
            f"{min(c.accuracy for c in settled):.0%}-{max(c.accuracy for c in settled):.0%} recognised, FD "
            f"{min(fds):.1f}-{max(fds):.1f} across all {len(settled)} teacher cells (real digits score {floor:.1f}; "
            f"from {len(settled[0].latents)} images a cell's FD moves by a few points with the seed). An 8x8 digit "
            "is an easy ODE: the trade-offs the papers measure on CIFAR-10 are squeezed here into the last few steps."
        )
    ddpm, ddim = _find(cells, "ddpm", 250), _find(cells, "ddim", 50)
    if ddpm and ddim:
        lines.append(
            f"- **DDIM 250 → 50 holds:** DDPM at 250 steps {ddpm.accuracy:.0%} / FD {ddpm.fd:.1f} at "
            f"{1000 * ddpm.seconds_per_image:.0f} ms per image; DDIM at 50 {ddim.accuracy:.0%} / FD {ddim.fd:.1f} at "
            f"{1000 * ddim.seconds_per_image:.0f} ms ({ddpm.seconds_per_image / ddim.seconds_per_image:.0f}× faster, "
            f"{ddpm.rows_per_image // ddim.rows_per_image}× fewer rows; "
            "the paper's 10-50× is against DDPM's 1000, which this report no longer runs: 2 s per image). "
            "DDPM also holds at 10 steps here, where on CIFAR-10 it falls apart: the trailing "
            "timestep spacing starts every sampler at t = 999, and the data are simple."
        )
    dpm, unipc, ddim10 = _find(cells, "dpmsolver++", 10), _find(cells, "unipc", 10), _find(cells, "ddim", 10)
    if dpm and unipc and ddim10:
        lines.append(
            f"- **DPM-Solver++ and UniPC at 10 steps:** FD {dpm.fd:.1f} and {unipc.fd:.1f} against DDIM's "
            f"{ddim10.fd:.1f}: at least as good, within this sample's noise."
        )
    low = {(c.sampler, c.steps): c for c in teacher if c.steps <= 4}
    if low:
        per_steps = []
        for steps in sorted({n for _, n in low}, reverse=True):
            here = ", ".join(f"{_name(s)} {c.accuracy:.0%} / {c.fd:.0f}" for (s, n), c in low.items() if n == steps)
            per_steps.append(f"{steps}: {here}")
        lines.append(
            "- **At 4 steps and fewer the teacher's FD climbs, and at 1 step it fails** "
            "(steps: sampler accuracy / FD): "
            + "; ".join(per_steps)
            + ". At 2 steps DPM-Solver++ (2M) and UniPC start and end with first-order steps, i.e. DDIM's: "
            "the same images."
        )
    students = {c.steps: c for c in cells if c.sampler == STUDENT}
    if students:
        student_few = ", ".join(f"{n}: {c.accuracy:.0%} / FD {c.fd:.1f}" for n, c in sorted(students.items()))
        lines.append(
            f"- **The student holds where the teacher fails:** {student_few}. It was trained for 1, 2 and 4 "
            "DDIM steps; 3 and 8 leave those grids (it serves up to 8, its max_steps; more steps buy nothing)."
        )
    default, fast = _find(cells, "dpmsolver++", 25), students.get(4)
    if default and fast:
        lines.append(
            f"- **Served defaults:** the teacher's (DPM-Solver++ 25 steps, guidance {guidance:g}: "
            f"{default.rows_per_image} rows "
            f"per image) {1000 * default.seconds_per_image:.0f} ms per image, {default.accuracy:.0%} / FD "
            f"{default.fd:.1f}; the student's (DDIM 4 steps, {fast.rows_per_image} rows) "
            f"{1000 * fast.seconds_per_image:.1f} ms, {fast.accuracy:.0%} / FD {fast.fd:.1f}: "
            f"{default.seconds_per_image / fast.seconds_per_image:.0f}× less time "
            f"({default.rows_per_image / fast.rows_per_image:.1f}× fewer rows) at the same accuracy."
            + (
                " The student's lower FD is likely more diversity than the guided teacher has (it was distilled "
                "from guidance 2, and does not copy it exactly): the guidance table shows what guidance alone "
                "does to the teacher's FD."
                if fast.fd < default.fd - 2
                else ""
            )
        )
    consistency = {c.steps: c for c in cells if c.sampler == CONSISTENCY}
    if consistency:
        pairs = []
        for n, c in sorted(consistency.items()):
            other = students.get(n)
            versus = f" (student {other.accuracy:.0%} / FD {other.fd:.1f})" if other else ""
            pairs.append(f"{n}: {c.accuracy:.0%} / FD {c.fd:.1f}{versus}")
        one = consistency.get(1)
        served = ""
        if one and default:
            served = (
                f" Its served default, one LCM step (1 row per image), took {1000 * one.seconds_per_image:.2f} ms "
                f"per image against the teacher's default {1000 * default.seconds_per_image:.0f} ms "
                f"({default.rows_per_image} rows), at {one.accuracy:.0%} / FD {one.fd:.1f} against "
                f"{default.accuracy:.0%} / FD {default.fd:.1f}."
            )
        lines.append(
            "- **The consistency model (steps: accuracy / FD, the progressive student's beside it):** "
            + "; ".join(pairs)
            + "."
            + served
            + " Trained in one run (no halving rounds), it needs no extra steps for accuracy; each extra LCM "
            "step re-noises its x0 with fresh noise and answers again from further down the trajectory, so "
            "more steps draw another image rather than refine the one-step image (FD "
            f"{min(c.fd for c in consistency.values()):.1f}-{max(c.fd for c in consistency.values()):.1f} across "
            f"its step counts; an FD from {len(one.latents) if one else 100} images moves by a few points with "
            "the seed)."
        )
    return "\n".join(lines)


def _key(cells: list[Cell]) -> str:
    parts = []
    for sampler, steps in (
        ("ddpm", 250),
        ("ddim", 50),
        ("dpmsolver++", 10),
        ("unipc", 10),
        (STUDENT, 1),
        (STUDENT, 4),
        (CONSISTENCY, 1),
        (CONSISTENCY, 4),
    ):
        c = _find(cells, sampler, steps)
        if c is not None:
            parts.append(
                f"{_name(sampler)} {steps}: {c.accuracy:.0%} FD {c.fd:.1f} {1000 * c.seconds_per_image:.1f} ms"
            )
    return "diffusion-samplers (accuracy, FD, ms/image): " + "; ".join(parts)
