"""Trains digits-vlm: a small vision-language model that names the digit in a picture, LLaVA-style,
on scikit-learn's digits: the embedded default language model (SmolLM2-135M-Instruct, from its
GGUF, frozen) reads 16 image tokens from a tiny CLIP vision tower and a LLaVA projector.

    python -P -m pagemesh.workers.diffusion.training.train_digits_vlm --out DIR

writes DIR as a Hugging Face LLaVA checkpoint (LlavaForConditionalGeneration) without its
language model:

    DIR/config.json               LlavaConfig; text_config is the GGUF's LlamaConfig, and
                                  "pagemesh_text_weights": "default" says the language model's
                                  weights and tokenizer are the embedded default GGUF
    DIR/preprocessor_config.json  CLIPImageProcessor: RGB, shortest edge 32 (BOX), crop 32x32
    DIR/model.safetensors         vision_tower.* and multi_modal_projector.* only (bf16)
    DIR/README.md                 what it is, how it was trained, its accuracy

The prompt is the GGUF's chat template over one user message whose content is the image
placeholder (`<empty_output>`, id 16: SmolLM2 has no <image> token and never emits this one) and
the user's text joined by "\\n" in the order they came; the one placeholder is expanded to 16
before the model sees it. The answer is the digit as a numeral, then end of turn ("7<|im_end|>").

Training, seeded, CPU, the language model frozen in fp32 (no gradient for its weights):

  1. a soft prompt (16 embeddings) per digit that makes the language model answer that digit in
     every layout of the prompt (loss on the answer tokens only), fitted under noise and blends
     towards the other digits' prompts so that near misses still read right;
  2. the vision tower and the projector (AdamW) make each image its digit's prompt: squared error
     and a softmax over the distances to the ten prompts, plus a linear probe on the tower (a
     head that is not shipped); no language model in the loop, so it is cheap;
  3. the tower and the projector on the answer loss through the language model, LLaVA's
     objective, a few steps.

Backprop through the 30 layers costs ~3.5 s per step of 32 rows on one core, which is why the
language model sees 36 + 15 steps and the vision 1,200. The system prompt's part of every prompt
comes before the image, so its keys and values are the same in every row and no image can change
them: they are computed once and given to each forward as a cache (the rows' own tokens, image
included, run through all 30 layers). Images go the way they will when served: 8x8 digit ->
nearest-neighbour PNG of 32-256 px (workers/diffusion/png.py, greyscale "L") ->
CLIPImageProcessor -> [3, 32, 32].

At the end it reports greedy answer accuracy of the saved folder (loaded back as HF would load
it) on the held-out split and on 100 digits drawn by the embedded DiT at its defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES
from pagemesh.workers.diffusion.training.digits_vlm_data import (
    END_OF_TURN_ID,
    FEATURE_LAYER,
    IMAGE_TOKEN_ID,
    IMAGE_TOKENS,
    LAYOUTS,
    TrainConfig,
    TrainImages,
    digit_ids,
    image_processor,
    load_language_model,
    prompt_ids,
)
from pagemesh.workers.diffusion.training.digits_vlm_folder import (
    attach_language_model,
    build_config,
    evaluate,
    save_folder,
    write_readme,
)


class Prefix:
    """The keys and values of the prompt's part before the user's content (system prompt and
    "<|im_start|>user\\n"): the same in every row, and the image cannot change them."""

    def __init__(self, lm: Any, ids: list[int]):
        from transformers import DynamicCache

        self.length = len(ids)
        with torch.no_grad():
            cache = lm.model(input_ids=torch.tensor([ids]), use_cache=True, cache=DynamicCache()).cache
        self.layers = [(layer.keys, layer.values) for layer in cache.layers]

    def cache(self, rows: int) -> Any:
        from transformers import DynamicCache

        return DynamicCache(
            ddp_cache_data=[(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self.layers]
        )


def common_prefix(sequences: list[list[int]]) -> int:
    n = 0
    while all(len(s) > n and s[n] == sequences[0][n] for s in sequences):
        n += 1
    return n


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    """Linear warmup, then cosine to 10%."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Answers:
    """Rows of prompts with their answers, and the language model's logits for the answer."""

    def __init__(self, tokenizer: Any, lm: Any):
        self.lm = lm
        prompts = [prompt_ids(tokenizer, text, first) for text, first in LAYOUTS]
        self.prefix = Prefix(lm, prompts[0][: common_prefix(prompts)])
        self.rests = [p[self.prefix.length :] for p in prompts]
        self.digits = torch.tensor(digit_ids(tokenizer))

    def logits(
        self, image: torch.Tensor, labels: torch.Tensor, layouts: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """image [B, 16, 576]: each row's image embeddings -> (logits [B, 2, vocab] at the
        digit's and the end of turn's positions, their targets [B, 2])."""
        # each row: its prompt after the prefix, then its digit (whose next token is <|im_end|>)
        rows = [self.rests[k] + [int(self.digits[d])] for k, d in zip(layouts, labels, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), END_OF_TURN_ID)  # right padding: causal, never attended
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        embed = self.lm.get_input_embeddings()
        embeds = embed(ids).masked_scatter((ids == IMAGE_TOKEN_ID)[..., None], image.to(embed.weight.dtype))
        out = self.lm.model(inputs_embeds=embeds, cache=self.prefix.cache(len(rows)), use_cache=False)
        at = torch.tensor([[len(r) - 2, len(r) - 1] for r in rows])  # the last prompt token predicts the digit
        picked = out.last_hidden_state.gather(1, at[..., None].expand(-1, -1, out.last_hidden_state.shape[-1]))
        targets = torch.stack([self.digits[labels], torch.full((len(rows),), END_OF_TURN_ID)], 1)
        return self.lm.lm_head(picked).float(), targets


def answer_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(cross-entropy over the answer tokens, share of rows answered exactly)."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss, float((logits.argmax(-1) == targets).all(1).float().mean())


def fit_prompts(answers: Answers, config: TrainConfig, stats: dict[str, Any]) -> torch.Tensor:
    """Stage 1: a soft prompt [10, 16, 576] per digit that makes the language model answer it,
    started from 16 copies of the numeral's embedding and fitted under noise."""
    gen = torch.Generator().manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    start = time.perf_counter()
    numerals = answers.lm.get_input_embeddings().weight[answers.digits].detach()
    prompts = torch.nn.Parameter(numerals[:, None].repeat(1, IMAGE_TOKENS, 1).clone())
    opt = torch.optim.Adam([prompts], lr=config.prompt_lr)
    for step in range(config.prompt_steps):
        labels = torch.arange(NUM_CLASSES).repeat(config.prompt_rows // NUM_CLASSES)
        layouts = rng.integers(0, len(LAYOUTS), len(labels))
        others = (labels + torch.randint(1, NUM_CLASSES, labels.shape, generator=gen)) % NUM_CLASSES
        blend = config.prompt_blend * torch.rand(len(labels), 1, 1, generator=gen)
        image = torch.lerp(prompts[labels], prompts[others], blend)
        image = image + config.prompt_noise * torch.randn(image.shape, generator=gen)
        loss, exact = answer_loss(*answers.logits(image, labels, layouts))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 6 == 0:
            print(f"prompts {step + 1}/{config.prompt_steps} loss {loss.item():.4f} exact {exact:.2f}", flush=True)
    with torch.no_grad():  # every digit in every layout, without noise
        labels = torch.arange(NUM_CLASSES).repeat(len(LAYOUTS))
        layouts = np.repeat(np.arange(len(LAYOUTS)), NUM_CLASSES)
        loss, exact = answer_loss(*answers.logits(prompts[labels], labels, layouts))
    stats["prompts"] = {"seconds": round(time.perf_counter() - start, 1), "loss": round(loss.item(), 4), "exact": exact}
    print(f"prompts: every layout exact {exact:.3f} loss {loss.item():.4f}", flush=True)
    return prompts.detach()


def fit_vision(model: Any, images: TrainImages, prompts: torch.Tensor, config: TrainConfig, stats: dict) -> None:
    """Stage 2: the tower and the projector make each image its digit's soft prompt (squared
    error, and a softmax over the distances to the ten prompts), with a linear probe on the
    tower's mean patch feature (a classifier head that is not shipped)."""
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    probe = torch.nn.Linear(config.vision_hidden, NUM_CLASSES)
    params = [*tower.parameters(), *projector.parameters(), *probe.parameters()]
    opt = torch.optim.AdamW(params, lr=config.vision_lr, weight_decay=0.01)
    spread = torch.cdist(prompts.flatten(1), prompts.flatten(1)).pow(2) / prompts[0].numel()
    temperature = float(spread.sum() / (NUM_CLASSES * (NUM_CLASSES - 1))) / 10  # mean gap -> 10 nats
    start = time.perf_counter()
    tower.train()
    for step in range(config.vision_steps):
        pixels, labels = images.batch(config.vision_batch)
        labels = torch.from_numpy(labels)
        hidden = features(tower, pixels)
        image = projector(hidden)
        distance = (image.flatten(1)[:, None] - prompts.flatten(1)[None]).pow(2).mean(-1)  # [B, 10]
        mse = distance.gather(1, labels[:, None]).mean()
        loss = (
            F.cross_entropy(probe(hidden.mean(1)), labels)
            + F.cross_entropy(-distance / temperature, labels)
            + mse / temperature
        )
        for group in opt.param_groups:
            group["lr"] = lr_at(step, config.vision_steps, 20, config.vision_lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 200 == 0:
            right = float((distance.argmin(1) == labels).float().mean())
            print(f"vision {step + 1}/{config.vision_steps} loss {loss.item():.4f} batch right {right:.2f}", flush=True)
    tower.eval()
    stats["vision"] = {"seconds": round(time.perf_counter() - start, 1), "loss": round(loss.item(), 4)}


def features(tower: Any, pixels: torch.Tensor) -> torch.Tensor:
    """The tower's patch features the projector reads, as LlavaModel.get_image_features selects
    them (vision_feature_layer, CLS dropped)."""
    return tower(pixels, output_hidden_states=True, return_dict=True).hidden_states[FEATURE_LAYER][:, 1:]


def tune_through_lm(model: Any, answers: Answers, images: TrainImages, config: TrainConfig, stats: dict) -> None:
    """Stage 3: the tower and the projector on the answer loss through the frozen language model."""
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    params = [*tower.parameters(), *projector.parameters()]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    rng = np.random.default_rng(config.seed + 1)
    start = time.perf_counter()
    losses = []
    for step in range(config.steps):
        pixels, labels = images.batch(config.batch_size)
        layouts = rng.integers(0, len(LAYOUTS), config.batch_size)
        loss, exact = answer_loss(
            *answers.logits(projector(features(tower, pixels)), torch.from_numpy(labels), layouts)
        )
        for group in opt.param_groups:
            group["lr"] = lr_at(step, config.steps, 3, config.lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        print(f"answers {step + 1}/{config.steps} loss {loss.item():.4f} exact {exact:.2f}", flush=True)
    stats["answers"] = {
        "seconds": round(time.perf_counter() - start, 1),
        "loss": round(float(np.mean(losses[-5:])), 4) if losses else None,
    }


def train(config: TrainConfig) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(LLaVA model with the trained tower and projector, tokenizer, language model, stats)."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(config.seed)
    start = time.perf_counter()
    tokenizer, lm = load_language_model()
    model = LlavaForConditionalGeneration(build_config(lm.config, config))
    attach_language_model(model, lm)
    model.requires_grad_(False)
    model.model.vision_tower.requires_grad_(True)
    model.model.multi_modal_projector.requires_grad_(True)
    images = TrainImages(image_processor(), config.seed)
    stats: dict[str, Any] = {"setup_seconds": round(time.perf_counter() - start, 1)}
    answers = Answers(tokenizer, lm)
    prompts = fit_prompts(answers, config, stats)
    fit_vision(model, images, prompts, config, stats)
    tune_through_lm(model, answers, images, config, stats)
    return model.eval(), tokenizer, lm, stats


# -- saving and evaluating ----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    for field in fields(TrainConfig):  # --prompt-steps, --vision-lr, ...
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    parser.add_argument("--threads", type=int, default=1)  # 2 threads on a shared 2-core machine: erratic
    parser.add_argument("--no-eval", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = TrainConfig(**{field.name: getattr(args, field.name) for field in fields(TrainConfig)})
    start = time.perf_counter()
    model, tokenizer, lm, stats = train(config)
    save_folder(model, args.out)
    total = time.perf_counter() - start
    trained = {
        **asdict(config),
        **stats,
        "total_seconds": round(total, 1),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    print(json.dumps({"trained": trained}), flush=True)
    results = {} if args.no_eval else evaluate(args.out, tokenizer, lm)
    print(json.dumps({"accuracy": results}), flush=True)
    write_readme(args.out, trained, results)


if __name__ == "__main__":
    main()
