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
import base64
import io
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagemesh.workers.diffusion.png import to_png_b64
from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES, heldout_split, train_split

IMAGE_TOKEN = "<empty_output>"
IMAGE_TOKEN_ID = 16
IMAGE_SIZE = 32
PATCH_SIZE = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16: the CLS token is dropped ("default")
FEATURE_LAYER = -1  # the last encoder layer's output (before post_layernorm)
END_OF_TURN_ID = 2  # <|im_end|>
TRAIN_SIZES = (32, 64, 128, 256)
TEXTS = (
    "What digit is this?",
    "Which number is shown in the image?",
    "Name the digit.",
    "What is this?",
    "Read the digit in this picture.",
)
# (text, image first): every phrasing on either side of the image, and the image alone
LAYOUTS: tuple[tuple[str | None, bool], ...] = (
    *((text, True) for text in TEXTS),
    *((text, False) for text in TEXTS),
    (None, True),
)
CANONICAL = LAYOUTS[0]  # "<image>\nWhat digit is this?"
PROCESSOR = {
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"shortest_edge": IMAGE_SIZE},
    # BOX: a nearest-upscaled 8x8 digit at any multiple of 32 px comes back as exact 4x4 blocks
    # (bilinear and bicubic blur the blocks' edges when they shrink).
    "resample": 4,
    "do_center_crop": True,
    "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    "do_rescale": True,
    "do_normalize": True,
}
# What the text config keeps of the GGUF's LlamaConfig (the rest is loading noise).
TEXT_CONFIG_DROP = (
    "transformers_version",
    "architectures",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "dtype",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "_name_or_path",
    "_model_name_or_path",
    "quantization_config",
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    seed: int = 0
    # 1. one soft prompt (16 embeddings) per digit, through the frozen language model
    prompt_steps: int = 36
    prompt_rows: int = 30  # 3 of each digit, layouts drawn
    prompt_lr: float = 1e-2
    prompt_noise: float = 0.03  # Gaussian noise on the prompts while they are fitted
    prompt_blend: float = 0.4  # and blends towards another digit's prompt, by up to this much
    # 2. the tower and the projector onto those prompts, no language model
    vision_steps: int = 1200
    vision_batch: int = 128
    vision_lr: float = 2e-3
    # 3. the tower and the projector through the frozen language model (answer loss)
    steps: int = 15
    batch_size: int = 32
    lr: float = 1e-4
    # the vision tower
    vision_hidden: int = 128
    vision_intermediate: int = 256
    vision_layers: int = 2
    vision_heads: int = 4


# -- the language model and the prompts ---------------------------------------------------------


def load_language_model() -> tuple[Any, Any]:
    """(tokenizer, LlamaForCausalLM fp32) of the embedded default GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from pagemesh.common.model_files import default_model_path

    path = default_model_path()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    return tokenizer, lm.eval().requires_grad_(False)


def user_content(text: str | None, image_first: bool) -> str:
    """The user message as the server builds it: the parts joined by newlines, in their order."""
    if text is None:
        return IMAGE_TOKEN
    return f"{IMAGE_TOKEN}\n{text}" if image_first else f"{text}\n{IMAGE_TOKEN}"


def prompt_ids(tokenizer: Any, text: str | None, image_first: bool) -> list[int]:
    """The chat template's prompt (generation prompt added) with the placeholder expanded."""
    messages = [{"role": "user", "content": user_content(text, image_first)}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    if ids.count(IMAGE_TOKEN_ID) != 1:
        raise ValueError(f"expected one {IMAGE_TOKEN} in the prompt, got {ids.count(IMAGE_TOKEN_ID)}")
    at = ids.index(IMAGE_TOKEN_ID)
    return ids[:at] + [IMAGE_TOKEN_ID] * IMAGE_TOKENS + ids[at + 1 :]


def digit_ids(tokenizer: Any) -> list[int]:
    ids = [tokenizer.encode(str(d), add_special_tokens=False) for d in range(NUM_CLASSES)]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"each numeral should be one token: {ids}")
    return [i[0] for i in ids]


# -- the images ---------------------------------------------------------------------------------


def image_processor() -> Any:
    from transformers.models.clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(**PROCESSOR)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[n, 1, 8, 8] in [-1, 1] -> uint8 [n, 8, 8, 1], as the DiT pipeline decodes its samples."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def png_image(image: np.ndarray, size: int):
    """uint8 [8, 8, 1] -> the PIL image a client's PNG of `size` px decodes to ("L")."""
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(to_png_b64(image, size, size))))


