"""Tiny randomly-initialised diffusers pipelines built from configs and saved to a folder (nothing
is downloaded): a Stable Diffusion (UNet2DConditionModel, CLIP) and PixArt Alpha / Sigma (T5), for
the tests of the folder pipelines and their feature caches."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    PixArtAlphaPipeline,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

SCHEDULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
SD_SERVING = {"sizes": ["16x16", "24x16"], "max_steps": 30, "default_sampler": "euler"}


def _vae(*, attention: bool = True) -> AutoencoderKL:
    return AutoencoderKL(
        mid_block_add_attention=attention,
        block_out_channels=(8, 16),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )


def _clip_tokenizer() -> CLIPTokenizer:
    # byte-level characters as the whole vocabulary: every character is a token
    chars = sorted(ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for c in chars:
            vocab[c + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer(max_length: int) -> T5Tokenizer:
    words = ["a", "cat", "the", "dog", "on", "mat", "red"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789,."] + [("▁" + w, -1.0) for w in words]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def _save(pipe, path: Path, serving: dict | None = None) -> str:
    pipe.save_pretrained(str(path))
    if serving is not None:
        (path / "pagemesh.json").write_text(json.dumps(serving))
    return str(path)


def tiny_sd_folder(path: Path) -> str:
    """A Stable Diffusion folder: a 2-block UNet2DConditionModel (8 latent pixels), CLIP, DDIM."""
    torch.manual_seed(0)
    tokenizer = _clip_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        norm_num_groups=4,
        attention_head_dim=2,
    )
    scheduler = DDIMScheduler(**SCHEDULER, clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(
        vae=_vae(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return _save(pipe, path, SD_SERVING)


def _pixart(path: Path, pipeline_cls, *, sample_size: int, patch_size: int, max_length: int, attention: bool) -> str:
    torch.manual_seed(1)
    tokenizer = _t5_tokenizer(max_length)
    text_encoder = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
        )
    )
    transformer = PixArtTransformer2DModel(
        num_attention_heads=3,  # 24 wide: the micro-condition embeddings take a third each
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,  # learned sigma, as PixArt's checkpoints
        num_layers=2,
        sample_size=sample_size,
        patch_size=patch_size,
        cross_attention_dim=24,
        caption_channels=32,
        norm_num_groups=4,
    )
    scheduler = DPMSolverMultistepScheduler(**SCHEDULER)
    vae = _vae(attention=attention)
    pipe = pipeline_cls(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    return _save(pipe, path)


def tiny_pixart_alpha_folder(path: Path) -> str:
    """sample_size 128 is what PixArt-alpha-1024 has: its resolution / aspect-ratio conditions are
    on. Patches of 16 keep the transformer at 64 tokens; the VAE's mid-block attention (over all
    128 x 128 latent pixels) is left out to keep the decode fast."""
    return _pixart(path, PixArtAlphaPipeline, sample_size=128, patch_size=16, max_length=120, attention=False)


def tiny_pixart_sigma_folder(path: Path) -> str:
    return _pixart(path, PixArtSigmaPipeline, sample_size=8, patch_size=2, max_length=300, attention=True)
