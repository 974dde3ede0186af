"""Qwen2-VL's image sizing and M-RoPE position ids, in plain Python (no torch, no numpy), so the
gateway and the scheduler can count an image's tokens and a prompt's positions without a model.

    image (height, width) ── smart_resize ──▶ (rh, rw), multiples of patch * merge
                          ── image_grid ────▶ grid (t, h, w) = (1, rh / patch, rw / patch)
                          ── image_tokens ──▶ t * h * w / merge^2 placeholder tokens

M-RoPE gives each prompt token three positions (temporal, height, width). A text token has the
same position in all three, one past the previous token's; an image's tokens, laid out over its
merged grid (t, h/merge, w/merge) row-major, sit at start + (frame, row, column), and the text
after it starts at start + max(h, w)/merge. A sequence's `delta` (max position + 1 - length)
places the tokens generated after the prompt: index i gets position i + delta in all three.

The same numbers as Hugging Face transformers' Qwen2VLImageProcessor and
`Qwen2VLModel.get_rope_index` (images only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Grid = tuple[int, int, int]  # (t, h, w): an image's frames and patch rows and columns

MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """The size Qwen2-VL resizes an image to: each side a multiple of `factor` (the nearest,
    halves rounding to even as Python's round does), the area within [min_pixels, max_pixels]
    (scaled down, or up, keeping the aspect ratio as well as it can). ValueError: a side is not
    positive, or the longer side is more than 200 times the shorter."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got height={height}, width={width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)} (height={height}, width={width})"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(
    height: int,
    width: int,
    patch_size: int = 14,
    merge_size: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
    temporal_patch_size: int = 2,
) -> Grid:
    """One image's grid_thw as Qwen2VLImageProcessor computes it: (1, rh / patch, rw / patch) of
    its smart_resize'd size (rh, rw). t is 1: the processor repeats a still image over the
    `temporal_patch_size` frames of one temporal patch, so the size does not enter here."""
    resized_h, resized_w = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    return 1, resized_h // patch_size, resized_w // patch_size


def image_tokens(grid: Sequence[int], merge_size: int = 2) -> int:
    """How many placeholder tokens (and vision-tower output rows) an image of `grid` takes."""
    t, h, w = grid
    return t * h * w // merge_size**2


def mrope_positions(
    token_ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]], merge_size: int = 2
) -> tuple[list[list[int]], int]:
    """The prompt's M-RoPE positions [temporal, height, width] (each len(token_ids) long) and its
    delta (a token generated at index i >= len(token_ids) has position i + delta in all three).

    Each run of `image_token_id` tokens is one or more whole images, `grids` in order (an image
    takes image_tokens(grid) tokens). ValueError: the runs and the grids do not match."""
    grids = [tuple(int(v) for v in g) for g in grids]
    temporal: list[int] = []
    height: list[int] = []
    width: list[int] = []
    n = len(token_ids)
    next_image = 0
    pos = 0  # the next text token's position
    i = 0
    while i < n:
        if token_ids[i] != image_token_id:
            temporal.append(pos)
            height.append(pos)
            width.append(pos)
            pos += 1
            i += 1
            continue
        if next_image == len(grids):
            raise ValueError(f"mrope: image tokens at index {i} but only {len(grids)} image grids")
        t, h, w = grids[next_image]
        count = image_tokens((t, h, w), merge_size)
        run = token_ids[i : i + count]
        if len(run) < count or any(token != image_token_id for token in run):
            raise ValueError(f"mrope: image {next_image} (grid {(t, h, w)}) needs {count} image tokens at index {i}")
        rows, cols = h // merge_size, w // merge_size
        for frame in range(t):
            for row in range(rows):
                for col in range(cols):
                    temporal.append(pos + frame)
                    height.append(pos + row)
                    width.append(pos + col)
        pos += max(h, w) // merge_size
        next_image += 1
        i += count
    if next_image != len(grids):
        raise ValueError(f"mrope: {len(grids)} image grids but image tokens for {next_image}")
    positions = [temporal, height, width]
    delta = max(max(temporal), max(height), max(width)) + 1 - n if n else 0
    return positions, delta


def mrope_frequency_streams(mrope_section: Sequence[int]) -> list[int]:
    """Which position stream (0 temporal, 1 height, 2 width) rotates each of the head_dim/2 RoPE
    frequencies on the language-model side: the frequencies in order, mrope_section[0] of them
    from the temporal positions, the next mrope_section[1] from the height, the rest from the
    width (HF's `mrope_section`, summing to head_dim/2). Rotate-half dims f and f + head_dim/2
    share frequency f and so its stream."""
    return [j % 3 for j, size in enumerate(mrope_section) for _ in range(size)]
