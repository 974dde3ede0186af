"""pagemesh.common.mrope against Hugging Face's Qwen2-VL (the oracle): smart_resize and the image
grids of its image processor, M-RoPE positions and deltas of `Qwen2VLModel.get_rope_index`, and
the language side's split of RoPE frequencies between the three position streams."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagemesh.common.mrope import image_grid, image_tokens, mrope_frequency_streams, mrope_positions, smart_resize

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_pil  # noqa: E402

IMAGE, START, END = 998, 997, 996
MERGE = 2

# (height, width, min_pixels, max_pixels): odd sides, sides at k+0.5 patches (round half to even),
# images under min_pixels (enlarged) and over max_pixels (shrunk), extreme aspect ratios
SIZES = [
    (56, 84, 56 * 56, 28 * 28 * 16),
    (112, 56, 56 * 56, 28 * 28 * 16),
    (61, 97, 56 * 56, 28 * 28 * 16),
    (42, 70, 56 * 56, 28 * 28 * 16),
    (98, 126, 56 * 56, 28 * 28 * 16),
    (13, 17, 56 * 56, 28 * 28 * 16),
    (1, 150, 56 * 56, 28 * 28 * 16),
    (33, 5, 56 * 56, 28 * 28 * 16),
    (301, 199, 56 * 56, 28 * 28 * 16),
    (500, 20, 56 * 56, 28 * 28 * 16),
    (20, 3000, 56 * 56, 28 * 28 * 16),
    (227, 227, 128 * 28 * 28, 28 * 28 * 16),
]


def hf_processor(min_pixels, max_pixels):
    try:
        import torchvision  # noqa: F401

        cls = transformers.Qwen2VLImageProcessor
    except ImportError:
        cls = transformers.Qwen2VLImageProcessorPil
    return cls(min_pixels=min_pixels, max_pixels=max_pixels)


def test_mrope_imports_neither_torch_nor_numpy():
    code = "import sys, pagemesh.common.mrope; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("height,width,min_pixels,max_pixels", SIZES)
def test_smart_resize_matches_hf(height, width, min_pixels, max_pixels):
    assert smart_resize(height, width, 28, min_pixels, max_pixels) == hf_pil.smart_resize(
        height, width, 28, min_pixels, max_pixels
    )


def test_smart_resize_matches_hf_over_a_sweep():
    for height in list(range(1, 120, 3)) + [479, 720, 1080, 1920, 4000]:
        for width in (1, 14, 27, 28, 41, 42, 70, 333, 640, 1280, 1920, 7999):
            if max(height, width) / min(height, width) > 200:
                continue
            for factor, min_pixels, max_pixels in ((28, 56 * 56, 14 * 14 * 4 * 1280), (32, 4 * 32 * 32, 64 * 32 * 32)):
                expected = hf_pil.smart_resize(height, width, factor, min_pixels, max_pixels)
                assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected, (height, width)


def test_smart_resize_refuses_what_hf_refuses():
    for height, width in ((1, 201), (4000, 19)):
        with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
            hf_pil.smart_resize(height, width)
        with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
            smart_resize(height, width)
    assert smart_resize(1, 200) == hf_pil.smart_resize(1, 200)  # exactly 200 is allowed
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 10)  # HF: ZeroDivisionError


@pytest.mark.parametrize("height,width,min_pixels,max_pixels", SIZES)
def test_image_grid_matches_hf_processor(height, width, min_pixels, max_pixels):
    image = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    processor = hf_processor(min_pixels, max_pixels)  # channels_last: a 1-row image is not 1-channel
    out = processor(images=[image], input_data_format="channels_last", return_tensors="pt")
    grid = image_grid(height, width, 14, MERGE, min_pixels, max_pixels, 2)
    assert [list(grid)] == out["image_grid_thw"].tolist()
    assert image_tokens(grid, MERGE) * MERGE**2 == out["pixel_values"].shape[0]


def test_image_grid_of_large_images_matches_hf_patch_count():
    processor = hf_processor(56 * 56, 28 * 28 * 1280)  # the default sizes, without making big images
    for height, width in ((1080, 1920), (4032, 3024), (768, 1366), (5000, 100)):
        t, h, w = image_grid(height, width)
        assert t == 1 and h * w == processor.get_number_of_image_patches(height, width)
        assert (h * 14, w * 14) == hf_pil.smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280)


@pytest.fixture(scope="module")
def hf_model():
    cfg = transformers.Qwen2VLConfig(
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=4, spatial_merge_size=MERGE),
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        ),  # fmt: skip
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    return transformers.Qwen2VLModel(cfg).eval()


def image(grid):
    return [START] + [IMAGE] * image_tokens(grid, MERGE) + [END]


def text(n, seed):
    return [(seed * 37 + 11 * i) % 900 + 1 for i in range(n)]


G1, G2, G3 = (1, 4, 6), (1, 8, 4), (1, 2, 2)
SEQUENCES = {
    "no image": (text(9, 1), []),
    "text, image, text": (text(5, 2) + image(G1) + text(4, 3), [G1]),
    "image first, nothing after": (image(G2), [G2]),
    "image at the very start": ([IMAGE] * 8 + text(3, 4), [G2]),
    "two images, text between": (text(3, 5) + image(G1) + text(6, 6) + image(G2) + text(2, 7), [G1, G2]),
    "two images back to back": (text(2, 8) + image(G2) + image(G3) + text(5, 9), [G2, G3]),
    "three images, last at the end": (image(G3) + text(1, 1) + image(G1) + image(G2), [G3, G1, G2]),
}


@pytest.mark.parametrize("name", SEQUENCES)
def test_mrope_positions_match_hf_get_rope_index(hf_model, name):
    tokens, grids = SEQUENCES[name]
    input_ids = torch.tensor([tokens])
    with torch.no_grad():
        expected, deltas = hf_model.get_rope_index(
            input_ids,
            mm_token_type_ids=(input_ids == IMAGE).int(),
            image_grid_thw=torch.tensor(grids) if grids else None,
            video_grid_thw=None,
            attention_mask=torch.ones_like(input_ids),
        )
    positions, delta = mrope_positions(tokens, IMAGE, grids, MERGE)
    assert positions == expected[:, 0].tolist()
    assert delta == deltas.item()
    if not grids:
        assert positions == [list(range(len(tokens)))] * 3 and delta == 0


def test_generated_tokens_continue_at_index_plus_delta(hf_model):
    """What HF's forward does once the prompt is cached: positions cache_length + arange + delta."""
    tokens, grids = SEQUENCES["two images, text between"]
    positions, delta = mrope_positions(tokens, IMAGE, grids, MERGE)
    assert delta < 0  # an image takes fewer positions than tokens
    assert max(max(p) for p in positions) + 1 == len(tokens) + delta  # the first new token, one past the max


