"""Fidelity of an image against a reference image of the same seed: PSNR and SSIM, on uint8
pixels [n, H, W] (single channel), as the diffusion experiments compare cached or shortened
sampling with the full uncached run.

    psnr(a, b)   10 log10(255² / MSE), the MSE pooled over all pixels of all images (inf if equal)
    ssim(a, b)   per image: the mean SSIM map (Wang et al. 2004; C1 = (0.01·255)², C2 = (0.03·255)²)
                 with a 7×7 Gaussian window, σ 1.5, borders reflected (small images: 8×8 digits)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

WINDOW, SIGMA = 7, 1.5
C1, C2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def _window() -> torch.Tensor:
    x = torch.arange(WINDOW, dtype=torch.float64) - WINDOW // 2
    g = torch.exp(-(x**2) / (2 * SIGMA**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image SSIM [n] of uint8 (or float 0..255) images [n, H, W]."""
    x, y = a.double()[:, None], b.double()[:, None]
    window, pad = _window(), WINDOW // 2

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.pad(t, (pad, pad, pad, pad), mode="reflect"), window)

    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y = blur(x * x) - mu_x**2, blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    score = ((2 * mu_x * mu_y + C1) * (2 * cov + C2)) / ((mu_x**2 + mu_y**2 + C1) * (var_x + var_y + C2))
    return score.mean(dim=(1, 2, 3))
