"""Trains the embedded default image model: a small class-conditional DiT on scikit-learn's digits.

    python -m pagemesh.workers.diffusion.training.train_digits --out DIR

writes DIR in diffusers' DiTPipeline layout, pixel space (no VAE):

    DIR/model_index.json                         DiTPipeline, its components, id2label
    DIR/transformer/config.json                  DiTTransformer2DModel
    DIR/transformer/diffusion_pytorch_model.safetensors
    DIR/scheduler/scheduler_config.json          DDPMScheduler (every sampler is built from it)
    DIR/pagemesh.json                            serving defaults: sizes, steps, sampler, guidance

The objective is DDPM's noise prediction over 1000 training timesteps (linear betas); classifier-
free guidance comes from label dropout (a dropped label is the null class, id 10). The saved
weights are the exponential moving average. Everything is seeded: the same command gives the same
weights on the same torch build (the shipped folder, workers/diffusion/models/digits-dit, came
from the defaults: 828,964 parameters, 4,000 steps of 128 images, 681 s on one thread of a shared
2-core machine, torch 2.13.0+cpu, fp32; pagemesh.json's "trained" records it). One thread by
default: two threads on two busy cores ran 10x slower.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from diffusers import DDPMScheduler, DiTTransformer2DModel

from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES, SIDE, train_split

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ID2LABEL = {str(d): f"{d},{word}" for d, word in enumerate(WORDS)}
NULL_CLASS = NUM_CLASSES  # LabelEmbedding's extra row when its dropout is > 0

# The linear schedule (DDPM's, DiT's) ends at alpha_bar 4e-5 (Euler's sigma_max 157). With
# squaredcos_cap_v2 it ends at 2e-9 (sigma_max 2e4): the first step's x0 estimate is the eps error
# times 2e4, and every deterministic sampler gave noise unless x0 was thresholded. On this schedule
# no sampler needs clipping, and DDIM is better without it (it clips x0 but keeps the unclipped eps,
# which guidance pushes off course), so clipping and thresholding are off explicitly (DDPM's and
# DDIM's defaults clip). "trailing" spacing starts every sampler at t = 999.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "prediction_type": "epsilon",
    "variance_type": "fixed_small",
    "clip_sample": False,
    "thresholding": False,
    "timestep_spacing": "trailing",
    "steps_offset": 0,
}

SERVING = {
    "sizes": ["256x256", "8x8", "64x64", "128x128", "512x512"],  # the first is the default
    "default_steps": 25,
    "default_sampler": "dpmsolver++",
    "default_guidance_scale": 1.5,
    "max_steps": 1000,
    "samplers": ["ddpm", "ddim", "dpmsolver++", "unipc", "euler"],
    "conditioning": "the prompt must name one digit, 0-9 or zero-nine, e.g. 'a handwritten 7'",
}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 4000
    batch_size: int = 128
    lr: float = 1e-3
    warmup: int = 200
    label_dropout: float = 0.1
    ema_decay: float = 0.999
    seed: int = 0
    heads: int = 4
    head_dim: int = 24
    layers: int = 4
    patch_size: int = 2


def build_transformer(config: TrainConfig) -> DiTTransformer2DModel:
    return DiTTransformer2DModel(
        num_attention_heads=config.heads,
        attention_head_dim=config.head_dim,
        in_channels=1,
        out_channels=1,  # no learned sigma: the scheduler's fixed variance
        num_layers=config.layers,
        sample_size=SIDE,
        patch_size=config.patch_size,
        num_embeds_ada_norm=NUM_CLASSES,
        norm_num_groups=1,
    )


def _disable_builtin_label_dropout(model: DiTTransformer2DModel) -> None:
    # Every block's AdaLayerNormZero has its own LabelEmbedding, and in training mode each drops
    # labels on its own coin; the blocks of one row must agree, so the training loop drops labels
    # itself and the embeddings only hold the null row (their table keeps its 11th entry).
    for module in model.modules():
        if module.__class__.__name__ == "LabelEmbedding":
            module.dropout_prob = 0.0


def lr_at(config, step: int) -> float:
    """Linear warmup, then cosine to 10%."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_denoiser(config, build: Callable[[], torch.nn.Module], *, log_every: int = 250) -> torch.nn.Module:
    """The EMA weights of the class-conditional denoiser `build()` makes (a DiT here, a U-Net in
    train_digits_unet.py), trained on the digits' training split: DDPM's noise prediction, labels
    dropped to the null class for classifier-free guidance. `config`: the fields of TrainConfig's
    first block (steps, batch_size, lr, warmup, label_dropout, ema_decay, seed)."""
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    data = train_split()
    model = build()
    _disable_builtin_label_dropout(model)
    ema = build().requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    scheduler = DDPMScheduler(**SCHEDULER_CONFIG)
    alphas_cumprod = scheduler.alphas_cumprod
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    model.train()
    n = len(data.labels)
    running = 0.0
    start = time.perf_counter()
    for step in range(config.steps):
        idx = torch.randint(0, n, (config.batch_size,), generator=gen)
        x0, labels = data.images[idx], data.labels[idx]
        drop = torch.rand(config.batch_size, generator=gen) < config.label_dropout
        labels = torch.where(drop, NULL_CLASS, labels)
        t = torch.randint(0, SCHEDULER_CONFIG["num_train_timesteps"], (config.batch_size,), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        a = alphas_cumprod[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        pred = model(xt, t, class_labels=labels).sample
        loss = torch.nn.functional.mse_loss(pred, noise)
        for group in opt.param_groups:
            group["lr"] = lr_at(config, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
                p_ema.lerp_(p, 1 - config.ema_decay)
        running += loss.item()
        if log_every and (step + 1) % log_every == 0:
            elapsed = time.perf_counter() - start
            print(f"step {step + 1}/{config.steps} loss {running / log_every:.4f} {elapsed:.0f} s", flush=True)
            running = 0.0
    return ema.eval()


def train(config: TrainConfig, *, log_every: int = 250) -> DiTTransformer2DModel:
    """The EMA weights of a DiT trained on the digits' training split."""
    return train_denoiser(config, lambda: build_transformer(config), log_every=log_every)


def save_folder(transformer: DiTTransformer2DModel, out: Path, *, trained: dict | None = None) -> None:
    """Writes `out` in DiTPipeline's layout (pixel space: the vae component is null)."""
    import diffusers

    out.mkdir(parents=True, exist_ok=True)
    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    DDPMScheduler(**SCHEDULER_CONFIG).save_pretrained(out / "scheduler")
    index = {
        "_class_name": "DiTPipeline",
        "_diffusers_version": diffusers.__version__,
        "id2label": ID2LABEL,
        "scheduler": ["diffusers", "DDPMScheduler"],
        "transformer": ["diffusers", "DiTTransformer2DModel"],
        "vae": [None, None],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    serving = dict(SERVING)
    if trained is not None:
        serving["trained"] = trained
    (out / "pagemesh.json").write_text(json.dumps(serving, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    # The shape of the stack: the deep variant for the cache experiment is --layers 12 --head-dim 12
    # (twelve thinner blocks, so block 0 is a twelfth of the stack instead of a quarter).
    parser.add_argument("--layers", type=int, default=TrainConfig.layers)
    parser.add_argument("--heads", type=int, default=TrainConfig.heads)
    parser.add_argument("--head-dim", type=int, default=TrainConfig.head_dim)
    parser.add_argument("--threads", type=int, default=1)  # 2 threads on a shared 2-core machine: 10x slower
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = TrainConfig(steps=args.steps, seed=args.seed, layers=args.layers, heads=args.heads, head_dim=args.head_dim)
    start = time.perf_counter()
    model = train(config)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    trained = {
        **asdict(config),
        "parameters": params,
        "train_seconds": round(seconds, 1),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    save_folder(model, args.out, trained=trained)
    print(f"{params:,} parameters, {seconds:.0f} s on {args.threads} threads -> {args.out}")


if __name__ == "__main__":
    main()
