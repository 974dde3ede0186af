"""Generated images to what the OpenAI response carries: base64 PNG, at the size asked for
(a model's native images upscaled nearest-neighbour, so an 8×8 digit stays crisp at 256×256)."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def to_png_b64(image: np.ndarray, width: int, height: int) -> str:
    """uint8 [H, W, C] (C = 1 or 3) -> base64 PNG of `width` × `height`."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in (1, 3, 4):
        raise ValueError(f"expected uint8 [H, W, 1|3|4], got {image.dtype} {list(image.shape)}")
    pil = Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)
    if pil.size != (width, height):
        pil = pil.resize((width, height), Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    pil.save(buffer, format="PNG", optimize=False, compress_level=6)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def from_png_b64(data: str) -> np.ndarray:
    """base64 PNG -> uint8 [H, W, C] (for tests and benchmarks that look at the images)."""
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))))
    return image[:, :, None] if image.ndim == 2 else image
