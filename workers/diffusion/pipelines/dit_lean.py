"""A DiT's transformer blocks as straight-line torch calls: the same functions on the same tensors
in the same order as diffusers' modules call them, without the module machinery between them.

Why: the embedded DiT is tiny, and a forward of its 4 blocks costs about 2 ms before its first
row (module calls, argument plumbing, the timestep embedding rebuilt in every block) against about
0.2 ms per row. A feature cache that skips the deep blocks on most rows of a step keeps paying that
fixed cost, so a cached step cost far more than its share of blocks (issue 33's wall-clock gap).

    timesteps ──sinusoid (once per forward, shared: every block's Timesteps has the same config)
    per block:  sinusoid ─▶ timestep MLP (+ class embedding) = its conditioning (`lean_conditioning`;
                block 0's is made once a forward and read by block 0, the final layer and TeaCache)
                conditioning ─▶ SiLU ─▶ adaLN linear ─▶ 6 chunks (`lean_modulated`)
                hidden ─▶ LayerNorm · (1 + scale) + shift ─▶ q k v ─▶ SDPA ─▶ out ─▶ · gate + hidden
                       ─▶ LayerNorm · (1 + scale) + shift ─▶ GELU(tanh) MLP ─▶ · gate + hidden

`lean_unsupported(transformer)` says why a model's blocks are not the ones written here (another
norm, cross-attention, another attention processor, training mode, ...); such a model keeps
diffusers' own block calls. tests/unit/test_dit_lean.py checks the numbers are diffusers' bit for
bit; dropout is skipped (the model is in eval mode, where it returns its input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lean_unsupported(transformer) -> str | None:
    """Why `transformer`'s blocks cannot take the lean path; None when they can."""
    from diffusers.models.activations import GELU
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.embeddings import CombinedTimestepLabelEmbeddings

    if transformer.training:
        return "the model is in training mode (dropout)"
    blocks = transformer.transformer_blocks
    for block in blocks:
        if block.norm_type != "ada_norm_zero" or not isinstance(
            getattr(block.norm1, "emb", None), CombinedTimestepLabelEmbeddings
        ):
            return "its blocks are not adaLN-Zero with a timestep and class embedding"
        attn, ff, mlp = block.attn1, block.ff, block.norm1.emb.timestep_embedder
        checks = {
            "self-attention only": block.attn2 is None and not block.only_cross_attention and block.pos_embed is None,
            "without feed-forward chunks": block._chunk_size is None,
            "on AttnProcessor2_0": type(attn.processor) is AttnProcessor2_0,
            "a plain attention": attn.norm_q is None
            and attn.norm_k is None
            and attn.group_norm is None
            and attn.spatial_norm is None
            and not attn.residual_connection
            and attn.rescale_output_factor == 1.0,
            "a GELU feed-forward": len(ff.net) == 3
            and isinstance(ff.net[0], GELU)
            and isinstance(ff.net[2], torch.nn.Linear),
            "a SiLU timestep MLP": isinstance(mlp.act, torch.nn.SiLU)
            and mlp.cond_proj is None
            and mlp.post_act is None,
        }
        for what, holds in checks.items():
            if not holds:
                return f"its blocks are not {what}"
    projections = {
        (p.num_channels, p.flip_sin_to_cos, p.downscale_freq_shift, p.scale)
        for p in (b.norm1.emb.time_proj for b in blocks)
    }
    if len(projections) != 1:
        return "its blocks' timestep projections differ"
    return None


def timestep_sinusoid(transformer, timesteps: torch.Tensor) -> torch.Tensor:
    """The timestep projection every block's embedding starts from (the same in every block)."""
    return transformer.transformer_blocks[0].norm1.emb.time_proj(timesteps)


def lean_conditioning(block, sinusoid: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block's conditioning [B, D]: its timestep MLP on the rows' sinusoid plus their class
    embedding (diffusers' CombinedTimestepLabelEmbeddings in eval mode). Block 0's is also the
    final layer's, and TeaCache's signal is made from it."""
    embed = block.norm1.emb
    mlp = embed.timestep_embedder
    t = F.linear(sinusoid.to(dtype=dtype), mlp.linear_1.weight, mlp.linear_1.bias)
    t = F.linear(F.silu(t), mlp.linear_2.weight, mlp.linear_2.bias)
    return t + F.embedding(labels, embed.class_embedder.embedding_table.weight)


def lean_modulated(block, hidden: torch.Tensor, conditioning: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The block's adaLN-Zero: (its attention input, LayerNorm(hidden) * (1 + scale) + shift, and
    the six modulation chunks)."""
    norm1 = block.norm1
    modulation = F.linear(F.silu(conditioning), norm1.linear.weight, norm1.linear.bias)
    chunks = modulation.chunk(6, dim=1)
    shift_msa, scale_msa = chunks[0], chunks[1]
    ln = norm1.norm
    x = F.layer_norm(hidden, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
    return x * (1 + scale_msa[:, None]) + shift_msa[:, None], chunks


def lean_block(
    block,
    hidden: torch.Tensor,
    sinusoid: torch.Tensor,
    labels: torch.Tensor,
    conditioning: torch.Tensor | None = None,
) -> torch.Tensor:
    """One block (see the module doc) on hidden [B, T, D]; `sinusoid` [B, 256] and `labels` [B]
    are the rows' timestep projection and class ids; `conditioning`: this block's
    (`lean_conditioning`), when the caller has it already."""
    attn, ff = block.attn1, block.ff
    if conditioning is None:
        conditioning = lean_conditioning(block, sinusoid, labels, hidden.dtype)
    x, (_, _, gate_msa, shift_mlp, scale_mlp, gate_mlp) = lean_modulated(block, hidden, conditioning)

    batch = x.shape[0]
    q = F.linear(x, attn.to_q.weight, attn.to_q.bias)
    k = F.linear(x, attn.to_k.weight, attn.to_k.bias)
    v = F.linear(x, attn.to_v.weight, attn.to_v.bias)
    head_dim = k.shape[-1] // attn.heads
    q = q.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
    k = k.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
    v = v.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
    out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(q.dtype)
    out = F.linear(out, attn.to_out[0].weight, attn.to_out[0].bias)
    out = out / attn.rescale_output_factor
    hidden = gate_msa.unsqueeze(1) * out + hidden

    ln = block.norm3
    x = F.layer_norm(hidden, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
    x = x * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    gelu, down = ff.net[0], ff.net[2]
    x = F.gelu(F.linear(x, gelu.proj.weight, gelu.proj.bias), approximate=gelu.approximate)
    x = F.linear(x, down.weight, down.bias)
    return gate_mlp.unsqueeze(1) * x + hidden
