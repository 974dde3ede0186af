"""Read a model's config and weights from a Hugging Face folder (safetensors) or a GGUF file.

Both yield tensors under Hugging Face names, so the model has one loading path.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagemesh.common.model_config import ModelConfig, read_model_config
from pagemesh.common.model_files import text_weights_path
from pagemesh.common.quantization import QUANTIZATIONS
from pagemesh.kernels.gguf_conversions import GGUF_CONVERSIONS, from_gguf_converted
from pagemesh.kernels.quantized import GGUF_BLOCK_FORMATS, QuantizedWeight, from_gguf_blocks
from pagemesh.workers.model.causal_lm import CausalLM
from pagemesh.workers.model.layers import ParallelContext
from pagemesh.workers.model.quantization import install_gguf_weights, permute_rows, quantize_int8_model
from pagemesh.workers.model.registry import model_class
from pagemesh.workers.model.vision.encoder import ImageEncoder, text_weights

log = logging.getLogger(__name__)

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
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v in one tensor
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router (Qwen3-MoE)
}
# a MoE layer's experts, stacked [experts, rows, cols] in one tensor: one HF tensor per expert
_GGUF_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_ARCH_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}}  # Phi-3: gate and up in one tensor
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
    quantization: str = "none",
) -> CausalLM:
    """The model (or, with `layers`, one pipeline stage of it: see CausalLM), of its family's
    class (`pagemesh.workers.model.registry`), this rank's tensor-parallel shard, its weights
    loaded; `quantization` (workers/model/quantization.py) says which linear weights stay
    quantized: `gguf` keeps a GGUF file's blocks, `int8` rounds any weights."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}")
    text_path = text_weights_path(path)  # a multimodal folder may take its LM from the embedded GGUF
    if quantization == "gguf" and text_path.is_dir():
        raise ValueError("quantization gguf: the model must be a GGUF file (int8 quantizes any weights)")
    cfg = read_model_config(path)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(cfg)(cfg, tp, layers)
    blocks: dict[str, QuantizedWeight] | None = {} if quantization == "gguf" else None
    weights = hf_folder_weights(text_path) if text_path.is_dir() else _gguf_weights(text_path, cfg, blocks)
    if cfg.multimodal is not None:  # workers/model/vision/encoder.py: the tower beside the LM
        if text_path == path:
            weights = text_weights(weights)
        if model.is_first:
            model.image_encoder = ImageEncoder(path, dtype, device)
            model.image_encoder.load(hf_folder_weights(path))
    model.load_weights(weights)
    if blocks is not None:
        done = install_gguf_weights(model, blocks)
        log.info("quantization gguf: %d linears run on the GGUF's blocks", done)
    elif quantization == "int8":
        done = quantize_int8_model(model)
        log.info("quantization int8: %d linears run on int8 blocks", done)
    return model.eval()


def build_random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLM:
    with torch.device(device), _default_dtype(dtype):
        model = model_class(cfg)(cfg)
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
def hf_folder_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
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
_QUANTIZABLE = {"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def _gguf_weights(
    path: Path, cfg: ModelConfig, blocks: dict[str, QuantizedWeight] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized tensors under HF names; with `blocks`, the linear weights' quantized blocks
    too (formats of `pagemesh.kernels.quantized`; others are logged and served dense)."""
    from gguf.quants import dequantize

    from pagemesh.common.gguf_file import read_gguf

    reader = read_gguf(path)
    routes: dict[str, list[str]] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise ValueError("model: GGUF with rope_freqs (llama3 scaling) is not supported; use the HF folder")
        array = dequantize(t.data, t.tensor_type)
        shape = [int(d) for d in reversed(t.shape)]
        tensor = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        name = _GGUF_TOP.get(t.name)
        rope_heads = None
        stack = _GGUF_BLOCK.fullmatch(t.name)
        if stack is not None and stack.group(2) in _GGUF_EXPERT_STACKS:  # workers/model/moe.py
            layer, kind, suffix = stack.groups()
            gtype = t.tensor_type.name
            convert = from_gguf_blocks if gtype in GGUF_BLOCK_FORMATS else None
            convert = from_gguf_converted if gtype in GGUF_CONVERSIONS else convert
            if blocks is not None and convert is None:
                log.info("quantization gguf: %s (experts) is %s, served dense", t.name, gtype)
            for expert, part in enumerate(tensor):
                name = f"model.layers.{layer}.mlp.experts.{expert}.{_GGUF_EXPERT_STACKS[kind]}.{suffix}"
                if blocks is not None and convert is not None:
                    blocks[name] = convert(gtype, t.data[expert])  # one expert's rows of blocks
                yield name, part
            continue
        if name is None:
            m = _GGUF_BLOCK.fullmatch(t.name)
            if m is None or m.group(2) not in _GGUF_NAMES:
                raise ValueError(f"model: unexpected GGUF tensor {t.name}")
            layer, kind, suffix = m.groups()
            module = _GGUF_ARCH_NAMES.get(cfg.architecture, {}).get(kind, _GGUF_NAMES[kind])
            name = f"model.layers.{layer}.{module}.{suffix}"
            if cfg.architecture in ("llama", "mistral"):
                rope_heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(kind)
                if rope_heads is not None:
                    tensor = _unpermute_rope_rows(tensor, rope_heads)
        if blocks is not None and _is_linear_weight(t.name):
            gtype = t.tensor_type.name
            qw = None
            if gtype in GGUF_BLOCK_FORMATS:
                qw = from_gguf_blocks(gtype, t.data)
            elif gtype in GGUF_CONVERSIONS:
                qw = from_gguf_converted(gtype, t.data)
                routes.setdefault(gtype, []).append(t.name)
            else:
                log.info("quantization gguf: %s is %s, served dense", t.name, gtype)
            if qw is not None and rope_heads is not None:
                qw = permute_rows(qw, _unpermute_rope_rows(torch.arange(qw.shape[0]), rope_heads))
            if qw is not None:
                blocks.update(_fused_parts(name, qw, cfg))
        yield name, tensor
    for kind, names in routes.items():  # which tensors took which route (kernels/gguf_conversions.py)
        log.info(
            "quantization gguf: %d %s tensors as %s: %s", len(names), kind, GGUF_CONVERSIONS[kind][2], " ".join(names)
        )


def _fused_parts(name: str, qw: QuantizedWeight, cfg: ModelConfig) -> dict[str, QuantizedWeight]:
    """A quantized weight under the names `install_gguf_weights` looks for: a fused Phi-3
    tensor's rows cut into its q, k, v (or gate, up) parts, each under its Llama name."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    parts = {
        "self_attn.qkv_proj.weight": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
        "mlp.gate_up_proj.weight": (("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)),
    }
    prefix, _, rest = name.rpartition(".layers.")[2].partition(".")
    if rest not in parts:
        return {name: qw}
    out, start = {}, 0
    for part, size in parts[rest]:
        out[f"model.layers.{prefix}.{part}.weight"] = qw.rows(start, size)
        start += size
    return out


def _is_linear_weight(gguf_name: str) -> bool:
    """A linear layer's weight, or the token embedding / output matrix (the LM head)."""
    if gguf_name in ("token_embd.weight", "output.weight"):
        return True
    m = _GGUF_BLOCK.fullmatch(gguf_name)
    return m is not None and m.group(2) in _QUANTIZABLE and m.group(3) == "weight"


def _unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's Q/K rows from rotate-half to interleaved pairs
    (its RoPE rotates adjacent elements); undo it so the rows are in Hugging Face order."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
