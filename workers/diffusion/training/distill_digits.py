"""Distils the embedded digits DiT into a few-step student: progressive distillation (Salimans & Ho,
ICLR 2022) with classifier-free guidance distilled in (Meng et al., CVPR 2023).

    python -m pagemesh.workers.diffusion.training.distill_digits --out DIR [--teacher DIR]

Each round halves the number of DDIM steps. The round's student starts as a copy of its teacher
and learns to go in one DDIM step where the teacher goes in two:

    teacher   z_t ──DDIM──▶ z_t' ──DDIM──▶ z_t''      t' = t - S/2,  t'' = t - S,  S = 1000 // M
    student   z_t ─────────── DDIM ───────▶ z_t''     t on the M-step grid diffusers' DDIM serves

z_t is a training digit noised to t; the student's target is the x0 for which one DDIM step from
z_t lands on the teacher's z_t'' (t'' < 0 is the clean image, as DDIM's last step). The first
round's teacher is the digits DiT under guidance w (noise prediction, a digit row and a null row);
every student predicts v = α ε − σ x0 (an ε student's x0 = (z − σ ε) / α amplifies its error
by 1/α = 158 at t = 999, the step a 1-step model takes) and needs no guidance: it answers
guidance 1.0, one row per image, with the guided teacher's trajectory.

writes DIR in diffusers' DiTPipeline layout (pixel space), servable as any DiT folder:

    DIR/transformer/           DiTTransformer2DModel, the last round's student (EMA weights)
    DIR/scheduler/             DDIMScheduler config: the teacher's betas, v_prediction, trailing
    DIR/model_index.json       DiTPipeline, id2label as the teacher's
    DIR/pagemesh.json          serving defaults (DDIM only, its step count, guidance 1.0) and
                               what was done ("distilled": rounds, losses, seconds, threads)

Seeded: the same command gives the same weights on the same torch build.
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
from diffusers import DDIMScheduler, DiTTransformer2DModel

from pagemesh.workers.diffusion.training.digits_data import train_split
from pagemesh.workers.diffusion.training.train_digits import ID2LABEL

TEACHER_PATH = Path(__file__).resolve().parent.parent / "models" / "digits-dit"


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    teacher_steps: int = 16  # the first round's teacher: guided DDIM at this many steps
    serve_steps: tuple[int, ...] = (1, 2, 4)  # step counts the last student must answer
    default_steps: int = 4  # what it serves when a request names none
    guidance: float = 2.0  # the teacher's serving default, distilled in
    iterations: int = 400  # per round
    first_iterations: int = 600  # round 1 also learns v and the guidance
    batch_size: int = 64
    lr: float = 2e-4
    warmup: int = 50
    ema_decay: float = 0.995
    seed: int = 0

    def rounds(self) -> list[int]:
        """The student's step count in each round: teacher_steps/2, /4, ..., min(serve_steps)."""
        steps, out = self.teacher_steps, []
        while steps > min(self.serve_steps):
            steps //= 2
            out.append(steps)
        if not out or out[-1] != min(self.serve_steps):
            raise ValueError("teacher_steps must be min(serve_steps) times a power of two (> 1)")
        return out


def ddim_scheduler(scheduler_config: dict) -> DDIMScheduler:
    """DDIM from another scheduler's config, given only the keys DDIM takes (no warnings)."""
    accepted = set(inspect.signature(DDIMScheduler.__init__).parameters)
    return DDIMScheduler(**{key: value for key, value in scheduler_config.items() if key in accepted})


