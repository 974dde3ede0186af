"""Qwen2-VL's vision encoder: preprocessed image patches -> rows of the language model's
embedding space, one row per `merge x merge` window of patches.

    pixel_values [N patches, C*T*P*P]  (Qwen2VLImageProcessor's layout: patches of each image in
        │                               merge-window order, window by window, row-major)
    patch embedding (the checkpoint's Conv3d, applied as the linear map it is)
        │
    depth x block: x + attn(norm1(x)), then x + mlp(norm2(x))
        attention: fused qkv, 2-D rotary by each patch's (row, column), each frame of each image
        attending only to itself (HF's cu_seqlens)
        │
    merger: LayerNorm, every merge^2 consecutive rows concatenated, Linear -> GELU -> Linear
        │
    [N / merge^2, hidden_size]

The same computation as Hugging Face transformers' `Qwen2VLForConditionalGeneration.model.visual`
(its `pooler_output`), written here without transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Grid = tuple[int, int, int]  # (t, h, w): frames and patch rows and columns of one image

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
_CHECKPOINT_PREFIXES = ("model.visual.", "visual.")  # transformers-5-native names, then saved ones


class _Linear(nn.Module):
    """y = x W^T + b, its parameters left unset until the checkpoint's tensors are loaded."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class VisionAttention(nn.Module):
    """Multi-head self-attention over the patches of each attention segment (one frame of one
    image) on its own, q and k rotated by the patches' 2-D rotary tables (in fp32, as HF does)."""

    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = _Linear(dim, 3 * dim, dtype, device)
        self.proj = _Linear(dim, dim, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, rows, head_dim]
        if len(segments) == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            parts = zip(q.split(segments, 1), k.split(segments, 1), v.split(segments, 1))
            out = torch.cat([F.scaled_dot_product_attention(*qkv) for qkv in parts], dim=1)
        return self.proj(out.transpose(0, 1).reshape(rows, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [rows, heads, head_dim] by tables [rows, head_dim], computed in fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype, device=None):
        super().__init__()
        self.fc1 = _Linear(dim, hidden, dtype, device)
        self.fc2 = _Linear(hidden, dim, dtype, device)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)); LayerNorms eps 1e-6."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, dtype: torch.dtype, device=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype, device=device)
        self.attn = VisionAttention(dim, num_heads, dtype, device)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype, device=device)
        self.mlp = VisionMLP(dim, mlp_hidden, act, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm (eps 1e-6) of each patch, then each merge^2 consecutive patches (one window)
    concatenated and projected: fc1 (the checkpoint's `mlp.0`), exact GELU, fc2 (`mlp.2`)."""

    def __init__(self, dim: int, out_dim: int, merge_size: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.window_dim = dim * merge_size**2
        self.ln_q = nn.LayerNorm(dim, eps=1e-6, dtype=dtype, device=device)
        self.fc1 = _Linear(self.window_dim, self.window_dim, dtype, device)
        self.fc2 = _Linear(self.window_dim, out_dim, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).view(-1, self.window_dim))))


