"""What tensor parallel buys on GPUs, from roofline figures rather than a run: weights and KV
capacity per GPU, all-reduce bytes per token, and a decode step's time bound. Pure arithmetic
over a `ModelConfig` (no torch), so it is checked exactly in tests/unit/test_parallel_model.py.

Megatron-style sharding as pagemesh does it: each of N GPUs holds 1/N of every layer's attention
heads (Q, K, V columns, O rows) and MLP (gate/up columns, down rows); the embedding and the LM
head are replicated; each layer all-reduces `[tokens, hidden]` twice (after o_proj and down_proj).
A decode step on one GPU is bound below by reading its weights and the batch's KV from HBM, by
its FLOPs, and adds the all-reduces over NVLink (a ring: 2(N-1)/N of the bytes, plus a fixed
latency per collective).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagemesh.common.model_config import ModelConfig


@dataclass(frozen=True)
class Gpu:
    """Roofline figures of one GPU and its links (defaults: an H200 SXM's data sheet)."""

    name: str = "H200"
    hbm_bytes: float = 141e9
    hbm_bytes_per_s: float = 4.8e12
    bf16_flops_per_s: float = 990e12  # dense
    link_bytes_per_s: float = 900e9  # NVLink, one direction's aggregate
    all_reduce_latency_s: float = 10e-6  # fixed cost of one small NCCL all-reduce (an assumption)
    kv_share: float = 0.9  # of the memory left after weights, what the KV pool may take


H200 = Gpu()

LLAMA_3_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def layer_params(cfg: ModelConfig) -> int:
    """Weights of one decoder layer that tensor parallel splits (norms aside: replicated, tiny)."""
    q = cfg.hidden_size * cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim
    o = cfg.num_heads * cfg.head_dim * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return q + kv + o + mlp


def replicated_params(cfg: ModelConfig) -> int:
    """The embedding, and the LM head unless tied: every rank holds them whole."""
    embedding = cfg.vocab_size * cfg.hidden_size
    return embedding if cfg.tie_word_embeddings else 2 * embedding


def params_per_gpu(cfg: ModelConfig, tp: int) -> int:
    return cfg.num_layers * layer_params(cfg) // tp + replicated_params(cfg)


@dataclass(frozen=True)
class TensorParallelPoint:
    """One model at one tensor-parallel size on one GPU kind (bf16 weights and KV)."""

    tp: int
    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    kv_tokens: float  # tokens of KV the group holds (each GPU holds every token's 1/N)
    all_reduce_bytes_per_token: float  # a step's all-reduce payload per token (2 per layer)
    link_bytes_per_token_per_gpu: float  # what a ring moves over each GPU's links, per token
    decode_step_s: float  # lower bound on a decode step of `batch` sequences
    batch: int
    context: int

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.decode_step_s


def tensor_parallel_point(
    cfg: ModelConfig, tp: int, gpu: Gpu = H200, batch: int = 64, context: int = 2048, dtype_bytes: int = 2
) -> TensorParallelPoint:
    """The model of `cfg` split `tp` ways, a decode step of `batch` sequences of `context` tokens.

    step >= max(HBM read of weights + the batch's KV, FLOPs) + 2 * layers all-reduces of
    `batch * hidden` values, each latency + ring bytes / link bandwidth."""
    weights = params_per_gpu(cfg, tp) * dtype_bytes
    kv_per_token = cfg.kv_bytes_per_token(dtype_bytes, tp)
    kv_tokens = max(0.0, (gpu.hbm_bytes - weights) * gpu.kv_share) / kv_per_token
    all_reduce_per_token = 2 * cfg.num_layers * cfg.hidden_size * dtype_bytes
    ring = 2 * (tp - 1) / tp
    memory_s = (weights + batch * context * kv_per_token) / gpu.hbm_bytes_per_s
    compute_s = 2 * params_per_gpu(cfg, tp) * batch / gpu.bf16_flops_per_s
    collectives = 0 if tp == 1 else 2 * cfg.num_layers
    link_s = collectives * gpu.all_reduce_latency_s + ring * all_reduce_per_token * batch / gpu.link_bytes_per_s
    return TensorParallelPoint(
        tp=tp,
        weight_bytes_per_gpu=weights,
        kv_bytes_per_token_per_gpu=kv_per_token,
        kv_tokens=kv_tokens,
        all_reduce_bytes_per_token=all_reduce_per_token if tp > 1 else 0,
        link_bytes_per_token_per_gpu=ring * all_reduce_per_token,
        decode_step_s=max(memory_s, compute_s) + link_s,
        batch=batch,
        context=context,
    )


def valid_sizes(cfg: ModelConfig, candidates: tuple[int, ...] = (1, 2, 3, 4, 8)) -> list[int]:
    """The sizes that divide the query heads, the KV heads and the MLP (as `check_tensor_parallel`)."""
    return [
        n for n in candidates if cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0 and cfg.intermediate_size % n == 0
    ]
