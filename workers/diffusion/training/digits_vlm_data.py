"""digits-vlm's data (train_digits_vlm.py trains it): its constants, the prompts the served
model sees (the GGUF's chat template over the image placeholder and the user's text, in every
layout), and the digits as the server will see them (8x8 -> nearest-neighbour PNG ->
CLIPImageProcessor), with the training images' shifts."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagemesh.workers.diffusion.png import to_png_b64
from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES, train_split

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
