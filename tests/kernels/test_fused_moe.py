"""The Triton fused-MoE kernel (kernels/fused_moe.py) against the torch grouped path
(workers/model/moe.py), under TRITON_INTERPRET=1 at small shapes (and on a GPU, marked gpu)."""

import pytest
import torch

from pagemesh.kernels._util import interpreting
from pagemesh.workers.model.moe import grouped_experts, route

pytestmark = [
    pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or CUDA"),
    # the gate_up rows of routes another rank holds are never written, and never read: the
    # interpreter's numpy warns when the activation runs over their uninitialised values
    pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def problem(tokens, hidden, inter, experts, top_k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = route(logits, top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def test_align_routes_pads_each_expert_to_the_block():
    from pagemesh.kernels.fused_moe import align_routes

    ids = torch.tensor([[2, 0], [2, 5], [0, 2], [4, 2]])  # routes 0..7; expert 5 is another rank's
    sorted_routes, block_expert = align_routes(ids, num_local=3, first_expert=0, block_m=4)
    assert block_expert.tolist() == [0, 2, -1, -1, -1]  # 8 routes / 4 + 3 experts = 5 blocks
    pad = 8
    assert sorted_routes.tolist() == [1, 4, pad, pad, 0, 2, 5, 7] + [pad] * 12
    sorted_routes, block_expert = align_routes(ids, num_local=2, first_expert=4, block_m=4)  # experts 4, 5 here
    assert block_expert.tolist()[:2] == [0, 1] and sorted_routes.tolist()[:8] == [6, pad, pad, pad, 3, pad, pad, pad]


@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k, dtype",
    [
        (1, 32, 16, 4, 2, torch.float32),  # one decode row
        (9, 48, 40, 8, 2, torch.float32),  # sizes off the block sizes
        (40, 64, 32, 8, 3, torch.bfloat16),  # prefill-sized: BLOCK_M 16, several blocks per expert
        (70, 32, 16, 2, 2, torch.float32),  # BLOCK_M 64: every token to both experts
    ],
)
def test_fused_moe_equals_grouped_torch(tokens, hidden, inter, experts, top_k, dtype):
    from pagemesh.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = problem(tokens, hidden, inter, experts, top_k, dtype)
    got = fused_moe(x, w13, w2, weights, ids)
    expected = grouped_experts(x.float(), w13.float(), w2.float(), weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


def test_fused_moe_expert_parallel_shard():
    """A rank holding experts 4..7 of 8 adds only their routes' contributions."""
    from pagemesh.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = problem(12, 32, 16, 8, 2, torch.float32, seed=1)
    got = fused_moe(x, w13[4:], w2[4:], weights, ids, first_expert=4)
    torch.testing.assert_close(got, grouped_experts(x, w13[4:], w2[4:], weights, ids, 4), rtol=1e-4, atol=1e-4)
    assert got.abs().sum() > 0
