"""PSNR and SSIM of the diffusion experiments (bench/experiments/image_metrics.py)."""

from __future__ import annotations

import math

import torch

from pagemesh.bench.experiments.image_metrics import psnr, ssim


def test_psnr_of_equal_images_is_infinite_and_of_a_known_error_exact():
    a = torch.full((2, 8, 8), 100, dtype=torch.uint8)
    assert psnr(a, a) == math.inf
    b = a + 5  # MSE 25 everywhere
    assert math.isclose(psnr(a, b), 10 * math.log10(255**2 / 25))


def test_ssim_is_one_for_equal_images_and_falls_with_structure_lost():
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (3, 8, 8), generator=gen, dtype=torch.uint8)
    assert torch.allclose(ssim(a, a), torch.ones(3, dtype=torch.float64))
    noisy = (a.int() + torch.randint(-40, 41, a.shape, generator=gen)).clamp(0, 255)
    flat = torch.full_like(a, 128)
    assert (ssim(a, noisy) < 1).all() and (ssim(a, flat) < ssim(a, noisy)).all()
    assert torch.allclose(ssim(a, noisy), ssim(noisy, a))  # symmetric
