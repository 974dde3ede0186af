"""pipelines/dit_lean.py: a DiT's blocks as straight-line calls give diffusers' numbers bit for
bit (the embedded digits DiT, a tiny random one with a learned variance, bfloat16 too), and a
model whose blocks are another kind keeps diffusers' own calls."""

from __future__ import annotations

import pytest
import torch

from pagemesh.tests.diffusion_tiny import TinyDiTPipeline
from pagemesh.workers.diffusion.pipelines.dit_lean import lean_block, lean_unsupported, timestep_sinusoid
from pagemesh.workers.diffusion.pipelines.embedded import load_embedded

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def digits():
    return load_embedded()


def _inputs(transformer, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dtype = transformer.dtype
    tokens, dim = 16, transformer.inner_dim
    hidden = torch.randn((rows, tokens, dim), generator=g).to(dtype)
    timesteps = torch.randint(0, 1000, (rows,), generator=g).float()
    labels = torch.randint(0, transformer.config.num_embeds_ada_norm + 1, (rows,), generator=g)
    return hidden, timesteps, labels


@pytest.mark.parametrize("which", ["digits", "tiny", "tiny-bf16"])
@pytest.mark.parametrize("rows", [1, 7, 32])
@torch.inference_mode()
def test_each_lean_block_is_diffusers_block_bit_for_bit(digits, which, rows):
    transformer = {
        "digits": lambda: digits.transformer,
        "tiny": lambda: TinyDiTPipeline().transformer,
        "tiny-bf16": lambda: TinyDiTPipeline(dtype=torch.bfloat16).transformer,
    }[which]()
    assert lean_unsupported(transformer) is None
    hidden, timesteps, labels = _inputs(transformer, rows, seed=rows)
    sinusoid = timestep_sinusoid(transformer, timesteps)
    for block in transformer.transformer_blocks:
        expected = block(hidden, timestep=timesteps, class_labels=labels)
        got = lean_block(block, hidden, sinusoid, labels)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
        hidden = expected


@torch.inference_mode()
def test_the_pipelines_forward_is_the_transformers_bit_for_bit(digits):
    assert digits.block_forward.lean
    g = torch.Generator().manual_seed(0)
    latents = torch.randn((12, *digits.latent_shape), generator=g)
    timesteps = torch.tensor([999.0, 500.0, 1.0] * 4)
    cond = torch.arange(12) % 11
    expected = digits.transformer(latents, timestep=timesteps, class_labels=cond).sample
    if digits.learned_sigma:
        expected = expected[:, : digits.in_channels]
    assert torch.equal(digits.denoise(latents, timesteps, cond), expected)


def test_another_kind_of_block_keeps_diffusers_calls():
    from diffusers import PixArtTransformer2DModel

    tiny = TinyDiTPipeline().transformer
    tiny.train()
    assert "training" in lean_unsupported(tiny)
    tiny.eval()
    tiny.transformer_blocks[1].ff.net.append(torch.nn.Dropout(0.0))  # a final dropout: not the kind written
    assert lean_unsupported(tiny) == "its blocks are not a GELU feed-forward"
    pixart = PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1, sample_size=8, caption_channels=16
    ).eval()
    assert "adaLN-Zero" in lean_unsupported(pixart)