class Schedule:
    """α_t = sqrt(ᾱ_t), σ_t = sqrt(1 − ᾱ_t) of the teacher's betas; t < 0 is the clean image
    (ᾱ = 1, DDIM's `set_alpha_to_one`)."""

    def __init__(self, scheduler_config: dict):
        self.config = scheduler_config
        self.alphas_cumprod = ddim_scheduler(scheduler_config).alphas_cumprod
        self.num_train_timesteps = int(scheduler_config["num_train_timesteps"])

    def alpha_sigma(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.where(t >= 0, self.alphas_cumprod[t.clamp(min=0)], torch.ones(()))
        return a.sqrt().view(-1, 1, 1, 1), (1 - a).sqrt().view(-1, 1, 1, 1)

    def grid(self, steps: int) -> torch.Tensor:
        """The timesteps diffusers' DDIM visits at `steps` steps (the serving sampler's)."""
        scheduler = ddim_scheduler(self.config)
        scheduler.set_timesteps(steps)
        return scheduler.timesteps.clone()

    def stride(self, steps: int) -> int:
        return self.num_train_timesteps // steps  # DDIM's step: prev_t = t - stride

    def kept(self, steps: int, serve_steps: tuple[int, ...]) -> torch.Tensor:
        """The timesteps of the larger served grids that the `steps` grid lacks (e.g. 749, 499
        and 249 for 1 step, serving 1, 2, 4): a round keeps its teacher's answers there."""
        own = set(self.grid(steps).tolist())
        points = {int(t) for n in serve_steps if n > steps for t in self.grid(n).tolist()} - own
        return torch.tensor(sorted(points, reverse=True), dtype=torch.long)


class GuidedEpsTeacher:
    """The digits DiT (noise prediction) under classifier-free guidance w: (x0, ε) estimates."""

    def __init__(self, model: DiTTransformer2DModel, schedule: Schedule, guidance: float):
        self.model, self.schedule, self.guidance = model, schedule, guidance
        self.null_class = model.config.num_embeds_ada_norm

    @torch.no_grad()
    def predict(self, z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(z)
        out = self.model(
            torch.cat([z, z]),
            timestep=torch.cat([t, t]),
            class_labels=torch.cat([labels, labels.new_full((n,), self.null_class)]),
        ).sample
        cond, uncond = out.chunk(2)
        eps = uncond + self.guidance * (cond - uncond)
        alpha, sigma = self.schedule.alpha_sigma(t)
        return (z - sigma * eps) / alpha, eps


class VStudent:
    """A v-predicting DiT (a previous round's student): (x0, ε) estimates, no guidance."""

    def __init__(self, model: DiTTransformer2DModel, schedule: Schedule):
        self.model, self.schedule = model, schedule

    @torch.no_grad()
    def predict(self, z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.model(z, timestep=t, class_labels=labels).sample
        alpha, sigma = self.schedule.alpha_sigma(t)
        return alpha * z - sigma * v, sigma * z + alpha * v


def ddim_step(teacher, schedule: Schedule, z, t, t_next, labels) -> torch.Tensor:
    """One deterministic DDIM step (η = 0) of `teacher` from t to t_next (< 0: the clean image)."""
    x0, eps = teacher.predict(z, t, labels)
    alpha_next, sigma_next = schedule.alpha_sigma(t_next)
    return alpha_next * x0 + sigma_next * eps


def v_target(teacher, schedule: Schedule, z, t, stride: int, labels) -> torch.Tensor:
    """The v a student must predict at (z, t) so that its one DDIM step to t - stride lands where
    the teacher's two steps do (Salimans & Ho, Algorithm 2)."""
    t_mid, t_end = t - stride // 2, t - stride
    z_end = ddim_step(teacher, schedule, ddim_step(teacher, schedule, z, t, t_mid, labels), t_mid, t_end, labels)
    alpha, sigma = schedule.alpha_sigma(t)
    alpha_end, sigma_end = schedule.alpha_sigma(t_end)
    ratio = sigma_end / sigma
    x0 = (z_end - ratio * z) / (alpha_end - ratio * alpha)
    eps = (z - alpha * x0) / sigma
    return alpha * eps - sigma * x0


def teacher_v(teacher, schedule: Schedule, z, t, labels) -> torch.Tensor:
    """The teacher's own answer at (z, t), as a v."""
    x0, eps = teacher.predict(z, t, labels)
    alpha, sigma = schedule.alpha_sigma(t)
    return alpha * eps - sigma * x0


def distill_round(
    teacher,
    student: DiTTransformer2DModel,
    schedule: Schedule,
    steps: int,
    iterations: int,
    config: DistillConfig,
    gen: torch.Generator,
    log_every: int = 100,
) -> tuple[DiTTransformer2DModel, float]:
    """Trains `student` (in place) to take `steps` DDIM steps, and to keep the teacher's answers
    at the larger served grids' other points (half the batch when there are any, so that one
    model answers every served step count); returns (its EMA copy, the last `log_every`
    iterations' mean loss)."""
    data = train_split()
    grid, stride = schedule.grid(steps), schedule.stride(steps)
    kept = schedule.kept(steps, config.serve_steps)
    on_grid = config.batch_size // 2 if len(kept) else config.batch_size
    # Train mode would only switch on each block's LabelEmbedding dropout (DiT has no other
    # dropout), which would teach the student unguided answers for 10% of its digit rows.
    student.eval().requires_grad_(True)
    ema = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=config.lr, weight_decay=0.0)
    running, last = 0.0, float("nan")
    start = time.perf_counter()
    for it in range(iterations):
        idx = torch.randint(0, len(data.labels), (config.batch_size,), generator=gen)
        x0, labels = data.images[idx], data.labels[idx]
        t = grid[torch.randint(0, len(grid), (config.batch_size,), generator=gen)]
        if on_grid < config.batch_size:
            t[on_grid:] = kept[torch.randint(0, len(kept), (config.batch_size - on_grid,), generator=gen)]
        noise = torch.randn(x0.shape, generator=gen)
        alpha, sigma = schedule.alpha_sigma(t)
        z = alpha * x0 + sigma * noise
        target = v_target(teacher, schedule, z[:on_grid], t[:on_grid], stride, labels[:on_grid])
        if on_grid < config.batch_size:
            kept_target = teacher_v(teacher, schedule, z[on_grid:], t[on_grid:], labels[on_grid:])
            target = torch.cat([target, kept_target])
        loss = torch.nn.functional.mse_loss(student(z, timestep=t, class_labels=labels).sample, target)
        for group in opt.param_groups:  # warm-up, then cosine to 0 within the round
            progress = max(0, it - config.warmup) / max(1, iterations - config.warmup)
            group["lr"] = config.lr * min(1.0, (it + 1) / config.warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), student.parameters(), strict=True):
                p_ema.lerp_(p, 1 - config.ema_decay)
        running += loss.item()
        if (it + 1) % log_every == 0:
            last, running = running / log_every, 0.0
            print(
                f"  {steps} steps: iteration {it + 1}/{iterations} loss {last:.4f} {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    return ema.eval(), last


def distill(config: DistillConfig, teacher_path: Path = TEACHER_PATH) -> tuple[DiTTransformer2DModel, dict, list[dict]]:
    """(the last student, its scheduler config, a record per round)."""
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    teacher_config = json.loads((teacher_path / "scheduler" / "scheduler_config.json").read_text())
    if teacher_config.get("prediction_type", "epsilon") != "epsilon":
        raise ValueError(f"{teacher_path}: the teacher must predict the noise (prediction_type epsilon)")
    schedule = Schedule(teacher_config)
    model = DiTTransformer2DModel.from_pretrained(teacher_path / "transformer").eval().requires_grad_(False)
    teacher = GuidedEpsTeacher(model, schedule, config.guidance)
    student = copy.deepcopy(model)
    records = []
    for i, steps in enumerate(config.rounds()):
        iterations = config.first_iterations if i == 0 else config.iterations
        print(f"round {i + 1}: {2 * steps} teacher steps -> {steps} student steps", flush=True)
        start = time.perf_counter()
        student, loss = distill_round(teacher, student, schedule, steps, iterations, config, gen)
        seconds = time.perf_counter() - start
        records.append(
            {
                "student_steps": steps,
                "kept_timesteps": schedule.kept(steps, config.serve_steps).tolist(),
                "iterations": iterations,
                "loss": round(loss, 5),
                "seconds": round(seconds, 1),
            }
        )
        teacher = VStudent(copy.deepcopy(student).requires_grad_(False), schedule)
    scheduler_config = {key: value for key, value in teacher_config.items() if not key.startswith("_")}
    scheduler_config |= {
        "prediction_type": "v_prediction",
        "clip_sample": False,
        "thresholding": False,
        "timestep_spacing": "trailing",
        "set_alpha_to_one": True,
    }
    return student, scheduler_config, records


def serving_defaults(config: DistillConfig) -> dict:
    return {
        "sizes": ["256x256", "8x8", "64x64", "128x128", "512x512"],
        "default_steps": config.default_steps,
        "default_sampler": "ddim",
        "default_guidance_scale": 1.0,  # distilled in: one row per image
        "max_guidance_scale": 1.0,  # more is refused with a 400 (pipelines/dit.py)
        # Beyond its largest trained grid it still answers (measured: 8 steps 96-98% / FD ~11 where
        # 4 gave 99.7% / FD 12-14), but more steps buy nothing; twice that grid is the cap.
        "max_steps": 2 * max(config.serve_steps),
        "samplers": ["ddim"],  # trained for the DDIM step from t to t - 1000 // steps alone
        "conditioning": "the prompt must name one digit, 0-9 or zero-nine, e.g. 'a handwritten 7'",
    }


def save_folder(student: DiTTransformer2DModel, scheduler, out: Path, serving: dict) -> None:
    """Writes a student in DiTPipeline's layout (pixel space), with `scheduler` (a diffusers
    scheduler instance: DDIM here, LCM for the consistency student) as its scheduler."""
    import diffusers

    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out / "transformer", safe_serialization=True)
    config_file = out / "transformer" / "config.json"  # without the teacher's local path
    config = json.loads(config_file.read_text())
    config.pop("_name_or_path", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    scheduler.save_pretrained(out / "scheduler")
    index = {
        "_class_name": "DiTPipeline",
        "_diffusers_version": diffusers.__version__,
        "id2label": ID2LABEL,
        "scheduler": ["diffusers", type(scheduler).__name__],
        "transformer": ["diffusers", "DiTTransformer2DModel"],
        "vae": [None, None],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "pagemesh.json").write_text(json.dumps(serving, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--teacher", type=Path, default=TEACHER_PATH)
    defaults = DistillConfig()
    for field in ("teacher_steps", "default_steps", "iterations", "first_iterations", "batch_size", "seed"):
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(defaults, field))
    parser.add_argument("--serve-steps", default=",".join(map(str, defaults.serve_steps)), help="e.g. 1,2,4")
    parser.add_argument("--guidance", type=float, default=defaults.guidance)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--threads", type=int, default=1)  # 2 threads on a shared 2-core machine: 10x slower
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = DistillConfig(
        teacher_steps=args.teacher_steps,
        serve_steps=tuple(int(n) for n in args.serve_steps.split(",")),
        default_steps=args.default_steps,
        guidance=args.guidance,
        iterations=args.iterations,
        first_iterations=args.first_iterations,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
    )
    start = time.perf_counter()
    student, scheduler_config, records = distill(config, args.teacher)
    seconds = time.perf_counter() - start
    serving = serving_defaults(config)
    serving["distilled"] = {
        "method": "progressive distillation (Salimans & Ho 2022), guidance distilled in, v-prediction",
        "teacher": args.teacher.name,
        **asdict(config),
        "rounds": records,
        "distill_seconds": round(seconds, 1),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    save_folder(student, ddim_scheduler(scheduler_config), args.out, serving)
    print(f"{len(records)} rounds, {seconds:.0f} s on {args.threads} thread(s) -> {args.out}")


if __name__ == "__main__":
    main()
