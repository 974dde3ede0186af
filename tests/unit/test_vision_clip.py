"""LLaVA's vision side (`pagemesh.workers.model.vision.clip`) against transformers' own
`LlavaForConditionalGeneration.get_image_features`, on tiny random checkpoints saved with
`save_pretrained` and read back tensor by tensor, as the loader does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pagemesh.workers.model.vision.clip import (
    ClipVisionTower,
    LlavaVision,
    llava_feature_layers,
    llava_tokens_per_image,
)

transformers = pytest.importorskip("transformers")

TOWERS = {
    "clip": dict(model_type="clip_vision_model"),
    "siglip": dict(model_type="siglip_vision_model"),
}
TINY_TOWER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8
)
TINY_TEXT = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def save_tiny_llava(tmp_path, tower: str, **llava_kwargs):
    """A random tiny LLaVA saved with save_pretrained: (HF model, config.json dict, tensors)."""
    config = transformers.LlavaConfig(
        vision_config={**TOWERS[tower], **TINY_TOWER, **llava_kwargs.pop("vision_extra", {})},
        text_config=TINY_TEXT,
        image_token_index=100,
        **llava_kwargs,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    tensors = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_file(path))
    return model, json.loads((tmp_path / "config.json").read_text()), tensors


def load_ours(config: dict, tensors: dict[str, torch.Tensor]) -> LlavaVision:
    ours = LlavaVision(config)
    for name, tensor in tensors.items():
        vision = name.startswith(
            ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
        )
        assert ours.load_tensor(name, tensor) == vision, name
    assert ours.missing() == []
    return ours


def hf_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """get_image_features' projected rows, stacked: in transformers 5.x it returns a
    BaseModelOutputWithPooling whose pooler_output is a list of [tokens, hidden] per image."""
    with torch.no_grad():
        out = model.get_image_features(pixel_values)
    rows = out.pooler_output if hasattr(out, "pooler_output") else out
    return torch.stack(list(rows)) if isinstance(rows, (list, tuple)) else rows


def pixels(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tower", sorted(TOWERS))
@pytest.mark.parametrize("layer", [-2, [-3, -1], [0, 2]], ids=str)
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_matches_hf_get_image_features(tmp_path, tower, layer, strategy):
    model, config, tensors = save_tiny_llava(
        tmp_path, tower, vision_feature_layer=layer, vision_feature_select_strategy=strategy
    )
    ours = load_ours(config, tensors)
    x = pixels()
    expected = hf_features(model, x)
    with torch.no_grad():
        got = ours(x)
    assert got.shape == expected.shape == (3, ours.tokens_per_image, TINY_TEXT["hidden_size"])
    assert llava_tokens_per_image(config) == expected.shape[1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # only the layers up to the deepest feature layer are built; the others' tensors were skipped
    assert len(ours.vision_tower.encoder.layers) == max(llava_feature_layers(config))


@pytest.mark.parametrize("tower", sorted(TOWERS))
def test_hub_and_native_names(tmp_path, tower):
    """llava-hf's hub checkpoints spell the tower `vision_tower.vision_model.…`; transformers 5's
    own modules are `model.vision_tower.…`, `model.multi_modal_projector.…`."""
    model, config, tensors = save_tiny_llava(tmp_path, tower)
    x = pixels(2)
    expected = hf_features(model, x)
    hub = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    native = {("model." + k if not k.startswith("language_model.lm_head") else k): v for k, v in tensors.items()}
    for renamed in (hub, native):
        with torch.no_grad():
            torch.testing.assert_close(load_ours(config, renamed)(x), expected, atol=1e-5, rtol=1e-5)


def test_siglip_default_drops_first_patch(tmp_path):
    """HF's "default" strategy drops row 0 whatever the tower: SigLIP has no class row, so LLaVA
    loses its first patch (16 patches -> 15 rows) and "full" keeps all 16."""
    assert llava_tokens_per_image({"vision_config": {**TOWERS["siglip"], **TINY_TOWER}}) == 15
    full = {"vision_config": {**TOWERS["siglip"], **TINY_TOWER}, "vision_feature_select_strategy": "full"}
    assert llava_tokens_per_image(full) == 16
    assert llava_tokens_per_image({"vision_config": {**TOWERS["clip"], **TINY_TOWER}}) == 16
    # no vision_config: LlavaConfig's CLIP ViT-L/14 at 336 px -> 24 * 24 patches + CLS - CLS
    assert llava_tokens_per_image({}) == transformers.LlavaConfig().image_seq_length == 576


def test_siglip_tied_last_hidden_state(tmp_path):
    """A SigLIP config with tie_last_hidden_states: HF's hidden_states[-1] is post_layernormed."""
    model, config, tensors = save_tiny_llava(
        tmp_path, "siglip", vision_feature_layer=-1, vision_extra=dict(tie_last_hidden_states=True)
    )
    ours = load_ours(config, tensors)
    assert ours.vision_tower.norm_last
    x = pixels(2)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf_features(model, x), atol=1e-5, rtol=1e-5)


def test_bf16_and_load_errors(tmp_path):
    model, config, tensors = save_tiny_llava(tmp_path, "clip")
    ours = load_ours(config, tensors)
    x = pixels(2)
    expected = hf_features(model, x)
    ours = ours.to(torch.bfloat16)
    with torch.no_grad():
        got = ours(x)  # fp32 pixels are cast to the tower's dtype
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.05)

    fresh = LlavaVision(config)
    assert "vision_tower.embeddings.class_embedding" in fresh.expected_tensor_names()
    assert "vision_tower.encoder.layers.2.mlp.fc1.weight" not in fresh.expected_tensor_names()  # above layer -2
    assert fresh.load_tensor("vision_tower.encoder.layers.2.mlp.fc1.weight", torch.zeros(64, 32))  # ignored
    assert not fresh.load_tensor("lm_head.weight", torch.zeros(1))
    assert not fresh.load_tensor("model.language_model.layers.0.mlp.up_proj.weight", torch.zeros(1))
    with pytest.raises(ValueError, match="shape"):
        fresh.load_tensor("multi_modal_projector.linear_1.weight", torch.zeros(32, 64))
    with pytest.raises(ValueError, match="unexpected"):
        fresh.load_tensor("vision_tower.embeddings.patch_embedding.bias", torch.zeros(32))  # CLIP has none
    fresh.load_tensor("multi_modal_projector.linear_1.weight", tensors["multi_modal_projector.linear_1.weight"])
    assert "multi_modal_projector.linear_1.weight" not in fresh.missing()
    assert "vision_tower.embeddings.patch_embedding.weight" in fresh.missing()


def test_tower_hidden_states_match_hf():
    """ClipVisionTower alone: every hidden state equals HF's output_hidden_states."""
    torch.manual_seed(0)
    for tower in sorted(TOWERS):
        hf_config = transformers.AutoConfig.for_model(**TOWERS[tower], **TINY_TOWER)
        hf = transformers.AutoModel.from_config(hf_config).eval()
        ours = ClipVisionTower({**TOWERS[tower], **TINY_TOWER})
        for name, tensor in hf.state_dict().items():
            if not ours.ignores(name) and name != "embeddings.position_ids":
                ours.get_parameter(name).data.copy_(tensor)
        x = pixels(2)
        with torch.no_grad():
            expected = hf(x, output_hidden_states=True).hidden_states
            got = ours(x)
        assert len(got) == len(expected) == TINY_TOWER["num_hidden_layers"] + 1
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
