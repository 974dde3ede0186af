"""Qwen2-VL's language model: Qwen2 (Llama's layers with q/k/v biases) whose RoPE is M-RoPE.

An image's placeholders sit at (temporal, height, width) positions of their own; every text
token at one position p on all three (common/mrope.py). M-RoPE splits the head's rotary
frequencies into `mrope_section` runs, the first rotated by the temporal position, the next by
the height, the last by the width: a token's cos/sin row takes frequency f from the table row of
its position in f's stream. For a text token the three rows are the same row: plain RoPE, so a
step without image prompts (ctx.mrope_positions None) runs as Qwen2 does, fused decode included.
The vision side is `vision/qwen2_vl.py`; the encoder step runs it (`vision/encoder.py`).
"""

from __future__ import annotations

import torch

from pagemesh.common.model_config import ModelConfig
from pagemesh.common.mrope import mrope_frequency_streams
from pagemesh.workers.model.context import ForwardContext
from pagemesh.workers.model.layers import ParallelContext
from pagemesh.workers.model.llama import LlamaForCausalLM


class Qwen2VLForCausalLM(LlamaForCausalLM):
    """Qwen2 with M-RoPE (CausalLM's contract): `prepare_rope` builds one cos/sin row per token
    from its three positions when the step has an image prompt."""

    def __init__(self, cfg: ModelConfig, tp: ParallelContext = ParallelContext(), layers: range | None = None):
        super().__init__(cfg, tp, layers)
        streams = torch.tensor(mrope_frequency_streams(cfg.mrope_section), dtype=torch.int64)
        self.register_buffer("mrope_streams", streams, persistent=False)  # [head_dim / 2]: each frequency's stream

    def prepare_rope(self, ctx: ForwardContext, x: torch.Tensor) -> None:
        if ctx.mrope_positions is None:
            return super().prepare_rope(ctx, x)
        table = self.rotary.cos_sin_cache  # [max_pos, head_dim]: cos of each frequency, then sin
        half = table.shape[1] // 2
        freqs = torch.arange(half, device=table.device)
        rows = ctx.mrope_positions[self.mrope_streams].T  # [T, half]: the position each frequency turns by
        per_token = torch.cat((table[rows, freqs], table[rows, freqs + half]), dim=-1)  # [T, head_dim]
        positions = torch.arange(per_token.shape[0], device=table.device)
        ctx.rope = ctx.ops.rope_tables(per_token, positions, x.dtype)
