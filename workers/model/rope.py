"""Rotary position embeddings: the tables every layer's RoPE reads, with the scalings of Hugging
Face's `rope_type`s that the model code implements (ROPE_SCALINGS; others are refused at load by
`pagemesh.common.model_families`)."""

from __future__ import annotations

import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """RoPE tables in the rotate-half layout: `cos_sin_cache[pos] = [cos(pos * f), sin(pos * f)]`
    (times YaRN's attention factor, where it has one), [max_pos, head_dim] fp32. `scaling`: HF's
    rope parameters, `rope_type` one of ROPE_SCALINGS (None: plain RoPE)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attention_factor = 1.0
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ROPE_SCALINGS:
                raise ValueError(f"rope scaling {kind!r} is not implemented (implemented: {sorted(ROPE_SCALINGS)})")
            inv_freq, attention_factor = ROPE_SCALINGS[kind](inv_freq, scaling, theta, head_dim)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        table = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
        self.register_buffer("cos_sin_cache", table, persistent=False)


def _llama3_scale(inv_freq: torch.Tensor, s: dict, theta: float, head_dim: int) -> tuple[torch.Tensor, float]:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _linear_scale(inv_freq: torch.Tensor, s: dict, theta: float, head_dim: int) -> tuple[torch.Tensor, float]:
    return inv_freq / s["factor"], 1.0


def _yarn_scale(inv_freq: torch.Tensor, s: dict, theta: float, head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (HF's `_compute_yarn_parameters`, step for step): frequencies blended between
    interpolated (/ factor) and extrapolated by a linear ramp over the dimensions, and the
    attention factor 0.1 * ln(factor) + 1 (or from mscale / mscale_all_dim, or as given)."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    blended = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return blended, attention_factor


def _longrope_scale(inv_freq: torch.Tensor, s: dict, theta: float, head_dim: int) -> tuple[torch.Tensor, float]:
    """LongRoPE's short factors (`pagemesh.common.model_families._longrope_items`: the served
    context is the pretraining one), as HF's `_compute_longrope_parameters`."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * theta**shape), s["attention_factor"]


# HF rope_type -> (inv_freq, scaling dict, theta, head_dim) -> (scaled inv_freq, attention factor)
ROPE_SCALINGS = {"llama3": _llama3_scale, "linear": _linear_scale, "longrope": _longrope_scale, "yarn": _yarn_scale}
