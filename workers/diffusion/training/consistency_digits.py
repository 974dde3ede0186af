"""Distils the embedded digits DiT into a consistency model that answers in one step: consistency
distillation (Song et al., ICML 2023) as latent consistency models do it (Luo et al. 2023): a DDIM
step of the guided teacher as the ODE solver, on a skipping grid, guidance distilled in.

    python -m pagemesh.workers.diffusion.training.consistency_digits --out DIR [--teacher DIR]

The student is a DiT of the teacher's architecture, initialised from the teacher. Its consistency
function is LCMScheduler's (so that diffusers' LCM sampler serves it as trained):

    f(x, t) = c_skip(t) x + c_out(t) x0(x, t),      x0(x, t) = α_t x − σ_t v(x, t)   (v-prediction)
    c_skip(t) = σd² / ((s t)² + σd²),  c_out(t) = s t / sqrt((s t)² + σd²),  σd = 0.5, s = 10

so f(x, 0) = x, the boundary condition at the smallest timestep. v-prediction, not the teacher's
ε: x0 = (x − σ ε) / α would multiply the ε error by 1/α = 158 at t = 999, the step a one-step
model takes (distill_digits.py measured that).

Two stages, both from training digits noised at seeded timesteps:

1. warm-up: the student regresses the guided teacher's v (ε under guidance w, as a v) at random
   timesteps: it starts as the guided teacher's denoiser in its own parametrization.
2. consistency distillation: the skipping grid t_n = k (n + 1) − 1 (k = 1000 // N, N = 50
   intervals: 19, 39, ..., 999, LCMScheduler's original_inference_steps); each row takes x0, a
   grid timestep t = t_{n+1}, z_t = α_t x0 + σ_t ε, one guided DDIM step of the teacher to
   t' = t − k (0 at the bottom), and minimises the pseudo-Huber distance (Song & Dhariwal 2023)
   between f_student(z_t, t) and f_target(z_t', t'), the target network an EMA of the student.

writes DIR in diffusers' DiTPipeline layout (pixel space), servable as any DiT folder:

    DIR/transformer/           DiTTransformer2DModel: the student (a slow EMA of its weights)
    DIR/scheduler/             LCMScheduler config: the teacher's betas, v_prediction, N = 50
    DIR/model_index.json       DiTPipeline, id2label as the teacher's
    DIR/pagemesh.json          serving defaults ("lcm" only, 1 step, max 8, guidance 1.0) and what
                               was done ("distilled": the recipe, losses, seconds, threads, torch,
                               the judge's accuracy at 1, 2 and 4 steps)

Seeded: the same command gives the same weights on the same torch build. One thread by default.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from diffusers import DiTTransformer2DModel, LCMScheduler

from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES, train_split
from pagemesh.workers.diffusion.training.distill_digits import GuidedEpsTeacher, Schedule, save_folder

TEACHER_PATH = Path(__file__).resolve().parent.parent / "models" / "digits-dit"
SERVE_STEPS = (1, 2, 4)


@dataclass(frozen=True, kw_only=True)
class ConsistencyConfig:
    guidance: float = 2.0  # the guided teacher's w (uncond + w (cond − uncond)), distilled in
    intervals: int = 50  # N: the solver's grid, k = 1000 // N train timesteps a DDIM step
    timestep_scaling: float = 10.0  # LCMScheduler's c_skip / c_out scaling
    warmup_iterations: int = 300  # stage 1: v regression to the guided teacher
    iterations: int = 1200  # stage 2: consistency distillation
    batch_size: int = 64
    lr: float = 2e-4
    lr_warmup: int = 50
    target_decay: float = 0.95  # the target network's EMA (LCM's)
    ema_decay: float = 0.99  # the shipped weights' EMA
    huber_c: float = 0.00054 * 8  # pseudo-Huber c = 0.00054 sqrt(d), d = 64 pixels (iCT's rule)
    seed: int = 0


def lcm_scheduler_config(teacher_config: dict, config: ConsistencyConfig) -> dict:
    """The served scheduler: LCMScheduler on the teacher's betas, for a v-predicting student."""
    accepted = set(inspect.signature(LCMScheduler.__init__).parameters)
    out = {key: value for key, value in teacher_config.items() if key in accepted}
    return out | {
        "prediction_type": "v_prediction",
        "original_inference_steps": config.intervals,
        "timestep_scaling": config.timestep_scaling,
        "clip_sample": False,
        "thresholding": False,
        "set_alpha_to_one": True,
    }


class Consistency:
    """f(x, t) of a v-predicting DiT with LCMScheduler's boundary scalings."""

    def __init__(self, schedule: Schedule, scheduler: LCMScheduler):
        self.schedule, self.scheduler = schedule, scheduler

    def __call__(self, model: DiTTransformer2DModel, z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor):
        v = model(z, timestep=t, class_labels=labels).sample
        alpha, sigma = self.schedule.alpha_sigma(t)
        c_skip, c_out = self.scheduler.get_scalings_for_boundary_condition_discrete(t.float().view(-1, 1, 1, 1))
        return c_skip * z + c_out * (alpha * z - sigma * v)


