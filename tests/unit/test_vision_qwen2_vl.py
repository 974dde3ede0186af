"""Qwen2VLVision against Hugging Face's Qwen2-VL vision tower (the oracle) in fp32: a tiny random
Qwen2VLForConditionalGeneration saved with save_pretrained, its tensors loaded into ours, and
both run on images preprocessed by transformers' own Qwen2-VL image processor."""

import numpy as np
import pytest
import torch

from pagemesh.workers.model.vision.qwen2_vl import Qwen2VLVision

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VISION = dict(
    depth=2, embed_dim=32, hidden_size=64, num_heads=4, in_chans=3, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2,
)  # fmt: skip
TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=1000, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
)  # fmt: skip
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16  # images stay a few merge windows


def image_processor():
    """transformers' Qwen2-VL image processor: the torchvision one where torchvision is
    installed, else its PIL twin (same sizes, same patch layout)."""
    try:
        import torchvision  # noqa: F401

        cls = transformers.Qwen2VLImageProcessor
    except ImportError:
        cls = transformers.Qwen2VLImageProcessorPil
    return cls(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(HF model, its saved tensors by name): the vision weights drawn wide enough (std 0.2,
    LayerNorm weights around 1) that attention is far from uniform and errors would show."""
    cfg = transformers.Qwen2VLConfig(
        vision_config=VISION, text_config=TEXT, image_token_id=998, vision_start_token_id=997, vision_end_token_id=996
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            is_norm_weight = ("norm" in name or "ln_q" in name) and name.endswith("weight")
            p.normal_(1.0 if is_norm_weight else 0.0, 0.2)
    path = tmp_path_factory.mktemp("qwen2_vl")
    model.save_pretrained(path)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(str(file)))
    return model, tensors


@pytest.fixture(scope="module")
def ours(hf_model):
    _, tensors = hf_model
    vision = Qwen2VLVision(VISION)
    for name, tensor in tensors.items():
        vision.load_tensor(name, tensor)
    assert vision.missing_tensors() == []
    return vision.eval()


def preprocess(sizes, seed=0):
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    out = image_processor()(images=images, input_data_format="channels_last", return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"]


def hf_visual(model, pixel_values, grid_thw):
    with torch.no_grad():
        return model.model.visual(pixel_values, grid_thw=grid_thw).pooler_output


def test_two_images_of_different_sizes_match_hf(hf_model, ours):
    model, _ = hf_model
    pixel_values, grid_thw = preprocess([(56, 84), (112, 56)])
    assert grid_thw.tolist() == [[1, 4, 6], [1, 8, 4]]  # two grids, neither square
    expected = hf_visual(model, pixel_values, grid_thw)
    with torch.no_grad():
        got = ours(pixel_values, grid_thw.tolist())
    assert got.shape == (6 + 8, 64) and got.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # not a vanishing signal that any code would match
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_larger_batch_with_resized_images_matches_hf(hf_model, ours):
    """Sizes that smart_resize rounds, enlarges (under min_pixels) and shrinks (over max_pixels)."""
    model, _ = hf_model
    pixel_values, grid_thw = preprocess([(61, 97), (20, 30), (300, 140), (56, 56)], seed=1)
    expected = hf_visual(model, pixel_values, grid_thw)
    with torch.no_grad():
        got = ours(pixel_values, grid_thw)  # grid_thw as HF's tensor works as well
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_each_image_attends_only_to_itself(ours):
    pixel_values, grid_thw = preprocess([(56, 84), (112, 56)], seed=2)
    grids = grid_thw.tolist()
    rows = ours.output_rows(grids)
    assert rows == [6, 8]
    first_patches = grids[0][0] * grids[0][1] * grids[0][2]
    with torch.no_grad():
        together = ours(pixel_values, grids).split(rows)
        alone = [ours(pixel_values[:first_patches], grids[:1]), ours(pixel_values[first_patches:], grids[1:])]
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_runs_close_to_fp32(hf_model, ours):
    _, tensors = hf_model
    vision = Qwen2VLVision(VISION, dtype=torch.bfloat16)
    for name, tensor in tensors.items():
        vision.load_tensor(name, tensor.to(torch.bfloat16))
    pixel_values, grid_thw = preprocess([(56, 84)], seed=3)
    with torch.no_grad():
        got = vision(pixel_values, grid_thw.tolist())
        reference = ours(pixel_values, grid_thw.tolist())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference, rtol=0.1, atol=0.1)


def test_load_tensor_takes_vision_names_only(hf_model):
    _, tensors = hf_model
    vision = Qwen2VLVision(VISION)
    assert "visual.blocks.0.attn.qkv.weight" in vision.missing_tensors()
    assert len(vision.missing_tensors()) == len([n for n in tensors if n.startswith("visual.")])
    assert vision.load_tensor("model.visual.blocks.0.attn.qkv.weight", tensors["visual.blocks.0.attn.qkv.weight"])
    assert vision.load_tensor("visual.patch_embed.proj.weight", tensors["visual.patch_embed.proj.weight"])
    assert vision.load_tensor("model.visual.merger.mlp.2.bias", tensors["visual.merger.mlp.2.bias"])
    missing = vision.missing_tensors()
    assert "visual.blocks.0.attn.qkv.weight" not in missing and "visual.merger.mlp.2.bias" not in missing
    torch.testing.assert_close(vision.merger.fc2.bias, tensors["visual.merger.mlp.2.bias"], rtol=0, atol=0)
    for name in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight", "model.embed_tokens.weight",
                 "model.language_model.layers.0.mlp.up_proj.weight", "visual.blocks.7.attn.qkv.weight"):  # fmt: skip
        assert not vision.load_tensor(name, torch.zeros(1))
    with pytest.raises(ValueError, match="shape"):
        vision.load_tensor("visual.blocks.0.attn.qkv.weight", torch.zeros(3, 3))


def test_mismatched_inputs_are_refused(ours):
    pixel_values, grid_thw = preprocess([(56, 84)])
    with pytest.raises(ValueError, match="patch rows"):
        ours(pixel_values[:-4], grid_thw.tolist())
    with pytest.raises(ValueError, match="merge"):
        ours(pixel_values[:15], [(1, 3, 5)])
    with pytest.raises(ValueError, match="lacks"):
        Qwen2VLVision({"depth": 1, "embed_dim": 32})
