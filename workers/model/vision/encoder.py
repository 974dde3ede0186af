"""A multimodal model's encoder step: image files in, the rows that replace their placeholders out.

    files ──decode (PIL)──▶ the model folder's image processor (transformers', as HF runs it)
          ──▶ pixel values ──▶ the vision tower and projector, all images of the step at once
          ──▶ one [placeholders, hidden] tensor per image

The language model never sees the tower: `ImageEncoder` is held beside it (`CausalLM.image_encoder`),
not inside it, so nothing that walks the model's modules (weight packing, LoRA, quantization)
touches the tower's weights.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from PIL import Image

from pagemesh.common.multimodal import ImageSpec, multimodal_kind

# checkpoint prefixes of a multimodal folder's language model -> the text-only names CausalLM loads
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),  # LLaVA as transformers saves it, and hub checkpoints
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),  # transformers 5's own names
)


class ImageEncoder:
    """The vision side of the multimodal model in `folder`, in `dtype` on `device`. `encode`
    takes (file bytes, grid) per image and returns each image's rows in the LM's hidden size."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device):
        from transformers import AutoImageProcessor

        self.folder = folder
        self.device = device
        self.spec = ImageSpec.from_folder(folder)
        cfg = json.loads((folder / "config.json").read_text())
        self.kind = multimodal_kind(cfg)
        self.processor = AutoImageProcessor.from_pretrained(str(folder))
        with torch.device(device):
            if self.kind == "llava":
                from pagemesh.workers.model.vision.clip import LlavaVision

                self.tower = LlavaVision(cfg).to(dtype)
            else:
                from pagemesh.workers.model.vision.qwen2_vl import Qwen2VLVision

                self.tower = Qwen2VLVision(cfg["vision_config"], dtype=dtype, device=device)
        self.tower.eval()
        self.dtype = dtype

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the vision tensors of a checkpoint's (name, tensor) pairs; ValueError naming any
        the tower needs and did not get."""
        for name, tensor in weights:
            self.tower.load_tensor(name, tensor)
        missing = self.tower.missing() if self.kind == "llava" else self.tower.missing_tensors()
        if missing:
            raise ValueError(f"model: checkpoint lacks {len(missing)} vision tensors, e.g. {sorted(missing)[:3]}")

    @torch.inference_mode()
    def encode(self, images: list[tuple[bytes, list[int]]]) -> list[torch.Tensor]:
        """Each image's rows [placeholders, hidden], in order, from one batched tower call.
        ValueError where the processor's patch grid is not the one the tokenizer counted."""
        pils = [_decode(data) for data, _ in images]
        batch = self.processor(images=pils, return_tensors="pt")
        pixels = batch["pixel_values"].to(self.device, self.dtype)
        if self.kind == "llava":
            return list(self.tower(pixels).unbind(0))
        grids = [[int(v) for v in g] for g in batch["image_grid_thw"].tolist()]
        for (_, expected), grid in zip(images, grids, strict=True):
            if list(expected) != grid:
                raise ValueError(f"image grid {grid} differs from the placeholders' {list(expected)}")
        out = self.tower(pixels, grids)
        return list(out.split(self.tower.output_rows(grids)))


def _decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB") if image.mode not in ("RGB",) else image


def text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A multimodal checkpoint's language-model tensors under text-only names (CausalLM's); the
    vision tensors are left out (ImageEncoder.load takes them)."""
    for name, tensor in weights:
        for prefix, text in _TEXT_PREFIXES:
            if name.startswith(prefix):
                yield text + name[len(prefix) :], tensor
                break
        else:
            if name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")):
                yield name, tensor  # Qwen2-VL as transformers saves it: the LM at the top
