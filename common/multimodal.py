"""Images in prompts: what the gateway, the tokenizer, the scheduler and the workers agree on.

    gateway    image_url part ──▶ the file's bytes; IMAGE_MARK where it stood in the text
    tokenizer  IMAGE_MARK ──▶ the model's image prompt text (ImageSpec.prompt_text) ──▶ the chat
               template ──▶ ids; each image token widened to its run of placeholders
               (ImageSpec.placeholders: a fixed count, or the size's patch grid) ──▶ ImageInput
    worker     its encoder step turns each image into rows that replace its placeholders
    everyone   prefix-cache keys over `hash_token_ids`: placeholders stand for their image's
               content, so the same image hits and another image behind the same ids misses

Pure Python (no torch, no zmq): the tokenizer and the scheduler read it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagemesh.common.mrope import image_grid, image_tokens, mrope_positions
from pagemesh.common.vision_configs import llava_tokens_per_image

IMAGE_MARK = "\ue000"  # a private-use character: where an image part stood in a message's text

# HF architecture -> our name for how its images enter the language model
MULTIMODAL_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava", "Qwen2VLForConditionalGeneration": "qwen2_vl"}
# a LLaVA text_config's model_type -> the HF architecture of its language model
_LLAVA_TEXT_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
QWEN2_VL_TEXT = "Qwen2VLTextForCausalLM"  # Qwen2-VL's language model: Qwen2 with M-RoPE (model_families.py)
TEXT_WEIGHTS_KEY = "pagemesh_text_weights"  # config.json: "default" = the LM is the embedded GGUF (digits-vlm)


def multimodal_kind(cfg: dict) -> str | None:
    archs = cfg.get("architectures") or []
    return MULTIMODAL_ARCHITECTURES.get(archs[0]) if archs else None


def text_config(cfg: dict) -> dict:
    """The language model's config of a multimodal config.json, as a text-only config.json
    (with `architectures`); a text-only config as it is."""
    kind = multimodal_kind(cfg)
    if kind is None:
        return cfg
    if kind == "llava":
        text = dict(cfg.get("text_config") or {})
        model_type = text.get("model_type", "llama")
        if model_type not in _LLAVA_TEXT_MODELS:
            raise ValueError(f"model: LLaVA with a {model_type!r} language model is not supported")
        text["architectures"] = [_LLAVA_TEXT_MODELS[model_type]]
        return text
    # Qwen2-VL: older configs keep the text fields at the top, transformers 5 in text_config
    text = {k: v for k, v in cfg.items() if k not in ("vision_config", "text_config")}
    text.update(cfg.get("text_config") or {})
    text["architectures"] = [QWEN2_VL_TEXT]
    for key in ("rope_scaling", "rope_parameters"):  # M-RoPE's sections: the family reads them
        params = text.get(key)
        if isinstance(params, dict) and "mrope_section" in params:
            text["mrope_section"] = params["mrope_section"]
            plain = {k: v for k, v in params.items() if k != "mrope_section"}
            for name in ("type", "rope_type"):
                if plain.get(name) == "mrope":
                    plain[name] = "default"
            text[key] = plain
    return text


@dataclass(frozen=True)
class ImageSpec:
    """How a multimodal model takes images: its placeholder token (and Qwen2-VL's vision start
    and end tokens around each image), how many placeholders an image of a given size becomes,
    and the limits the tokenizer checks before any pixel is decoded."""

    kind: str  # "llava" | "qwen2_vl"
    image_token_id: int
    start_token_id: int | None = None  # written before each image's placeholders (Qwen2-VL)
    end_token_id: int | None = None
    tokens_per_image: int = 0  # LLaVA: every image the same; 0 where the size decides (Qwen2-VL)
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_folder(cls, folder: Path) -> ImageSpec | None:
        """The spec of the model in `folder` (config.json and preprocessor_config.json); None
        for a text-only model or a GGUF file."""
        if not folder.is_dir():
            return None
        cfg = json.loads((folder / "config.json").read_text())
        kind = multimodal_kind(cfg)
        if kind is None:
            return None
        pre_path = folder / "preprocessor_config.json"
        pre = json.loads(pre_path.read_text()) if pre_path.exists() else {}
        if kind == "llava":
            token = cfg.get("image_token_index", cfg.get("image_token_id"))
            return cls("llava", int(token), tokens_per_image=llava_tokens_per_image(cfg))
        vision = cfg.get("vision_config") or {}
        size = pre.get("size") or {}
        return cls(
            "qwen2_vl",
            int(cfg["image_token_id"]),
            start_token_id=cfg.get("vision_start_token_id"),
            end_token_id=cfg.get("vision_end_token_id"),
            patch_size=int(pre.get("patch_size", vision.get("patch_size", 14))),
            merge_size=int(pre.get("merge_size", vision.get("spatial_merge_size", 2))),
            temporal_patch_size=int(pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2))),
            min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        )

    def placeholders(self, width: int, height: int) -> tuple[int, list[int]]:
        """(placeholder tokens, grid) for an image of `width` × `height` pixels; ValueError
        for a size the model cannot take."""
        if self.kind == "llava":
            return self.tokens_per_image, []
        grid = image_grid(
            height, width, self.patch_size, self.merge_size, self.min_pixels, self.max_pixels, self.temporal_patch_size
        )
        return image_tokens(grid, self.merge_size), list(grid)


def image_digest(data: bytes) -> str:
    """The content hash that keys an image in the encoder cache and the prefix cache."""
    return hashlib.sha256(data).hexdigest()


def hash_token_ids(token_ids: Sequence[int], images: Sequence) -> list[int]:
    """The ids prefix-cache keys are computed over: `token_ids` with each image's placeholders
    replaced by negative values drawn from its digest (no token id is negative), so equal keys
    mean equal text and equal images. `images`: ImageInput-like (digest, offset, length)."""
    if not images:
        return list(token_ids)
    out = list(token_ids)
    for image in images:
        base = int(image.digest[:15], 16)  # 60 bits: base + position stays inside int64
        for k in range(image.length):
            out[image.offset + k] = -1 - base - k
    return out


@dataclass(frozen=True)
class MRopePositions:
    """An M-RoPE prompt's (temporal, height, width) positions, and the `delta` every position
    after it is shifted by (a token at index i >= len(prompt) sits at i + delta on all three)."""

    prompt: tuple[list[int], list[int], list[int]]
    delta: int

    @classmethod
    def of(cls, token_ids: Sequence[int], image_token_id: int, images: Sequence, merge_size: int) -> MRopePositions:
        """`images`: ImageInput-like (grid), in prompt order."""
        streams, delta = mrope_positions(list(token_ids), image_token_id, [tuple(i.grid) for i in images], merge_size)
        return cls(tuple(streams), delta)

    def rows(self, start: int, count: int) -> list[list[int]]:
        """The three positions of indices [start, start + count)."""
        n = len(self.prompt[0])
        out = []
        for stream in self.prompt:
            inside = stream[start : min(start + count, n)]
            out.append(inside + [i + self.delta for i in range(max(start, n), start + count)])
        return out