def teacher_v(teacher: GuidedEpsTeacher, schedule: Schedule, z, t, labels) -> torch.Tensor:
    x0, eps = teacher.predict(z, t, labels)
    alpha, sigma = schedule.alpha_sigma(t)
    return alpha * eps - sigma * x0


def pseudo_huber(diff: torch.Tensor, c: float) -> torch.Tensor:
    """Per row sqrt(|d|² + c²) − c, averaged over rows."""
    return (diff.flatten(1).pow(2).sum(1) + c * c).sqrt().sub(c).mean()


def _lr(config: ConsistencyConfig, it: int, iterations: int) -> float:
    progress = max(0, it - config.lr_warmup) / max(1, iterations - config.lr_warmup)
    return config.lr * min(1.0, (it + 1) / config.lr_warmup) * 0.5 * (1 + math.cos(math.pi * progress))


def _ema(into: torch.nn.Module, source: torch.nn.Module, decay: float) -> None:
    with torch.no_grad():
        for p_ema, p in zip(into.parameters(), source.parameters(), strict=True):
            p_ema.lerp_(p, 1 - decay)


@torch.no_grad()
def sample(model, scheduler_config: dict, labels: torch.Tensor, steps: int, seed: int) -> torch.Tensor:
    """Multistep consistency sampling by diffusers' LCMScheduler, one generator per image (as the
    engine's "lcm" sampler does it): images [n, 1, 8, 8]."""
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(labels))]
    scheduler = LCMScheduler.from_config(scheduler_config)
    scheduler.set_timesteps(steps)
    shape = (1, model.config.in_channels, model.config.sample_size, model.config.sample_size)
    z = torch.cat([torch.randn(shape, generator=g) for g in generators]) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        v = model(z, timestep=t.expand(len(z)), class_labels=labels).sample
        z = scheduler.step(v, t, z, generator=generators).prev_sample
    return z


def judge(model, scheduler_config: dict, steps: int, per_class: int = 20, seed: int = 10_000) -> float:
    """The project's classifier's accuracy on per_class images of each digit at `steps` steps."""
    from pagemesh.bench.diffusion.classifier import digit_classifier

    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    images = sample(model, scheduler_config, labels, steps, seed).clamp(-1, 1)
    return float((digit_classifier().predict(images) == labels).float().mean())


def distill(
    config: ConsistencyConfig, teacher_path: Path = TEACHER_PATH, log_every: int = 100, judge_every: int = 400
) -> tuple[DiTTransformer2DModel, dict, dict]:
    """(the student's EMA, its scheduler config, a record of the run)."""
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    teacher_config = json.loads((teacher_path / "scheduler" / "scheduler_config.json").read_text())
    if teacher_config.get("prediction_type", "epsilon") != "epsilon":
        raise ValueError(f"{teacher_path}: the teacher must predict the noise (prediction_type epsilon)")
    schedule = Schedule(teacher_config)
    scheduler_config = lcm_scheduler_config(teacher_config, config)
    lcm = LCMScheduler(**scheduler_config)
    f = Consistency(schedule, lcm)
    model = DiTTransformer2DModel.from_pretrained(teacher_path / "transformer").eval().requires_grad_(False)
    teacher = GuidedEpsTeacher(model, schedule, config.guidance)
    # eval(): train mode only switches on each block's LabelEmbedding dropout (distill_digits.py).
    student = copy.deepcopy(model).eval().requires_grad_(True)
    data = train_split()
    total = schedule.num_train_timesteps
    k = total // config.intervals
    grid = torch.arange(1, config.intervals + 1) * k - 1  # 19, 39, ..., 999: LCMScheduler's
    record: dict = {"warmup": {}, "consistency": {}, "judged": []}

    def batch():
        idx = torch.randint(0, len(data.labels), (config.batch_size,), generator=gen)
        return data.images[idx], data.labels[idx], torch.randn((config.batch_size, 1, 8, 8), generator=gen)

    # Stage 1: the guided teacher's v.
    opt = torch.optim.AdamW(student.parameters(), lr=config.lr, weight_decay=0.0)
    start, running = time.perf_counter(), 0.0
    for it in range(config.warmup_iterations):
        x0, labels, noise = batch()
        t = torch.randint(0, total, (config.batch_size,), generator=gen)
        alpha, sigma = schedule.alpha_sigma(t)
        z = alpha * x0 + sigma * noise
        target = teacher_v(teacher, schedule, z, t, labels)
        loss = torch.nn.functional.mse_loss(student(z, timestep=t, class_labels=labels).sample, target)
        for group in opt.param_groups:
            group["lr"] = _lr(config, it, config.warmup_iterations)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (it + 1) % log_every == 0:
            mean, elapsed = running / log_every, time.perf_counter() - start
            print(f"warm-up {it + 1}/{config.warmup_iterations} loss {mean:.4f} {elapsed:.0f} s", flush=True)
            record["warmup"]["loss"], running = round(running / log_every, 5), 0.0
    record["warmup"]["seconds"] = round(time.perf_counter() - start, 1)
    print(f"warm-up: 1-step accuracy {judge(student, scheduler_config, 1):.1%}", flush=True)

    # Stage 2: consistency distillation.
    target_net = copy.deepcopy(student).requires_grad_(False)
    ema = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=config.lr, weight_decay=0.0)
    start, running = time.perf_counter(), 0.0
    for it in range(config.iterations):
        x0, labels, noise = batch()
        t = grid[torch.randint(0, len(grid), (config.batch_size,), generator=gen)]
        t_prev = (t - k).clamp(min=0)
        alpha, sigma = schedule.alpha_sigma(t)
        z = alpha * x0 + sigma * noise
        with torch.no_grad():
            x0_teacher, eps_teacher = teacher.predict(z, t, labels)  # one guided DDIM step t -> t_prev
            alpha_prev, sigma_prev = schedule.alpha_sigma(t_prev)
            z_prev = alpha_prev * x0_teacher + sigma_prev * eps_teacher
            target = f(target_net, z_prev, t_prev, labels)
        loss = pseudo_huber(f(student, z, t, labels) - target, config.huber_c)
        for group in opt.param_groups:
            group["lr"] = _lr(config, it, config.iterations)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        _ema(target_net, student, config.target_decay)
        _ema(ema, student, config.ema_decay)
        running += loss.item()
        if (it + 1) % log_every == 0:
            mean, elapsed = running / log_every, time.perf_counter() - start
            print(f"consistency {it + 1}/{config.iterations} loss {mean:.4f} {elapsed:.0f} s", flush=True)
            record["consistency"]["loss"], running = round(running / log_every, 5), 0.0
        if judge_every and (it + 1) % judge_every == 0 and it + 1 < config.iterations:
            accuracy = judge(ema, scheduler_config, 1)
            record["judged"].append({"iteration": it + 1, "accuracy_1_step": round(accuracy, 4)})
            print(f"  1-step accuracy (EMA) {accuracy:.1%}", flush=True)
    record["consistency"]["seconds"] = round(time.perf_counter() - start, 1)
    return ema.eval(), scheduler_config, record