def test_mrope_positions_refuse_mismatched_grids():
    tokens = text(2, 1) + image(G1) + text(2, 2)
    with pytest.raises(ValueError, match="needs 8 image tokens at index 3"):
        mrope_positions(tokens, IMAGE, [G2], MERGE)
    with pytest.raises(ValueError, match="only 0 image grids"):
        mrope_positions(tokens, IMAGE, [], MERGE)
    with pytest.raises(ValueError, match="2 image grids but image tokens for 1"):
        mrope_positions(tokens, IMAGE, [G1, G3], MERGE)
    assert mrope_positions([], IMAGE, [], MERGE) == ([[], [], []], 0)


def test_frequency_streams_match_hf_text_rotary(hf_model):
    """cos/sin of HF's language-side rotary for three different position streams equal plain RoPE
    whose frequency f turns with stream mrope_frequency_streams(section)[f]'s position."""
    rotary = hf_model.language_model.rotary_emb
    section = rotary.mrope_section
    streams = mrope_frequency_streams(section)
    assert streams == [0, 0, 1, 1, 1, 2, 2, 2]
    positions = torch.tensor([[[0, 5, 9, 9, 40]], [[0, 6, 7, 11, 41]], [[0, 3, 8, 12, 39]]])
    x = torch.zeros(1, 5, 64)
    cos, sin = rotary(x, positions)
    inv_freq = rotary.inv_freq
    angles = torch.stack([positions[streams[f], 0].float() * inv_freq[f] for f in range(len(streams))], dim=-1)
    angles = torch.cat((angles, angles), dim=-1)  # rotate-half: dims f and f + head_dim/2 share frequency f
    torch.testing.assert_close(cos[0], angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0], angles.sin(), rtol=0, atol=1e-6)
    assert math.isclose(float(inv_freq[1]), 1e6 ** (-2 / 16), rel_tol=1e-6)  # theta 1e6, head_dim 16
