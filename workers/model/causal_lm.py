"""What every decoder-only family shares: the embedding, the stack of decoder layers, the final
norm and the LM head, pipeline stages, pooling, and loading tensors named as in a Hugging Face
checkpoint. A family (`llama.py`, `qwen3.py`, `phi3.py`, `gemma.py`) subclasses `CausalLM` and
supplies its decoder layer and the names of its layers' tensors; `registry.py` maps architecture
names to it.

A decoder layer's contract: `layer(x, residual, ctx) -> (x, residual)`, the hidden state being
`x + residual` (residual None before the first layer), so each norm can add the residual as it
normalises; the model's final norm adds the last pair. Every layer has an `input_layernorm`
(whose weight's dtype is the model's) and reads KV pool layer `kv_index` (its index in this
stage).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.model.context import ForwardContext
from pagemesh.workers.model.layers import ParallelContext, RMSNorm, VocabEmbedding, linear
from pagemesh.workers.model.rope import RotaryEmbedding


class CausalLM(nn.Module):
    """forward(token ids [T], ctx, logit rows) -> logits [len(logit rows), vocab] in fp32; with
    `ctx.pool`, the sums of its spans of final-norm hidden states go to `ctx.pooled` as well.

    A pipeline stage (`layers`: a contiguous range of the model's layers, default all) holds only
    those decoder layers, the embedding if it is the first stage, the final norm and the LM head
    if it is the last; `self.layers[i]` is layer `layers.start + i` and reads KV pool layer i.
    A stage that is not the first takes the previous stage's activations (`hidden`); one that is
    not the last returns its own, `[2, T, hidden]`: the layers' output and the residual stream.

    A family overrides `make_layer` and `layer_tensor_names`/`load_layer_tensor`, and where it
    differs, `make_norm`, `embed`, `prepare_rope` and `logits_of`."""

    fits_fused_decode = False  # whether DecodeLayers' C code computes this family's layers exactly
    image_encoder = None  # a multimodal model's first stage: its vision side (workers/model/vision/encoder.py)

    def __init__(self, cfg: ModelConfig, tp: ParallelContext = ParallelContext(), layers: range | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.layer_range = layers if layers is not None else range(cfg.num_layers)
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == cfg.num_layers
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        start = self.layer_range.start
        self.layers = nn.ModuleList(self.make_layer(cfg, tp, i, i - start) for i in self.layer_range)
        self.norm = self.make_norm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling_dict)
        self.lm_head = None
        if self.is_last:
            tied = cfg.tie_word_embeddings and self.embed_tokens is not None
            self.lm_head = self.embed_tokens if tied else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)

    # ---- what a family supplies ---------------------------------------------------------------
    def make_layer(self, cfg: ModelConfig, tp: ParallelContext, index: int, kv_index: int) -> nn.Module:
        """Decoder layer `index` of the model, reading KV pool layer `kv_index`."""
        raise NotImplementedError

    def make_norm(self, hidden: int, eps: float) -> nn.Module:
        return RMSNorm(hidden, eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def prepare_rope(self, ctx: ForwardContext, x: torch.Tensor) -> None:
        """Fill the step's RoPE tables into `ctx`, once for every layer."""
        ctx.rope = ctx.ops.rope_tables(self.rotary.cos_sin_cache, ctx.metadata.positions, x.dtype)

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head over final-norm rows, in fp32."""
        head = self.lm_head
        return linear(x, head.weight, None, head.packed, torch.float32, invariant=head.batch_invariant)

    def layer_tensor_names(self, index: int) -> set[str]:
        """The checkpoint's tensors of decoder layer `index`, without `model.layers.{index}.`."""
        raise NotImplementedError

    def load_layer_tensor(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> bool:
        """Put one of a layer's tensors (`name` without its `model.layers.{i}.`) in place, sharded
        and fused; False: not a tensor of this family's layers."""
        raise NotImplementedError

    # ---- the forward pass ---------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The weights' and activations' dtype (every stage has a layer, so a norm to ask)."""
        return self.layers[0].input_layernorm.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        logit_rows: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.is_first:
            x, residual = self.embed(input_ids), None
            if ctx.image_rows is not None:  # an image's placeholders: its encoder rows instead
                rows, values = ctx.image_rows
                x[rows] = values.to(x.dtype)
        else:
            x, residual = hidden[0], hidden[1]
        fused = ctx.decode_layers
        if fused is not None and residual is None and fused.can_run(ctx.metadata, x):
            x, residual = fused.run(x, ctx.metadata)  # the loop below, bit for bit, without the Python
        else:
            self.prepare_rope(ctx, x)
            for layer in self.layers:
                x, residual = layer(x, residual, ctx)
        if not self.is_last:
            # both halves, not their sum: the next stage's first norm adds them as this one would
            return torch.stack((x, residual))
        x, _ = self.norm(x, residual, ctx.ops)
        if ctx.pool is not None:
            ctx.pooled = ctx.pool.sum(x)
        return self.logits_of(x[logit_rows])

    # ---- weights ------------------------------------------------------------------------------
    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take tensors named as in a Hugging Face checkpoint; shard and fuse them in place."""
        loaded: set[str] = set()
        for name, tensor in weights:
            self._load_one(name, tensor)
            loaded.add(name)
        missing = self._expected_names() - loaded
        if missing:
            raise ValueError(f"model: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _load_one(self, name: str, t: torch.Tensor) -> None:
        tied = self.config.tie_word_embeddings
        if name == "model.embed_tokens.weight":
            if self.embed_tokens is not None:
                self.embed_tokens.weight.data.copy_(t)
            if self.lm_head is not None and self.lm_head is not self.embed_tokens and tied:
                self.lm_head.weight.data.copy_(t)  # a last stage without the embedding: the tied head
            return
        if name == "model.norm.weight":
            if self.norm is not None:
                self.norm.weight.data.copy_(t)
            return
        if name == "lm_head.weight":
            if not tied and self.lm_head is not None:
                self.lm_head.weight.data.copy_(t)
            return
        m = self._LAYER.fullmatch(name)
        if m is None:
            if name.endswith("rotary_emb.inv_freq"):
                return
            raise ValueError(f"model: unexpected tensor {name}")
        index = int(m.group(1))
        if index not in self.layer_range:
            if index >= self.config.num_layers:
                raise ValueError(f"model: unexpected tensor {name}")
            return  # another pipeline stage's layer
        if not self.load_layer_tensor(self.layers[index - self.layer_range.start], m.group(2), t):
            raise ValueError(f"model: unexpected tensor {name}")

    def _expected_names(self) -> set[str]:
        """The checkpoint's tensors this stage needs (all of them without pipeline stages)."""
        names = set()
        if self.is_first or (self.is_last and self.config.tie_word_embeddings):
            names.add("model.embed_tokens.weight")
        if self.is_last:
            names.add("model.norm.weight")
            if not self.config.tie_word_embeddings:
                names.add("lm_head.weight")
        for i in self.layer_range:
            names |= {f"model.layers.{i}.{rest}" for rest in self.layer_tensor_names(i)}
        return names

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (benchmarks of large shapes with nothing to download); norms get the
        weight that leaves their input's scale alone (`identity_weight`: 1, or 0 for (1 + w))."""
        gen = torch.Generator(device=self.rotary.cos_sin_cache.device).manual_seed(seed)
        norms = {id(m.weight): m.identity_weight for m in self.modules() if hasattr(m, "identity_weight")}
        for p in self.parameters():
            if id(p) in norms:
                p.data.fill_(norms[id(p)])
            else:
                p.data.normal_(0.0, std, generator=gen)
