"""The mixture-of-experts block (workers/model/moe.py) against transformers' own blocks
(MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock) with random fp32 weights, and its tensor- and
expert-parallel shards against the whole."""

from types import SimpleNamespace

import pytest
import torch

from pagemesh.workers.model.layers import ParallelContext
from pagemesh.workers.model.moe import SparseMoE, every_expert, grouped_experts, per_expert_loop, route
from pagemesh.workers.model.ops import TorchOps

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 32, 24, 8, 2, 37
CTX = SimpleNamespace(ops=TorchOps())


def hf_block(family: str, norm_topk_prob: bool = False):
    import transformers

    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
        )
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            norm_topk_prob=norm_topk_prob,
        )
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block.eval()


def ours_from(block, renormalize: bool, tp: ParallelContext = ParallelContext()) -> SparseMoE:
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, renormalize, tp)
    moe.gate.data.copy_(block.gate.weight)
    moe.load_stacked("gate_up_proj", block.experts.gate_up_proj.data)
    moe.load_stacked("down_proj", block.experts.down_proj.data)
    return moe


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "family, norm_topk_prob, renormalize",
    [("mixtral", False, True), ("qwen3_moe", False, False), ("qwen3_moe", True, True)],
)
def test_block_equals_transformers(family, norm_topk_prob, renormalize):
    block = hf_block(family, norm_topk_prob)
    x = tokens()
    with torch.inference_mode():
        expected = block(x[None])[0]
        got = ours_from(block, renormalize)(x, CTX)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_route_variants():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 3.0, 0.5]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 2], [1, 2]] or ids.tolist() == [[0, 2], [2, 1]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, ids = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), -1))  # Mixtral's form
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


