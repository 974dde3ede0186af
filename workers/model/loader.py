"""Read a model's config and weights from a Hugging Face folder (safetensors) or a GGUF file.

Both yield tensors under Hugging Face names, so the model has one loading path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from common.model_config import ModelConfig, read_model_config
from workers.model.layers import ParallelContext
from workers.model.llama import LlamaForCausalLM

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    tp: ParallelContext = ParallelContext(),
    layers: range | None = None,
) -> LlamaForCausalLM:
    """The model (or, with `layers`, one pipeline stage of it: see LlamaForCausalLM), this
    rank's tensor-parallel shard, its weights loaded."""
    cfg = read_model_config(path)
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(cfg, tp, layers)
    weights = _hf_folder_weights(path) if path.is_dir() else _gguf_weights(path, cfg)
    model.load_weights(weights)
    return model.eval()


def build_random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(cfg)
    model.init_random(seed)
    return model.eval()


class _default_dtype:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __enter__(self):
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.saved)


# ---- Hugging Face folder -------------------------------------------------------------------
def _hf_folder_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no .safetensors files in {folder}")
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


# ---- GGUF ----------------------------------------------------------------------------------
def _gguf_weights(path: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise ValueError("model: GGUF with rope_freqs (llama3 scaling) is not supported; use the HF folder")
        array = dequantize(t.data, t.tensor_type)
        shape = [int(d) for d in reversed(t.shape)]
        tensor = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        name = _GGUF_TOP.get(t.name)
        if name is None:
            m = _GGUF_BLOCK.fullmatch(t.name)
            if m is None or m.group(2) not in _GGUF_NAMES:
                raise ValueError(f"model: unexpected GGUF tensor {t.name}")
            layer, kind, suffix = m.groups()
            name = f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"
            if cfg.architecture in ("llama", "mistral"):
                if kind == "attn_q":
                    tensor = _unpermute_rope_rows(tensor, cfg.num_heads)
                elif kind == "attn_k":
                    tensor = _unpermute_rope_rows(tensor, cfg.num_kv_heads)
        yield name, tensor


def _unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's Q/K rows from rotate-half to interleaved pairs
    (its RoPE rotates adjacent elements); undo it so the rows are in Hugging Face order."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
