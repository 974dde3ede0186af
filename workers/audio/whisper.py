"""Whisper (OpenAI's encoder-decoder speech model) in plain torch, loaded from a Hugging Face
`WhisperForConditionalGeneration` folder by tensor names.

    log-mel [B, mels, 2N] ─conv1,GELU─conv2 (stride 2),GELU─▶ + positions ─▶ encoder layers ─▶ norm
        ─▶ encoder output [B, N, d] ─each decoder layer's encoder_attn k_proj, v_proj─▶ cross K/V

    token rows of a step [T] ─▶ embedding + positions ─▶ decoder layers ─▶ norm ─▶ logits of some rows
        a decoder layer:  x += self_attn(norm x)     causal, over the request's self K/V pages
                          x += encoder_attn(norm x)  over the request's cross K/V pages
                          x += fc2(act(fc1(norm x)))

Module names are the checkpoint's without its `model.` prefix (`model.encoder.layers.0.fc1.weight`
is `encoder.layers[0].fc1.weight`), so loading goes by name. In the decoder every linear layer runs
over all rows of the step at once (selective batching); both attentions read the KV pool `[layers,
pages, 2, page_size, heads, head_dim]` through the LLM engine's paged attention backend, as
`DecoderContext` says. As in HF, queries are scaled before the product (`q_proj(x) * head_dim**-0.5`,
attention scale 1).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.model.context import AttentionBackend
from pagemesh.workers.model.loader import hf_folder_weights

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


@dataclass(frozen=True)
class WhisperConfig:
    """The shapes of a Whisper checkpoint, read from its config.json."""

    d_model: int
    encoder_layers: int
    encoder_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_heads: int
    decoder_ffn_dim: int
    num_mel_bins: int
    max_source_positions: int  # encoder output length (the input has twice as many mel frames)
    max_target_positions: int  # the longest decoder sequence, prompt included
    vocab_size: int
    activation: str = "gelu"
    scale_embedding: bool = False
    tie_word_embeddings: bool = True

    @classmethod
    def from_folder(cls, folder: Path) -> WhisperConfig:
        raw = json.loads((folder / "config.json").read_text())
        activation = raw.get("activation_function", "gelu")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"whisper: activation {activation!r} is not supported ({', '.join(_ACTIVATIONS)})")
        return cls(
            d_model=raw["d_model"],
            encoder_layers=raw["encoder_layers"],
            encoder_heads=raw["encoder_attention_heads"],
            encoder_ffn_dim=raw["encoder_ffn_dim"],
            decoder_layers=raw["decoder_layers"],
            decoder_heads=raw["decoder_attention_heads"],
            decoder_ffn_dim=raw["decoder_ffn_dim"],
            num_mel_bins=raw["num_mel_bins"],
            max_source_positions=raw["max_source_positions"],
            max_target_positions=raw["max_target_positions"],
            vocab_size=raw["vocab_size"],
            activation=activation,
            scale_embedding=raw.get("scale_embedding", False),
            tie_word_embeddings=raw.get("tie_word_embeddings", True),
        )

    @property
    def num_frames(self) -> int:
        """Mel frames of the encoder's input (conv2 halves them)."""
        return 2 * self.max_source_positions

    @property
    def decoder_head_dim(self) -> int:
        return self.d_model // self.decoder_heads