def test_grouped_equals_per_expert_loop_with_idle_experts():
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen)
    x = tokens(4)
    ids = torch.randint(0, 3, (TOKENS, TOP_K), generator=gen)  # experts 3..7 get nothing
    ids[:, 1] = (ids[:, 0] + 1) % 3
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    grouped = grouped_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(grouped, per_expert_loop(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grouped, every_expert(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-4)
    held = grouped_experts(x, w13[2:5], w2[2:5], weights, ids, first_expert=2)  # an expert-parallel rank's
    torch.testing.assert_close(held, every_expert(x, w13[2:5], w2[2:5], weights, ids, 2), rtol=1e-5, atol=1e-4)
    empty = torch.zeros(0, TOP_K, dtype=torch.int64)
    assert grouped_experts(x[:0], w13, w2, weights[:0], empty).shape == (0, HIDDEN)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rank_shards_sum_to_the_whole(expert_parallel):
    """What each of 2 ranks computes before the all-reduce sums to the single-rank output:
    tensor parallelism (every expert's intermediate halves) and expert parallelism (experts
    0-3 on rank 0, 4-7 on rank 1)."""
    block = hf_block("mixtral")
    x = tokens(5)
    whole = ours_from(block, True)
    weights, ids = route(torch.nn.functional.linear(x, whole.gate), TOP_K, True)
    parts = []
    for rank in range(2):
        moe = ours_from(block, True, ParallelContext(rank, 2, expert_parallel=expert_parallel))
        if expert_parallel:
            assert moe.experts == range(4 * rank, 4 * rank + 4) and moe.w13.shape == (4, 2 * INTER, HIDDEN)
        else:
            assert moe.experts == range(EXPERTS) and moe.w2.shape == (EXPERTS, HIDDEN, INTER // 2)
        parts.append(grouped_experts(x, moe.w13, moe.w2, weights, ids, moe.experts.start))
    with torch.inference_mode():
        expected = whole(x, CTX)
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-5)


def hf_config(architecture: str, **fields) -> dict:
    import transformers

    config_class = {
        "MixtralForCausalLM": transformers.MixtralConfig,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    }
    return {**config_class[architecture](**fields).to_dict(), "architectures": [architecture]}


def test_moe_config_as_transformers_reads_it():
    from pagemesh.common.model_config import ModelConfig, MoEConfig

    mixtral = ModelConfig.from_hf_dict(hf_config("MixtralForCausalLM", num_hidden_layers=2, num_local_experts=4))
    assert mixtral.moe == MoEConfig(4, 2, 14336, True, ())
    qwen = ModelConfig.from_hf_dict(
        hf_config(
            "Qwen3MoeForCausalLM",
            num_hidden_layers=4,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        )
    )
    # sparse where (i + 1) % 2 == 0 and i is not in mlp_only_layers: layer 1 only
    assert qwen.moe == MoEConfig(16, 4, 64, True, (0, 2, 3)) and qwen.qk_norm
    with pytest.raises(ValueError, match="num_experts_per_tok=9 with 8 experts"):
        ModelConfig.from_hf_dict(hf_config("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=9))


def test_tensor_parallel_sizes_of_a_moe():
    from pagemesh.common.model_config import ModelConfig
    from pagemesh.workers.engine.tensor_parallel import check_tensor_parallel

    cfg = ModelConfig.from_hf_dict(
        hf_config(
            "MixtralForCausalLM",
            num_attention_heads=4,
            num_key_value_heads=4,
            num_local_experts=6,
            intermediate_size=32,
        )
    )
    check_tensor_parallel(cfg, 4)  # every expert's 32 rows in 4 slices
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):
        check_tensor_parallel(cfg, 4, expert_parallel=True)
    check_tensor_parallel(cfg, 2, expert_parallel=True)  # 3 whole experts a rank


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_quantized_experts_match_dense_and_shard_like_them():
    """int8 experts (`--quantization int8`) and a GGUF's blocks (`install_gguf`, here int8 blocks
    by the loader's names) give the dense block's output up to int8 rounding, whole or as the
    shards of 2 tensor- or expert-parallel ranks; a shard that would split a block is refused."""
    from pagemesh.kernels.quantized import quantize_int8

    hidden, inter, experts = 64, 64, 4
    gen = torch.Generator().manual_seed(7)
    full = {
        part: torch.randn(experts, *shape, generator=gen) * 0.2
        for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))
    }
    router = torch.randn(experts, hidden, generator=gen)

    def block(tp: ParallelContext, size: int = inter) -> SparseMoE:
        moe = SparseMoE(hidden, size, experts, 2, True, tp)
        moe.gate.data.copy_(router)
        for e in range(experts):
            for part, w in full.items():
                moe.load_expert(e, part, w[e, :size] if part != "down" else w[e, :, :size])
        return moe

    x = torch.randn(9, hidden, generator=gen)
    dense = block(ParallelContext())
    expected = dense(x, CTX)
    assert dense.quantize_int8() == 2 * experts and dense.w13.numel() == 0
    assert relative_error(dense(x, CTX), expected) < 0.02

    blocks = {
        f"mlp.experts.{e}.{part}_proj.weight": quantize_int8(w[e]) for part, w in full.items() for e in range(experts)
    }
    weights, ids = route(torch.nn.functional.linear(x, router), 2, True)
    for expert_parallel in (False, True):
        parts = []
        for rank in range(2):
            moe = block(ParallelContext(rank, 2, expert_parallel=expert_parallel))
            assert moe.install_gguf(blocks, "mlp.") == 2 * len(moe.experts)
            parts.append(grouped_experts(x, *moe.quantized, weights, ids, moe.experts.start))
        assert relative_error(parts[0] + parts[1], expected) < 0.02
    shapes = {"gate": (96, hidden), "up": (96, hidden), "down": (hidden, 96)}  # 96 rows: 48 a rank
    odd = {f"mlp.experts.{e}.{p}_proj.weight": quantize_int8(torch.zeros(shapes[p])) for p in shapes for e in range(4)}
    with pytest.raises(ValueError, match="do not fall on blocks of 32"):
        SparseMoE(hidden, 96, experts, 2, True, ParallelContext(0, 2)).install_gguf(odd, "mlp.")


def test_enable_expert_parallel_flag_travels_to_the_worker_and_its_ranks():
    import argparse

    from pagemesh.workers.engine.config import add_engine_arguments, engine_args_to_argv, engine_config_from_args
    from pagemesh.workers.engine.rank import parse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["-tp", "2", "--enable-expert-parallel"])
    assert engine_config_from_args(args).enable_expert_parallel
    assert "--enable-expert-parallel" in engine_args_to_argv(args)  # what `pagemesh up` hands each worker
    assert not engine_config_from_args(parser.parse_args([])).enable_expert_parallel
    rank = ["--rank=1", "--world-size=2", "--init-method=file:///x", "--model=m", "--dtype=float32"]
    rank += ["--device=cpu", "--num-pages=4", "--page-size=16", "--threads=1"]
    assert parse([*rank, "--enable-expert-parallel"]).enable_expert_parallel and not parse(rank).enable_expert_parallel
