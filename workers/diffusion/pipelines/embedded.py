"""The embedded image models, shipped as diffusers folders in this package and served by name:

    digits-dit           the digits DiT (python -m pagemesh.workers.diffusion.training.train_digits);
                         served when no folder is given
    digits-dit-student   its few-step student (python -m pagemesh.workers.diffusion.training.distill_digits):
                         DDIM in 1-4 steps, guidance distilled in

Torch-free at import, so `pagemesh up` can name them without loading torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagemesh.workers.diffusion.pipelines.dit import DiTPipelineModel

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DIGITS_NAME = "digits-dit"
STUDENT_NAME = "digits-dit-student"
DIGITS_PATH = MODELS_DIR / DIGITS_NAME
STUDENT_PATH = MODELS_DIR / STUDENT_NAME
UNET_NAME = "digits-unet"  # a class-conditional UNet2DModel (training/train_digits_unet.py)
UNET_PATH = MODELS_DIR / UNET_NAME
LCM_NAME = "digits-dit-lcm"  # its consistency model (training/consistency_digits.py): "lcm" in 1-8 steps
LCM_PATH = MODELS_DIR / LCM_NAME
EMBEDDED_MODELS: dict[str, Path] = {
    DIGITS_NAME: DIGITS_PATH,
    STUDENT_NAME: STUDENT_PATH,
    UNET_NAME: UNET_PATH,
    LCM_NAME: LCM_PATH,
}


def load_embedded(device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DiTPipelineModel:
    """The default image model (digits-dit), served under its name."""
    import torch

    from pagemesh.workers.diffusion.pipelines.dit import DiTPipelineModel

    return DiTPipelineModel.from_folder(DIGITS_PATH, name=DIGITS_NAME, device=device, dtype=dtype or torch.float32)
