"""Trains the embedded U-Net image model: a small class-conditional UNet2DModel on scikit-learn's digits.

    python -m pagemesh.workers.diffusion.training.train_digits_unet --out DIR

It is the digits DiT's twin with a U-Net for a denoiser (train_digits.py): the same data (the
8x8 training split, pixel space, no VAE), the same objective and schedule (DDPM's noise prediction
over 1000 timesteps, linear betas, SCHEDULER_CONFIG), the same label dropout to the null class
(id 10) for classifier-free guidance, EMA weights, seeding and one thread. It exists so that U-Net
feature caching (DeepCache) can be judged on a model that really draws digits. DIR is written as

    DIR/model_index.json                         ClassUNetPipeline (ours, see below), id2label
    DIR/unet/config.json                         UNet2DModel, num_class_embeds 11 (10 digits + null)
    DIR/unet/diffusion_pytorch_model.safetensors
    DIR/scheduler/scheduler_config.json          DDPMScheduler (every sampler is built from it)
    DIR/pagemesh.json                            serving defaults and the "trained" record

model_index.json's `_class_name` is "ClassUNetPipeline", a name of our own: diffusers has no
class-conditional UNet2DModel pipeline (its DDPMPipeline calls the unet without class labels, so it
could not run this folder, and claiming it would mislead). pagemesh's loader serves the layout with
pipelines/class_unet.py; with diffusers alone, UNet2DModel.from_pretrained(DIR / "unet") and
DDPMScheduler.from_pretrained(DIR / "scheduler") load the parts.

The shipped folder, workers/diffusion/models/digits-unet, came from the defaults: 702,753
parameters, 4,000 steps of 128 images, 940 s on one thread of a shared 2-core machine under load
from other jobs (about 0.15 s a step when the core is free: 10 minutes), torch 2.13.0+cpu, fp32;
pagemesh.json's "trained" records it. Its serving defaults are the digits DiT's (SERVING), so the
two models are compared (and U-Net feature caching judged) at the same steps, sampler and guidance.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from diffusers import DDPMScheduler, UNet2DModel

from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES, SIDE
from pagemesh.workers.diffusion.training.train_digits import ID2LABEL, SCHEDULER_CONFIG, SERVING, train_denoiser

LAYOUT = "ClassUNetPipeline"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 4000
    batch_size: int = 128
    lr: float = 1e-3
    warmup: int = 200
    label_dropout: float = 0.1
    ema_decay: float = 0.999
    seed: int = 0
    channels: tuple[int, ...] = (32, 64)  # block_out_channels: 8x8 at 32, 4x4 (with attention) at 64
    layers_per_block: int = 1
    norm_groups: int = 8
    head_dim: int = 8


def build_unet(config: TrainConfig) -> UNet2DModel:
    """The first block runs at 8x8 and downsamples; the last (the deepest) runs at 4x4 with
    self-attention, as does the mid block; the up path mirrors it with skip connections."""
    levels = len(config.channels)
    return UNet2DModel(
        sample_size=SIDE,
        in_channels=1,
        out_channels=1,
        block_out_channels=config.channels,
        layers_per_block=config.layers_per_block,
        down_block_types=("DownBlock2D",) * (levels - 1) + ("AttnDownBlock2D",),
        up_block_types=("AttnUpBlock2D",) + ("UpBlock2D",) * (levels - 1),
        norm_num_groups=config.norm_groups,
        attention_head_dim=config.head_dim,
        num_class_embeds=NUM_CLASSES + 1,  # the last row is the null class (NULL_CLASS)
    )


def train(config: TrainConfig, *, log_every: int = 250) -> UNet2DModel:
    """The EMA weights of a UNet2DModel trained on the digits' training split (train_digits.py's loop)."""
    return train_denoiser(config, lambda: build_unet(config), log_every=log_every)


def save_folder(unet: UNet2DModel, out: Path, *, serving: dict, trained: dict | None = None) -> None:
    """Writes `out` in the ClassUNetPipeline layout (the module doc)."""
    import diffusers

    out.mkdir(parents=True, exist_ok=True)
    unet.save_pretrained(out / "unet", safe_serialization=True)
    DDPMScheduler(**SCHEDULER_CONFIG).save_pretrained(out / "scheduler")
    index = {
        "_class_name": LAYOUT,
        "_diffusers_version": diffusers.__version__,
        "id2label": ID2LABEL,
        "scheduler": ["diffusers", "DDPMScheduler"],
        "unet": ["diffusers", "UNet2DModel"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    serving = dict(serving)
    if trained is not None:
        serving["trained"] = trained
    (out / "pagemesh.json").write_text(json.dumps(serving, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--channels", type=int, nargs="+", default=list(TrainConfig.channels))
    parser.add_argument("--layers-per-block", type=int, default=TrainConfig.layers_per_block)
    parser.add_argument("--threads", type=int, default=1)  # 2 threads on a shared 2-core machine: 10x slower
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = TrainConfig(
        steps=args.steps, seed=args.seed, channels=tuple(args.channels), layers_per_block=args.layers_per_block
    )
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
    save_folder(model, args.out, serving=SERVING, trained=trained)
    print(f"{params:,} parameters, {seconds:.0f} s on {args.threads} threads -> {args.out}")


if __name__ == "__main__":
    main()
