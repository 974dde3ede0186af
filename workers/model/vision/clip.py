"""LLaVA's vision side: a CLIP or SigLIP vision transformer and the multimodal projector.

    pixel_values [N, 3, H, W] -> hidden states of the tower's layers -> the configured feature
    layer(s) (concatenated), less row 0 under the "default" strategy -> linear_1, act, linear_2
    -> [N, tokens_per_image, text hidden size], the rows that replace the image tokens.

Equal to transformers' `LlavaForConditionalGeneration.get_image_features` (5.x). Hidden state 0 is
the embeddings' output (after CLIP's pre_layrnorm), hidden state i the output of layer i; the
post_layernorm never reaches LLaVA's features. Only the layers up to the deepest feature layer are
built: the tensors of the layers above it are accepted and ignored.

The modules are named as in HF's checkpoints (`vision_tower.encoder.layers.0.mlp.fc1.weight`), so
a tensor loads by its name once the prefix variants are normalised (`LlavaVision.load_tensor`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagemesh.common.vision_configs import (  # noqa: F401 - llava_tokens_per_image: this module's API too
    CLIP,
    llava_feature_layers,
    llava_tokens_per_image,
    patches,
    select_strategy,
    vision_config_with_defaults,
)


def _tanh_gelu_formula(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# HF's ACT2FN names -> the same computation (transformers/activations.py)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _tanh_gelu_formula,
    "gelu_python_tanh": _tanh_gelu_formula,
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "linear": lambda x: x,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (known: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


_TEXT_HIDDEN_DEFAULT = 4096  # LlamaConfig's, LlavaConfig's default text model


class VisionAttention(nn.Module):
    """Multi-head self-attention over all of an image's rows (no mask), q/k/v/out with biases."""

    def __init__(self, cfg: dict):
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.num_heads = int(cfg["num_attention_heads"])
        self.head_dim = hidden // self.num_heads
        if self.head_dim * self.num_heads != hidden:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {self.num_heads}")
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, nn.utils.skip_init(nn.Linear, hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, rows, _ = x.shape
        q, k, v = (
            p(x).view(n, rows, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, rows, -1))


class VisionMLP(nn.Module):
    """fc1 -> the tower's hidden_act -> fc2."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.act = activation(cfg["hidden_act"])
        self.fc1 = nn.utils.skip_init(nn.Linear, int(cfg["hidden_size"]), int(cfg["intermediate_size"]))
        self.fc2 = nn.utils.skip_init(nn.Linear, int(cfg["intermediate_size"]), int(cfg["hidden_size"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """A pre-norm transformer layer: x + attn(layer_norm1(x)), then x + mlp(layer_norm2(x))."""

    def __init__(self, cfg: dict):
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg["layer_norm_eps"])
        self.layer_norm1 = nn.utils.skip_init(nn.LayerNorm, hidden, eps=eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.utils.skip_init(nn.LayerNorm, hidden, eps=eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    """Patch convolution (bias: SigLIP only), CLIP's class row prepended, position embeddings added."""

    def __init__(self, cfg: dict):
        super().__init__()
        hidden, patch, self.image_size = int(cfg["hidden_size"]), int(cfg["patch_size"]), int(cfg["image_size"])
        clip = cfg["model_type"] == CLIP
        self.class_embedding = nn.Parameter(torch.empty(hidden)) if clip else None
        channels = int(cfg["num_channels"])
        self.patch_embedding = nn.utils.skip_init(nn.Conv2d, channels, hidden, patch, stride=patch, bias=not clip)
        self.position_embedding = nn.utils.skip_init(nn.Embedding, patches(cfg) + clip, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"images are {tuple(pixel_values.shape[-2:])}, the tower takes {self.image_size}^2")
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionEncoder(nn.Module):
    """The stack of encoder layers (`encoder.layers.{i}` in a checkpoint)."""

    def __init__(self, cfg: dict, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(num_layers))


class ClipVisionTower(nn.Module):
    """CLIP's (model_type "clip_vision_model") or SigLIP's ("siglip_vision_model") vision
    transformer, from the HF `vision_config` dict; `num_layers` (default all) builds only the
    first layers. forward(pixel_values [N, C, H, W]) returns the hidden states as HF's
    `output_hidden_states` does: [embeddings (after CLIP's pre_layrnorm), layer 1's output, ...];
    those not in `keep` (when given) are None. As in transformers 5.x the last one is not
    post-layernormed, unless a SigLIP config sets `tie_last_hidden_states` (then, as HF, it is)."""

    def __init__(self, vision_config: dict, num_layers: int | None = None):
        super().__init__()
        cfg = vision_config_with_defaults(vision_config)
        self.config = cfg
        self.model_type = cfg["model_type"]
        total = int(cfg["num_hidden_layers"])
        self.num_layers = total if num_layers is None else num_layers
        if not 0 <= self.num_layers <= total:
            raise ValueError(f"num_layers {num_layers} is not within the tower's {total}")
        hidden, eps = int(cfg["hidden_size"]), float(cfg["layer_norm_eps"])
        self.embeddings = VisionEmbeddings(cfg)
        clip = self.model_type == CLIP
        self.pre_layrnorm = nn.utils.skip_init(nn.LayerNorm, hidden, eps=eps) if clip else None  # sic (HF's name)
        self.encoder = VisionEncoder(cfg, self.num_layers)
        self.post_layernorm = nn.utils.skip_init(nn.LayerNorm, hidden, eps=eps)
        # HF's hidden_states[-1] is last_hidden_state when the config ties them: SigLIP's is normed
        self.norm_last = not clip and bool(cfg.get("tie_last_hidden_states", False)) and self.num_layers == total

    def ignores(self, name: str) -> bool:
        """Whether a tensor of the tower (name after `vision_tower.[vision_model.]`) is one it
        accepts without using: SigLIP's pooling head, position ids, layers above those built."""
        if name.startswith("head.") or name == "embeddings.position_ids":
            return True
        if name.startswith("encoder.layers."):
            index = name.split(".")[2]
            return index.isdigit() and int(index) >= self.num_layers
        return False

    def forward(self, pixel_values: torch.Tensor, keep: Iterable[int] | None = None) -> list[torch.Tensor | None]:
        keep = None if keep is None else set(keep)
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        if self.norm_last:
            states[-1] = self.post_layernorm(states[-1])
        return [s if keep is None or i in keep else None for i, s in enumerate(states)]


class LlavaProjector(nn.Module):
    """LLaVA's multi_modal_projector: linear_1 -> projector_hidden_act -> linear_2."""

    def __init__(self, in_features: int, out_features: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.utils.skip_init(nn.Linear, out_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """LLaVA's image encoder, from the whole LLaVA config.json dict: forward(pixel_values
    [N, C, H, W]) -> [N, tokens_per_image, text hidden size], equal to HF's
    `get_image_features` (its per-image list stacked). Load with `load_tensor` for every
    checkpoint tensor, then check `missing()`."""

    def __init__(self, config: dict):
        super().__init__()
        vision = vision_config_with_defaults(config.get("vision_config"))
        self.feature_layers = llava_feature_layers(config)
        self.select_strategy = select_strategy(config)
        self._tokens = llava_tokens_per_image(config)
        token = config.get("image_token_index", config.get("image_token_id"))
        self.image_token_index = 32000 if token is None else int(token)
        self.vision_tower = ClipVisionTower(vision, num_layers=max(self.feature_layers))
        text_hidden = int((config.get("text_config") or {}).get("hidden_size", _TEXT_HIDDEN_DEFAULT))
        self.multi_modal_projector = LlavaProjector(
            int(vision["hidden_size"]) * len(self.feature_layers),
            text_hidden,
            config.get("projector_hidden_act", "gelu"),
            bool(config.get("multimodal_projector_bias", True)),
        )
        self.requires_grad_(False)
        self._loaded: set[str] = set()

    @property
    def tokens_per_image(self) -> int:
        """The rows `forward` returns per image (the image tokens one image takes in a prompt)."""
        return self._tokens

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower(pixel_values, keep=self.feature_layers)
        features = [states[i] for i in self.feature_layers]
        if self.select_strategy == "default":
            features = [f[:, 1:] for f in features]
        x = features[0] if len(features) == 1 else torch.cat(features, dim=-1)
        return self.multi_modal_projector(x)

    def expected_tensor_names(self) -> set[str]:
        """The checkpoint tensors this module needs, in the names transformers 5 saves
        (`vision_tower.…`, `multi_modal_projector.…`)."""
        return {name for name, _ in self.named_parameters()}

    def missing(self) -> list[str]:
        """The expected tensors that `load_tensor` has not been given (sorted; empty: all loaded)."""
        return sorted(self.expected_tensor_names() - self._loaded)

    @staticmethod
    def canonical_name(name: str) -> str | None:
        """A checkpoint name as `expected_tensor_names` spells it (dropping transformers 5's `model.`
        and the hub's `vision_tower.vision_model.`), or None where it is not of the vision side."""
        key = name.removeprefix("model.")
        if key.startswith("vision_tower."):
            return "vision_tower." + key.removeprefix("vision_tower.").removeprefix("vision_model.")
        return key if key.startswith("multi_modal_projector.") else None

    def load_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor into place (cast to this module's dtype). True: a vision-side
        tensor (used, or one of those `ClipVisionTower.ignores`); False: not of the vision side
        (the language model's). A vision-side name it does not know, or a wrong shape, raises."""
        key = self.canonical_name(name)
        if key is None:
            return False
        if key.startswith("vision_tower.") and self.vision_tower.ignores(key.removeprefix("vision_tower.")):
            return True
        try:
            param = self.get_parameter(key)
        except AttributeError:
            raise ValueError(f"unexpected vision tensor {name!r} for this LLaVA config") from None
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        self._loaded.add(key)
        return True
