"""The embedded default image model: the digits DiT shipped in this package (trained by
`python -m workers.diffusion.training.train_digits`), served when no folder is given."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.diffusion.pipelines.dit import DiTPipelineModel

DIGITS_NAME = "digits-dit"
DIGITS_PATH = Path(__file__).resolve().parent.parent / "models" / DIGITS_NAME


def load_embedded(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DiTPipelineModel:
    return DiTPipelineModel.from_folder(DIGITS_PATH, name=DIGITS_NAME, device=device, dtype=dtype)
