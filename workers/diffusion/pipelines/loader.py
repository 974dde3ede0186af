"""The one way a diffusion worker gets its model: `load_pipeline(path)`.

    None                      the embedded digits model (pipelines/embedded.py)
    "digits-dit", "digits-dit-student", "digits-unet"
                              an embedded model by name: its folder in this package, served
                              under that name (a folder of the same name: give "./digits-dit")
    folder/model_index.json   diffusers' layout, by its `_class_name`:
      DiTPipeline                                   pipelines/dit.py   (class-conditional DiT)
      ClassUNetPipeline (pagemesh's own)            pipelines/class_unet.py (class-conditional
                                                    pixel-space UNet2DModel, e.g. digits-unet)
      PixArtAlphaPipeline, PixArtSigmaPipeline      pipelines/pixart.py (text-to-image DiT, T5)
      StableDiffusionPipeline                       pipelines/unet.py  (UNet, CLIP)

A folder may hold a `pagemesh.json` with serving defaults (pipelines/common.py says which).
Each pipeline module imports diffusers and its model code only when its layout is loaded.
"""

from __future__ import annotations

import torch

from pagemesh.workers.diffusion.pipelines.base import ImagePipeline
from pagemesh.workers.diffusion.pipelines.common import ModelFolderError, read_model_index
from pagemesh.workers.diffusion.pipelines.embedded import EMBEDDED_MODELS

LAYOUTS = {
    "DiTPipeline": "class-conditional DiT (DiTTransformer2DModel + AutoencoderKL)",
    "ClassUNetPipeline": "class-conditional pixel-space U-Net (UNet2DModel with num_class_embeds)",
    "PixArtAlphaPipeline": "PixArt-alpha (PixArtTransformer2DModel + T5 + AutoencoderKL)",
    "PixArtSigmaPipeline": "PixArt-sigma (PixArtTransformer2DModel + T5 + AutoencoderKL)",
    "StableDiffusionPipeline": "Stable Diffusion 1.x/2.x (UNet2DConditionModel + CLIP + AutoencoderKL)",
}

__all__ = ["LAYOUTS", "ModelFolderError", "load_pipeline"]


def load_pipeline(
    path: str | None,
    *,
    name: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ImagePipeline:
    """The pipeline of the folder at `path` (None: the embedded digits model; an embedded model's
    name: its folder), served as `name` (default: the folder's name, so an embedded model's own),
    its modules on `device` in `dtype`. Raises ModelFolderError for a folder it cannot serve."""
    if path is None:
        from pagemesh.workers.diffusion.pipelines.embedded import load_embedded

        return load_embedded(torch.device(device), dtype)
    if path in EMBEDDED_MODELS:
        path = str(EMBEDDED_MODELS[path])
    layout = read_model_index(path).get("_class_name")
    if layout not in LAYOUTS:
        supported = "; ".join(f"{cls}: {what}" for cls, what in LAYOUTS.items())
        raise ModelFolderError(f"{path}: diffusers layout {layout!r} is not supported; supported: {supported}")
    if layout == "DiTPipeline":
        from pagemesh.workers.diffusion.pipelines.dit import DiTPipelineModel as model_cls
    elif layout == "ClassUNetPipeline":
        from pagemesh.workers.diffusion.pipelines.class_unet import ClassUNetPipelineModel as model_cls
    elif layout == "StableDiffusionPipeline":
        from pagemesh.workers.diffusion.pipelines.unet import UNetPipelineModel as model_cls
    else:
        from pagemesh.workers.diffusion.pipelines.pixart import PixArtPipelineModel as model_cls
    try:
        return model_cls.from_folder(path, name=name, device=device, dtype=dtype)
    except ModelFolderError:
        raise
    except (OSError, KeyError, ValueError) as e:  # a component missing or unreadable
        raise ModelFolderError(f"{path}: cannot load its {layout}: {e}") from e