class Qwen2VLVision(nn.Module):
    """Qwen2-VL's vision tower, built from a config.json's `vision_config` dict.

    forward(pixel_values [sum of t*h*w, C*T*P*P], grid_thw: one (t, h, w) per image, in the
    order of pixel_values' rows) -> [sum of t*h*w / merge^2, hidden_size], the images' rows one
    after another (`output_rows` says how many are each image's); equal to HF's
    `model.visual(pixel_values, grid_thw=...).pooler_output`.

    Loading: `load_tensor(name, tensor)` for each checkpoint tensor (False: not one of the vision
    tower's, e.g. a language-model tensor), then `missing_tensors()` lists those never loaded."""

    def __init__(self, vision_config: dict, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        cfg = vision_config
        missing = [key for key in ("depth", "embed_dim", "hidden_size", "num_heads") if key not in cfg]
        if missing:
            raise ValueError(f"qwen2-vl vision_config lacks {missing}")
        self.embed_dim, self.num_heads = cfg["embed_dim"], cfg["num_heads"]
        self.hidden_size = cfg["hidden_size"]
        self.in_channels = cfg.get("in_channels", cfg.get("in_chans", 3))
        self.patch_size = cfg.get("patch_size", 14)
        self.temporal_patch_size = cfg.get("temporal_patch_size", 2)
        self.merge_size = cfg.get("spatial_merge_size", 2)
        act = cfg.get("hidden_act", "quick_gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"qwen2-vl vision: hidden_act {act!r} is not implemented (only {list(_ACTIVATIONS)})")
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise ValueError(f"qwen2-vl vision: head dim of {self.embed_dim}/{self.num_heads} is not a multiple of 4")
        rope = cfg.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))

        patch_dim = self.in_channels * self.temporal_patch_size * self.patch_size**2
        # the checkpoint's Conv3d has kernel = stride = one whole patch: a linear map of the patch
        self.patch_embed = nn.Parameter(torch.empty(self.embed_dim, patch_dim, dtype=dtype, device=device), False)
        mlp_hidden = int(self.embed_dim * cfg.get("mlp_ratio", 4))
        self.blocks = nn.ModuleList(
            VisionBlock(self.embed_dim, self.num_heads, mlp_hidden, act, dtype, device) for _ in range(cfg["depth"])
        )
        self.merger = PatchMerger(self.embed_dim, self.hidden_size, self.merge_size, dtype, device)
        self._loaded: set[str] = set()

    # ---- inference ----------------------------------------------------------------------------

    def output_rows(self, grid_thw: Iterable[Sequence[int]]) -> list[int]:
        """How many output rows each image gets: t*h*w / merge^2 (split forward's result by these)."""
        return [t * h * w // self.merge_size**2 for t, h, w in _grids(grid_thw)]

    def forward(self, pixel_values: torch.Tensor, grid_thw: Iterable[Sequence[int]]) -> torch.Tensor:
        grids = _grids(grid_thw)
        for t, h, w in grids:
            if h % self.merge_size or w % self.merge_size:
                raise ValueError(f"qwen2-vl vision: grid {(t, h, w)} is not a multiple of merge {self.merge_size}")
        patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != patches:
            raise ValueError(f"qwen2-vl vision: {pixel_values.shape[0]} patch rows for grids {grids} ({patches})")
        x = F.linear(pixel_values.to(self.patch_embed.dtype), self.patch_embed)
        cos, sin = self.rotary_tables(grids, x.device)
        segments = [h * w for t, h, w in grids for _ in range(t)]  # each frame of each image on its own
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger(x)

    def rotary_tables(self, grids: list[Grid], device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] fp32: head_dim/4 frequencies of the patch's row, then the
        same of its column, the pair repeated (rotate-half layout)."""
        quarter = self.embed_dim // self.num_heads // 4
        spatial_dim = 2 * quarter
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
        rows_cols = self.patch_positions(grids).to(device)  # [patches, 2]
        freqs = rows_cols[..., None].float() * inv_freq.to(device)  # [patches, 2, quarter]
        freqs = freqs.flatten(1)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos(), freqs.sin()

    def patch_positions(self, grids: list[Grid]) -> torch.Tensor:
        """(row, column) of each patch [patches, 2], in pixel_values' order: merge window by
        window (row-major), patches within a window row-major, every frame alike."""
        m = self.merge_size
        positions = []
        for t, h, w in grids:
            rows = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m)
            cols = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m)
            positions.append(torch.stack((rows.flatten(), cols.flatten()), dim=-1).repeat(t, 1))
        return torch.cat(positions) if positions else torch.empty(0, 2, dtype=torch.long)

    # ---- weights ------------------------------------------------------------------------------

    def tensor_names(self) -> set[str]:
        """The vision tower's tensors as `save_pretrained` names them (`visual.` prefix)."""
        names = {"visual.patch_embed.proj.weight"}
        for part in ("ln_q", "mlp.0", "mlp.2"):
            names |= {f"visual.merger.{part}.weight", f"visual.merger.{part}.bias"}
        for i in range(len(self.blocks)):
            for part in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
                names |= {f"visual.blocks.{i}.{part}.weight", f"visual.blocks.{i}.{part}.bias"}
        return names

    def load_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor into place: `visual.<path>` (as saved) or `model.visual.<path>`
        (transformers 5's module names). False: not a vision-tower tensor. A tensor of the tower
        whose shape does not fit raises ValueError."""
        prefix = next((p for p in _CHECKPOINT_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            return False
        path = name[len(prefix) :]
        if path == "patch_embed.proj.weight":
            target = self.patch_embed
            tensor = tensor.reshape(tensor.shape[0], -1) if tensor.dim() == 5 else tensor
        else:
            local = path.replace("merger.mlp.0.", "merger.fc1.").replace("merger.mlp.2.", "merger.fc2.")
            target = dict(self.named_parameters()).get(local)
            if target is None:
                return False
        if target.shape != tensor.shape:
            raise ValueError(f"qwen2-vl vision: {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        self._loaded.add("visual." + path)
        return True

    def missing_tensors(self) -> list[str]:
        """The tower's checkpoint tensors (`visual.` names) that no `load_tensor` call has filled."""
        return sorted(self.tensor_names() - self._loaded)


def _grids(grid_thw: Iterable[Sequence[int]]) -> list[Grid]:
    """grid_thw as a list of int triples (it may come as a [images, 3] tensor)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]
