"""Each model family's layers through the Triton ops a GPU runs (`TritonOps`: RMSNorm on each
head of q and k for Qwen3, RoPE with YaRN's scaled tables, Gemma 3's second RoPE) give the torch
ops' logits, on a GPU or in Triton's interpreter (issue 30). Attention is the torch backend in
both runs: only the ops differ."""

import pytest
import torch

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.backend import TorchAttentionBackend
from pagemesh.workers.model.context import ForwardContext
from pagemesh.workers.model.loader import build_random_model
from pagemesh.workers.model.ops import TorchOps, TritonOps

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    head_dim=16,
    tie_word_embeddings=False,
    sliding_window=4,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "max_window_layers": 2}),
        ("Phi3ForCausalLM", {}),
        ("Gemma2ForCausalLM", {}),
        ("Gemma3ForCausalLM", {"sliding_window_pattern": 2, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("LlamaForCausalLM", {"rope_parameters": YARN, "sliding_window": None}),
    ],
)
def test_triton_ops_give_the_torch_ops_logits(arch, extra):
    cfg = ModelConfig.from_hf_dict({"architectures": [arch], **SHAPE, **extra})
    model = build_random_model(cfg, torch.float32, DEVICE, seed=3)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:  # norms that are not all alike
            p.data.add_(torch.randn(p.shape, generator=gen).to(DEVICE) * 0.3)
    # two sequences: one prompt of 10 tokens, one of 3 (pages of 4 slots)
    md = AttentionMetadata.build([10, 3], [10, 3], [[1, 2, 3], [4]], 4, DEVICE, for_cpu=True, decode_gather=True)
    ids = torch.randint(0, 320, (13,), generator=gen).to(DEVICE)
    logits = []
    for ops in (TorchOps(), TritonOps()):
        kv = torch.zeros(cfg.num_layers, 8, 2, 4, cfg.num_kv_heads, cfg.head_dim, device=DEVICE)
        ctx = ForwardContext(kv, md, TorchAttentionBackend(), ops)
        logits.append(model(ids, ctx, torch.arange(13, device=DEVICE)))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=2e-5)