def serving_defaults(default_steps: int) -> dict:
    return {
        "sizes": ["256x256", "8x8", "64x64", "128x128", "512x512"],
        "default_steps": default_steps,
        "default_sampler": "lcm",
        "default_guidance_scale": 1.0,  # distilled in: one row per image
        "max_guidance_scale": 1.0,  # more is refused with a 400 (pipelines/dit.py)
        "max_steps": 8,  # LCM's grid points at 8 steps are trained ones too; more buy nothing
        "samplers": ["lcm"],  # a consistency function: the ODE solvers do not apply
        "conditioning": "the prompt must name one digit, 0-9 or zero-nine, e.g. 'a handwritten 7'",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--teacher", type=Path, default=TEACHER_PATH)
    defaults = ConsistencyConfig()
    for field in ("intervals", "warmup_iterations", "iterations", "batch_size", "seed"):
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(defaults, field))
    for field in ("guidance", "lr", "target_decay", "ema_decay"):
        parser.add_argument("--" + field.replace("_", "-"), type=float, default=getattr(defaults, field))
    parser.add_argument("--default-steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)  # 2 threads on a shared 2-core machine: 10x slower
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = ConsistencyConfig(
        guidance=args.guidance,
        intervals=args.intervals,
        warmup_iterations=args.warmup_iterations,
        iterations=args.iterations,
        batch_size=args.batch_size,
        lr=args.lr,
        target_decay=args.target_decay,
        ema_decay=args.ema_decay,
        seed=args.seed,
    )
    start = time.perf_counter()
    student, scheduler_config, record = distill(config, args.teacher)
    seconds = time.perf_counter() - start
    accuracies = {str(steps): round(judge(student, scheduler_config, steps), 4) for steps in SERVE_STEPS}
    serving = serving_defaults(args.default_steps)
    serving["distilled"] = {
        "method": "consistency distillation (Song et al. 2023) as LCM (Luo et al. 2023): guided DDIM solver "
        "on a skipping grid, guidance distilled in, v-prediction, LCMScheduler's boundary scalings",
        "teacher": args.teacher.name,
        **asdict(config),
        "serve_steps": list(SERVE_STEPS),
        **record,
        "distill_seconds": round(seconds, 1),
        "threads": args.threads,
        "torch": torch.__version__,
        "accuracy": accuracies,
        "accuracy_judged_on": "200 images (20 of each digit, seeds 10000+), bench/diffusion/classifier.py",
    }
    save_folder(student, LCMScheduler(**scheduler_config), args.out, serving)
    print(f"accuracy by steps {accuracies}; {seconds:.0f} s on {args.threads} thread(s) -> {args.out}")


if __name__ == "__main__":
    main()