class WhisperAttention(nn.Module):
    """The projections of one attention block (k_proj has no bias, as in Whisper)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] -> scaled queries [..., heads, head_dim]."""
        return (self.q_proj(x) * self.scaling).unflatten(-1, (self.heads, self.head_dim))

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., d] -> K, V [..., heads, head_dim]."""
        shape = (self.heads, self.head_dim)
        return self.k_proj(x).unflatten(-1, shape), self.v_proj(x).unflatten(-1, shape)


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        self.self_attn = WhisperAttention(cfg.d_model, cfg.encoder_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.act = _ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, d], every position sees every other
        h = self.self_attn_layer_norm(x)
        q = self.self_attn.query(h).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in self.self_attn.keys_values(h))
        o = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        x = x + self.self_attn.out_proj(o.transpose(1, 2).flatten(2))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)  # sinusoids, as saved
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, mels, 2N] -> [B, N, d]
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


@dataclass
class DecoderContext:
    """What a decoder step reads besides its tokens: the KV pool, where each request's self and
    cross K/V are in it, and the device's paged attention (the LLM engine's:
    `pagemesh.workers.engine.backend.select_backend`).

    Cross-attention has no causal order, so `cross_attention` makes every row of the step a
    sequence of its own: one query, the request's cross pages as its block table, all
    max_source_positions keys as its context. All rows then go through one decode-shaped call,
    which reads the pages in place (the C and Triton kernels) or gathers them (the torch path)."""

    kv_cache: torch.Tensor  # [layers, pages, 2, page_size, heads, head_dim]
    self_attention: AttentionMetadata  # the requests' rows: positions, self K/V pages
    cross_attention: AttentionMetadata  # one sequence per row: its request's cross K/V pages
    backend: AttentionBackend


class WhisperDecoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        self.self_attn = WhisperAttention(cfg.d_model, cfg.decoder_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.encoder_attn = WhisperAttention(cfg.d_model, cfg.decoder_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.decoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.act = _ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, ctx: DecoderContext) -> torch.Tensor:  # x: [T, d]
        md = ctx.self_attention
        h = self.self_attn_layer_norm(x)
        q = self.self_attn.query(h)
        k, v = self.self_attn.keys_values(h)
        ctx.backend.write_kv(k, v, kv_layer, md)
        o = ctx.backend.attend(q, kv_layer, md, 1.0, k, v)
        x = x + self.self_attn.out_proj(o.flatten(1))
        q = self.encoder_attn.query(self.encoder_attn_layer_norm(x))
        o = ctx.backend.attend(q, kv_layer, ctx.cross_attention, 1.0)
        x = x + self.encoder_attn.out_proj(o.flatten(1))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        self.layers = nn.ModuleList(WhisperDecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)
        self.embed_scale = cfg.d_model**0.5 if cfg.scale_embedding else 1.0


class WhisperModel(nn.Module):
    """`encode(mel features) -> encoder output`; `cross_keys_values(encoder output)` yields each
    decoder layer's cross-attention K/V (computed once per request: the caller keeps them in
    pages); `decode(token rows, ctx, logit rows) -> fp32 logits` runs one flat batch of decoder rows
    (several requests, one or many rows each) against the pages `ctx` names, writing the rows'
    self-attention K/V there. The output projection is the token embedding unless the checkpoint
    unties it (`proj_out.weight`, with tie_word_embeddings false)."""

    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        self.config = cfg
        self.encoder = WhisperEncoder(cfg)
        self.decoder = WhisperDecoder(cfg)
        self.proj_out = None if cfg.tie_word_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """[B, mels, num_frames] log-mel -> [B, max_source_positions, d]."""
        return self.encoder(features.to(self.dtype))

    def cross_keys_values(self, encoded: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per decoder layer, in order: K, V [..., heads, head_dim] of `encoded` [..., d]."""
        for layer in self.decoder.layers:
            yield layer.encoder_attn.keys_values(encoded)

    def decode(self, token_ids: torch.Tensor, ctx: DecoderContext, logit_rows: torch.Tensor) -> torch.Tensor:
        """token_ids: [T] (positions: ctx.self_attention.positions) -> logits [len(logit_rows), vocab] fp32."""
        dec = self.decoder
        x = dec.embed_tokens(token_ids) * dec.embed_scale + dec.embed_positions(ctx.self_attention.positions)
        for layer, kv_layer in zip(dec.layers, ctx.kv_cache, strict=True):
            x = layer(x, kv_layer, ctx)
        h = dec.layer_norm(x[logit_rows])
        weight = dec.embed_tokens.weight if self.proj_out is None else self.proj_out.weight
        return F.linear(h, weight).float()


def load_whisper(folder: Path, dtype: torch.dtype, device: torch.device) -> WhisperModel:
    """The model in `folder` (config.json and safetensors, as `save_pretrained` writes them), every
    parameter loaded; ValueError for a tensor it does not know or a parameter the folder lacks."""
    cfg = WhisperConfig.from_folder(folder)
    with torch.device("meta"):
        model = WhisperModel(cfg)
    model = model.to_empty(device=device).to(dtype).eval()
    params = dict(model.named_parameters())
    missing = set(params)
    for name, tensor in hf_folder_weights(folder):
        key = name.removeprefix("model.")
        if key == "proj_out.weight" and model.proj_out is None:
            continue  # tied: the embedding is the output projection
        if key not in params:
            raise ValueError(f"whisper: unexpected tensor {name} in {folder}")
        if tuple(tensor.shape) != tuple(params[key].shape):
            raise ValueError(f"whisper: {name} has shape {tuple(tensor.shape)}, expected {tuple(params[key].shape)}")
        with torch.no_grad():
            params[key].copy_(tensor)
        missing.discard(key)
    if missing:
        raise ValueError(f"whisper: {folder} lacks {', '.join(sorted(missing))}")
    return model