def shift(image: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """Moves an [8, 8, 1] image by (dy, dx) pixels, filling with background (0)."""
    out = np.zeros_like(image)
    h, w = image.shape[:2]
    out[max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = image[
        max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
    ]
    return out


SHIFTS = tuple((dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1))  # (0, 0) is SHIFTS[4]


class TrainImages:
    """The training split as the model will see it when served: every image, and each of its
    eight one-pixel shifts, as a PNG of a seeded random size in TRAIN_SIZES, through the image
    processor ([n, 9, 3, 32, 32], made once). A batch draws images, half of them unshifted."""

    def __init__(self, processor: Any, seed: int):
        data = train_split()
        images = to_uint8(data.images)
        self.labels = data.labels.numpy()
        self.rng = np.random.default_rng(seed)
        pixels = []
        for image in images:
            pictures = [png_image(shift(image, dy, dx), int(self.rng.choice(TRAIN_SIZES))) for dy, dx in SHIFTS]
            pixels.append(processor(images=pictures, return_tensors="pt")["pixel_values"])
        self.pixels = torch.stack(pixels)

    def batch(self, size: int) -> tuple[torch.Tensor, np.ndarray]:
        idx = self.rng.integers(0, len(self.labels), size)
        shifted = self.rng.integers(0, len(SHIFTS), size)
        which = np.where(self.rng.random(size) < 0.5, SHIFTS.index((0, 0)), shifted)
        return self.pixels[torch.from_numpy(idx), torch.from_numpy(which)], self.labels[idx]


# -- the model ----------------------------------------------------------------------------------


def build_config(lm_config: Any, config: TrainConfig) -> Any:
    from transformers import CLIPVisionConfig, LlavaConfig

    text = {k: v for k, v in lm_config.to_dict().items() if k not in TEXT_CONFIG_DROP}
    vision = CLIPVisionConfig(
        hidden_size=config.vision_hidden,
        intermediate_size=config.vision_intermediate,
        projection_dim=config.vision_hidden,
        num_hidden_layers=config.vision_layers,
        num_attention_heads=config.vision_heads,
        num_channels=3,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    llava = LlavaConfig(
        vision_config=vision.to_dict(),
        text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=IMAGE_TOKENS,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=FEATURE_LAYER,
        multimodal_projector_bias=True,
        tie_word_embeddings=True,
    )
    llava.architectures = ["LlavaForConditionalGeneration"]
    llava.pagemesh_text_weights = "default"
    return llava


def vision_state(model: Any) -> dict[str, torch.Tensor]:
    """The tensors a LLaVA checkpoint stores for the tower and the projector, under the names
    LlavaForConditionalGeneration.save_pretrained writes ("vision_tower.…",
    "multi_modal_projector.…": its `model.` prefix is dropped)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            out[name.removeprefix("model.")] = tensor.detach().clone()
    return out


def attach_language_model(model: Any, lm: Any) -> Any:
    """Copies the GGUF language model's weights into a LLaVA model (the lm_head is tied)."""
    model.model.language_model.load_state_dict(lm.model.state_dict())
    head = model.get_output_embeddings().weight
    if head.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr():
        head.data.copy_(lm.lm_head.weight)
    return model


def load_folder(folder: Path, lm: Any, dtype: torch.dtype = torch.float32) -> Any:
    """The shipped folder as HF loads it, with the GGUF's language model in it."""
    from transformers import LlavaForConditionalGeneration
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the language model's weights are missing on purpose
    hf_logging.disable_progress_bar()
    try:
        model, info = LlavaForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    if info["unexpected_keys"] or any(
        not k.startswith(("model.language_model.", "lm_head.")) for k in info["missing_keys"]
    ):
        raise RuntimeError(f"unexpected loading info: {info}")
    return attach_language_model(model, lm).to(dtype).eval()


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


def save_folder(model: Any, out: Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    image_processor().save_pretrained(out)
    tensors = {k: v.to(dtype).contiguous() for k, v in sorted(vision_state(model).items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)


@torch.no_grad()
def answers(
    model: Any, tokenizer: Any, images: list[Any], layout: tuple[str | None, bool], batch: int = 50
) -> list[str]:
    """Greedy answers (special tokens kept) of the model to one prompt over PIL images."""
    processor = image_processor()
    ids = torch.tensor([prompt_ids(tokenizer, *layout)])
    out = []
    for i in range(0, len(images), batch):
        chunk = images[i : i + batch]
        pixels = processor(images=chunk, return_tensors="pt")["pixel_values"].to(model.dtype)
        input_ids = ids.expand(len(chunk), -1)
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=pixels,
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=END_OF_TURN_ID,
        )
        out += tokenizer.batch_decode(generated[:, input_ids.shape[1] :], skip_special_tokens=False)
    return out


def accuracy(model: Any, tokenizer: Any, images: list[Any], labels: list[int], layouts: list[tuple]) -> float:
    """Share of images answered exactly "<digit><|im_end|>"; image i asks with layouts[i % len]."""
    right = 0
    for k, layout in enumerate(layouts):
        picked = list(range(k, len(images), len(layouts)))
        said = answers(model, tokenizer, [images[i] for i in picked], layout)
        right += sum(s == f"{labels[i]}<|im_end|>" for i, s in zip(picked, said, strict=True))
    return right / len(images)


def dit_digits(per_digit: int = 10, size: int = 256) -> tuple[list[Any], list[int]]:
    """`per_digit` digits of each class drawn by the embedded DiT at its defaults, as PNGs of
    `size` px (seeded)."""
    from pagemesh.common.messages import ImageParams
    from pagemesh.workers.diffusion.engine.config import EngineConfig
    from pagemesh.workers.diffusion.engine.engine import DiffusionEngine
    from pagemesh.workers.diffusion.engine.jobs import ImageJob
    from pagemesh.workers.diffusion.pipelines.embedded import DIGITS_NAME
    from pagemesh.workers.diffusion.pipelines.loader import load_pipeline

    engine = DiffusionEngine(load_pipeline(DIGITS_NAME), EngineConfig(max_running=10, max_batch_rows=200))
    for digit in range(NUM_CLASSES):
        params = ImageParams(
            prompt=f"a handwritten {digit}",
            negative_prompt=None,
            n=per_digit,
            width=None,
            height=None,
            num_inference_steps=None,
            guidance_scale=None,
            sampler=None,
            seed=7000 + digit,
        )
        engine.add(ImageJob(request_id=str(digit), params=params, arrival=0.0))
    finished = []
    while engine.has_work():
        finished += engine.step()
    images, labels = [], []
    for job in sorted(finished, key=lambda f: int(f.request_id)):
        for image in job.images.numpy():
            images.append(png_image(image, size))
            labels.append(int(job.request_id))
    return images, labels


def evaluate(folder: Path, tokenizer: Any, lm: Any, *, bf16: bool = True) -> dict[str, Any]:
    heldout = heldout_split()
    pictures = to_uint8(heldout.images)
    labels = heldout.labels.tolist()
    sizes = [TRAIN_SIZES[i % len(TRAIN_SIZES)] for i in range(len(labels))]
    images = [png_image(p, s) for p, s in zip(pictures, sizes, strict=True)]
    results: dict[str, Any] = {"heldout_images": len(labels)}
    start = time.perf_counter()
    model = load_folder(folder, lm, torch.float32)
    results["heldout_fp32_canonical"] = accuracy(model, tokenizer, images, labels, [CANONICAL])
    results["heldout_fp32_all_layouts"] = accuracy(model, tokenizer, images, labels, list(LAYOUTS))
    dit_images, dit_labels = dit_digits()
    results["dit_images"] = len(dit_labels)
    results["dit_fp32_canonical"] = accuracy(model, tokenizer, dit_images, dit_labels, [CANONICAL])
    if bf16:
        model = model.to(torch.bfloat16)
        results["heldout_bf16_canonical"] = accuracy(model, tokenizer, images, labels, [CANONICAL])
    results["eval_seconds"] = round(time.perf_counter() - start, 1)
    return results


README = """# digits-vlm

A small vision-language model that names the digit in a picture: a Hugging Face LLaVA checkpoint
(`LlavaForConditionalGeneration`) made of

- the embedded default language model, SmolLM2-135M-Instruct, frozen. Its weights and tokenizer
  are **not stored here**: they are the embedded GGUF (`"pagemesh_text_weights": "default"` in
  config.json); `text_config` is that GGUF's LlamaConfig;
- a tiny CLIP vision tower (32x32 RGB in, 8x8 patches, {layers} layers, hidden {hidden}) whose
  last layer's 16 patch features (`vision_feature_layer` -1, strategy "default": CLS dropped)
  go through
- the LLaVA projector (gelu MLP {hidden} -> 576 -> 576): 16 image tokens.

`model.safetensors` holds only `vision_tower.*` and `multi_modal_projector.*` ({parameters:,}
parameters, bf16), under the names `save_pretrained` writes.

**Prompt.** SmolLM2 has no `<image>` token: the placeholder is `<empty_output>` (id 16,
`image_token_index`), a special token the chat model never emits. The prompt is the GGUF's chat
template (its default system prompt included) over one user message whose content is the
placeholder and the user's text joined by "\\n" in their order, e.g. `<empty_output>\\nWhat digit
is this?`, with the generation prompt; the one placeholder is expanded to 16 before the model
sees it. The answer is the numeral and end of turn: `7<|im_end|>`.

**Images.** `preprocessor_config.json` is a CLIPImageProcessor (the PIL one; torchvision is not
needed): RGB, shortest edge to 32 with BOX resampling, center crop 32x32, rescale, CLIP's
mean/std. BOX gives a digit upscaled nearest-neighbour from 8x8 to any multiple of 32 px (the
DiT's PNGs: 64, 128, 256, 512) back as exact 4x4 blocks.

## Training

    python -P -m pagemesh.workers.diffusion.training.train_digits_vlm --out DIR

workers/diffusion/training/train_digits_vlm.py, seeded: {total:.0f} s in all on {threads} CPU
thread of a shared 2-core machine (torch {torch}), then {eval_seconds} s of evaluation. Data:
scikit-learn's digits in the split of workers/diffusion/training/digits_data.py (1,497 train,
300 held out); each training image and its eight one-pixel shifts as greyscale PNGs of a random
size in 32-256 px (workers/diffusion/png.py), through the image processor.

1. A soft prompt (16 embeddings) per digit that makes the frozen language model answer it, in
   every layout: "What digit is this?", "Which number is shown in the image?", "Name the
   digit.", "What is this?", "Read the digit in this picture." before or after the image, and
   the image alone. Loss on the answer tokens only, under noise and blends towards the other
   digits' prompts: {prompt_steps} steps of {prompt_rows} rows, {prompt_seconds:.0f} s, final loss {prompt_loss}.
2. The vision tower and the projector (AdamW) make each image its digit's prompt: squared error
   and a softmax over the distances to the ten prompts, plus a linear probe on the tower (not
   shipped). {vision_steps} steps of {vision_batch} images, {vision_seconds:.0f} s, final loss {vision_loss}.
3. The tower and the projector on the answer loss through the frozen language model (the system
   prompt's keys and values, the same in every row, computed once): {steps} steps of
   {batch_size}, {answer_seconds:.0f} s, final loss {answer_loss}.

## Accuracy

Greedy answers of this folder loaded as HF loads it (the language model from the GGUF), right
when exactly `<digit><|im_end|>`:

| images | prompt | fp32 | bf16 |
| --- | --- | --- | --- |
| {n_heldout} held-out digits, PNG 32-256 px | `<image>\\nWhat digit is this?` | {h32} | {h16} |
| {n_heldout} held-out digits, PNG 32-256 px | each of the 11 layouts in turn | {all32} | |
| {n_dit} digits by digits-dit (10 per class, defaults), PNG 256 px | `<image>\\nWhat digit is this?` | {dit32} | |

The DiT's digits are counted against the class asked for, whether or not the DiT drew it well.
The model knows only digits like scikit-learn's 8x8 scans (light strokes on black); any other
picture still gets a digit.
"""


def write_readme(out: Path, trained: dict[str, Any], results: dict[str, Any]) -> None:
    """DIR/README.md: what the folder is, how it was trained (this run's record), its accuracy."""
    from safetensors.torch import load_file

    def percent(key: str) -> str:
        return f"{100 * results[key]:.1f}%" if key in results else "not measured"

    text = README.format(
        layers=trained["vision_layers"],
        hidden=trained["vision_hidden"],
        parameters=sum(t.numel() for t in load_file(out / "model.safetensors").values()),
        total=trained["total_seconds"],
        threads=trained["threads"],
        torch=trained["torch"],
        eval_seconds=results.get("eval_seconds", "no"),
        prompt_steps=trained["prompt_steps"],
        prompt_rows=trained["prompt_rows"],
        prompt_seconds=trained["prompts"]["seconds"],
        prompt_loss=trained["prompts"]["loss"],
        vision_steps=trained["vision_steps"],
        vision_batch=trained["vision_batch"],
        vision_seconds=trained["vision"]["seconds"],
        vision_loss=trained["vision"]["loss"],
        steps=trained["steps"],
        batch_size=trained["batch_size"],
        answer_seconds=trained["answers"]["seconds"],
        answer_loss=trained["answers"]["loss"],
        n_heldout=results.get("heldout_images", 300),
        n_dit=results.get("dit_images", 100),
        h32=percent("heldout_fp32_canonical"),
        h16=percent("heldout_bf16_canonical"),
        all32=percent("heldout_fp32_all_layouts"),
        dit32=percent("dit_fp32_canonical"),
    )
    (out / "README.md").write_text(text)


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
