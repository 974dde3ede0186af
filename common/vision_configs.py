"""What a LLaVA config.json says about its vision side, in pure Python (the tokenizer counts an
image's placeholders from it; workers/model/vision/clip.py builds the tower from it): the tower's
config with HF's defaults filled in, the hidden states LLaVA reads, the rows per image."""

from __future__ import annotations

CLIP, SIGLIP = "clip_vision_model", "siglip_vision_model"
# the defaults of HF's CLIPVisionConfig / SiglipVisionConfig, for the keys a config.json may omit
_BASE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3)
_TOWER_DEFAULTS = {
    CLIP: {**_BASE, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    SIGLIP: {**_BASE, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
}
# LlavaConfig's tower when config.json has no vision_config at all (llava-1.5's CLIP ViT-L/14-336)
_LLAVA_DEFAULT_TOWER = dict(model_type=CLIP, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24)
_LLAVA_DEFAULT_TOWER.update(num_attention_heads=16, image_size=336, patch_size=14)


def vision_config_with_defaults(vision_config: dict | None) -> dict:
    """`vision_config` of a LLaVA config.json completed with the defaults HF fills in."""
    cfg = dict(_LLAVA_DEFAULT_TOWER if vision_config is None else vision_config)
    model_type = cfg.setdefault("model_type", CLIP)
    if model_type not in _TOWER_DEFAULTS:
        raise ValueError(f"vision tower {model_type!r} is not supported (known: {sorted(_TOWER_DEFAULTS)})")
    return {**_TOWER_DEFAULTS[model_type], **cfg}


def patches(cfg: dict) -> int:
    return (int(cfg["image_size"]) // int(cfg["patch_size"])) ** 2


def llava_feature_layers(config: dict) -> list[int]:
    """The hidden-state indices LLaVA reads (0: the embeddings, i: layer i's output), negative
    `vision_feature_layer`s resolved against the num_hidden_layers + 1 hidden states."""
    vision = vision_config_with_defaults(config.get("vision_config"))
    layers = config.get("vision_feature_layer", -2)
    states = int(vision["num_hidden_layers"]) + 1
    resolved = []
    for index in [layers] if isinstance(layers, int) else list(layers):
        if not -states <= index < states:
            raise ValueError(f"vision_feature_layer {index} is out of range for {states} hidden states")
        resolved.append(index % states)
    return resolved


def select_strategy(config: dict) -> str:
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not 'default' or 'full'")
    return strategy


def llava_tokens_per_image(config: dict) -> int:
    """Rows per image of a LLaVA config.json (dict): the tower's sequence (its patches, plus CLIP's
    class row) less one under the "default" strategy, which drops row 0 whatever it is (as HF does:
    for SigLIP, which has no class row, that is the first patch)."""
    vision = vision_config_with_defaults(config.get("vision_config"))
    rows = patches(vision) + (vision["model_type"] == CLIP)
    return rows - (select_strategy(config) == "default")
