"""What the class-conditional pipelines share (pipelines/dit.py: a DiT; pipelines/class_unet.py:
a U-Net): the prompt names a class, the serving defaults of the folder's pagemesh.json, and the
checks a request gets before it runs.

The prompt names a class: the labels of id2label (comma-separated synonyms) are matched as whole
words, case-insensitively, longest first, so "a handwritten 7", "the digit seven" and "7" are all
class 7. The conditioning row of an image is its class id; the null class is the unconditional
row, unless the negative prompt names a class, which then takes its place. A folder without
pagemesh.json serves its native size with DiTPipeline's defaults (FALLBACK_SERVING);
"max_guidance_scale" caps the guidance of a model with guidance distilled in.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from pagemesh.common.messages import ImageModelInfo, ImageParams
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest, Resolved
from pagemesh.workers.diffusion.pipelines.common import KNOWN_SAMPLERS, SAMPLERS, ServingDefaults, resolve_request

FALLBACK_SERVING = {"default_steps": 50, "default_sampler": "ddim", "default_guidance_scale": 4.0}


class ClassLabels:
    """id2label's synonyms -> class ids, and the one class a prompt names."""

    def __init__(self, id2label: dict[str, str]):
        self.by_label: dict[str, int] = {}  # a label listed under two ids: the last wins, as in DiTPipeline
        for key, value in id2label.items():
            for label in value.split(","):
                if label.strip():
                    self.by_label[label.strip().lower()] = int(key)
        # Longest first: "tiger shark" claims its words before "tiger" can.
        labels = sorted(self.by_label, key=len, reverse=True)
        self.pattern = re.compile(r"(?<!\w)(" + "|".join(re.escape(label) for label in labels) + r")(?!\w)", re.I)

    def classes_in(self, text: str) -> set[int]:
        return {self.by_label[m.group(1).lower()] for m in self.pattern.finditer(text)}


class ClassConditionedPipeline:
    """The request side of a class-conditional ImagePipeline. A subclass sets `name`, `device`,
    `latent_shape` and `native_size`, then calls `serve_classes`."""

    name: str
    device: torch.device
    latent_shape: tuple[int, ...]
    native_size: tuple[int, int]

    def serve_classes(
        self, serving: dict[str, Any], scheduler_config: dict[str, Any], id2label: dict[str, str], null_class: int
    ) -> None:
        """The labels, the null class and the serving defaults (`serving`: pagemesh.json's keys)."""
        self.labels = ClassLabels(id2label)
        self.null_class = null_class
        native = f"{self.native_size[0]}x{self.native_size[1]}"
        self.sizes: list[str] = list(serving.get("sizes", [native]))
        self.samplers: list[str] = [s for s in serving.get("samplers", SAMPLERS) if s in KNOWN_SAMPLERS]
        self.default_steps = int(serving.get("default_steps", FALLBACK_SERVING["default_steps"]))
        self.default_sampler = str(serving.get("default_sampler", FALLBACK_SERVING["default_sampler"]))
        self.default_guidance = float(serving.get("default_guidance_scale", FALLBACK_SERVING["default_guidance_scale"]))
        self.max_steps = int(serving.get("max_steps", scheduler_config.get("num_train_timesteps", 1000)))
        # what resolve_request (pipelines/common.py) checks a request against, as the text pipelines'
        self.serving = ServingDefaults(
            sizes=tuple(_size(size) for size in self.sizes),
            samplers=tuple(self.samplers),
            default_sampler=self.default_sampler,
            default_steps=self.default_steps,
            max_steps=self.max_steps,
            guidance_scale=self.default_guidance,
        )
        # A model with guidance distilled in answers one row per image: a guidance scale above 1
        # would add uncond rows it was never trained to be combined with, so it is refused (a
        # silent no-op would hand back the same image for 1 and for 7, which nobody asking expects).
        cap = serving.get("max_guidance_scale")
        self.max_guidance: float | None = None if cap is None else float(cap)
        example = next(iter(id2label.values())).split(",")[0].strip()
        self.conditioning = str(serving.get("conditioning", f"the prompt must name one class label, e.g. '{example}'"))
        self.info = ImageModelInfo(
            sizes=self.sizes,
            samplers=self.samplers,
            default_sampler=self.default_sampler,
            default_steps=self.default_steps,
            max_steps=self.max_steps,
            conditioning=self.conditioning,
        )

    # -- what a request may ask ------------------------------------------------------------

    def class_of(self, prompt: str) -> int:
        """The one class the prompt names; InvalidImageRequest when it names none or several."""
        found = self.labels.classes_in(prompt)
        if len(found) != 1:
            why = "names no class" if not found else f"names {len(found)} different classes"
            raise InvalidImageRequest(f"the prompt {why}: {self.conditioning}", param="prompt")
        return found.pop()

    def negative_class(self, negative_prompt: str | None) -> int:
        """The uncond row's class: the null class unless the negative prompt names one."""
        found = self.labels.classes_in(negative_prompt or "")
        if len(found) > 1:
            raise InvalidImageRequest(
                f"the negative prompt names {len(found)} different classes; it may name at most one",
                param="negative_prompt",
            )
        return found.pop() if found else self.null_class

    def resolve(self, params: ImageParams) -> Resolved:
        """The size, steps, sampler and guidance as every pipeline checks them (one latent shape:
        the model's), then the guidance cap and the classes the prompts name."""
        resolved = resolve_request(params, self.serving, lambda width, height: self.latent_shape)
        guidance = resolved.guidance_scale
        if self.max_guidance is not None and guidance > self.max_guidance:
            raise InvalidImageRequest(
                f"guidance_scale must be <= {self.max_guidance:g} for {self.name}: its classifier-free guidance "
                f"is distilled in; got {guidance:g}",
                param="guidance_scale",
            )
        self.class_of(params.prompt)
        self.negative_class(params.negative_prompt)
        return resolved

    def encode_prompt(self, prompt: str, negative_prompt: str | None) -> tuple[int, int]:
        return self.class_of(prompt), self.negative_class(negative_prompt)

    def stack(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)


def _size(text: str) -> tuple[int, int]:
    """'WxH' (a size pagemesh.json lists) -> (W, H)."""
    width, height = text.split("x")
    return int(width), int(height)
