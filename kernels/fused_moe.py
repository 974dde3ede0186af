"""Fused mixture-of-experts on CUDA: every expert's GEMM in one launch, rows gathered by route.

A route is one (token, slot) of the router's top-k: route r = token·k + slot. The launcher sorts
the routes by expert and pads each expert's run to a multiple of BLOCK_M (`align_routes`, torch,
no host synchronisation), so that each BLOCK_M-row block of the sorted list belongs to one expert:

    sorted_routes: | e0 e0 e0 -- | e1 e1 e1 e1 | e1 -- -- -- | e3 ...     (-- : padding)
    block_expert:  |     0       |     1       |     1       |  3  ...  -1 (no work)

`_moe_gemm_kernel` computes out[route] = A[row of route] @ W[expert]^T for a [BLOCK_M, BLOCK_N]
tile of one block; it runs twice: gate_up over x's rows (row = token), then down over the
activations' rows (row = route) with the routing weight applied. The sum over each token's k
routes is one torch reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemesh.kernels._util import check_launchable, upcast_bf16_dot


@triton.jit
def _moe_gemm_kernel(
    out_ptr,  # [R, N] R = T·k routes; row r written only where route r is routed here
    a_ptr,  # [T, K] (A_BY_TOKEN: row r // TOP_K) or [R, K] (row r); rows strided by stride_a
    w_ptr,  # [E_local, N, K] contiguous: each expert's weight as nn.Linear holds it
    sorted_routes_ptr,  # [num_blocks * BLOCK_M] int32: route ids by expert, padding = R
    block_expert_ptr,  # [num_blocks] int32: the local expert of each block, -1 for none
    route_weight_ptr,  # [R] fp32 (MUL_WEIGHT): each route's routing weight
    num_routes,  # R
    N,
    K,
    stride_a,
    stride_out,
    TOP_K: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 operands (bf16 under the interpreter)
    IEEE: tl.constexpr,  # fp32 inputs: keep them out of TF32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    routes = tl.load(sorted_routes_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    route_ok = routes < num_routes
    rows = (routes // TOP_K) if A_BY_TOKEN else routes
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_expert = w_ptr + expert.to(tl.int64) * N * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * stride_a + ks[None, :],
            mask=route_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_expert + cols[None, :].to(tl.int64) * K + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_N]: W^T's tile
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(route_weight_ptr + routes, mask=route_ok, other=0.0)[:, None]
    tl.store(
        out_ptr + routes[:, None].to(tl.int64) * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=route_ok[:, None] & col_ok[None, :],
    )


def align_routes(
    ids: torch.Tensor, num_local: int, first_expert: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_routes [num_blocks·block_m] int32, block_expert [num_blocks] int32) for ids [T, k]:
    the routes to local experts 0..num_local-1 (global id - first_expert), sorted by expert, each
    expert's run padded to block_m with R = T·k; blocks past the last run have expert -1. Shapes
    depend only on T, k, num_local and block_m (no host synchronisation: CUDA-graph safe)."""
    device = ids.device
    num_routes = ids.numel()
    num_blocks = triton.cdiv(num_routes, block_m) + num_local  # each expert pads by < block_m
    local = ids.flatten().long() - first_expert
    held = (local >= 0) & (local < num_local)
    key = torch.where(held, local, num_local)  # other ranks' experts: a bucket after the last
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts  # where each expert's routes start when sorted
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    bucket = sorted_key.clamp(max=num_local - 1)
    place = (padded_end - padded)[bucket] + torch.arange(num_routes, device=device) - run_start[bucket]
    trash = num_blocks * block_m  # where routes not held here go (one slot past the end, dropped)
    place = torch.where(sorted_key < num_local, place, trash)
    sorted_routes = torch.full((trash + 1,), num_routes, dtype=torch.int32, device=device)
    sorted_routes.scatter_(0, place, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1).to(torch.int32)
    return sorted_routes[:trash], block_expert


def _launch(out, a, w, sorted_routes, block_expert, route_weight, top_k, by_token, mul_weight, block_m):
    n, k = w.shape[1], w.shape[2]
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        out,
        a,
        w,
        sorted_routes,
        block_expert,
        route_weight,
        out.shape[0],
        n,
        k,
        a.stride(0),
        out.stride(0),
        TOP_K=top_k,
        A_BY_TOKEN=by_token,
        MUL_WEIGHT=mul_weight,
        UPCAST=upcast_bf16_dot(a.dtype),
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """`pagemesh.workers.model.moe.grouped_experts` on CUDA: [T, H] in x's dtype.

    x [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I]; weights [T, k] fp32; ids [T, k] (global
    expert ids; routes outside first_expert..first_expert+E_local-1 add nothing)."""
    check_launchable("fused_moe", x, w13, w2)
    from pagemesh.kernels.activation import silu_and_mul

    num_tokens, top_k = ids.shape
    hidden = x.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    block_m = 16 if num_tokens * top_k <= 64 * w13.shape[0] else 64  # decode: little padding
    sorted_routes, block_expert = align_routes(ids, w13.shape[0], first_expert, block_m)
    route_weight = weights.flatten().float().contiguous()
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _launch(gate_up, x, w13, sorted_routes, block_expert, route_weight, top_k, True, False, block_m)
    act = silu_and_mul(gate_up)  # rows of routes not held here are garbage, and never read below
    down = torch.zeros(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _launch(down, act, w2, sorted_routes, block_expert, route_weight, top_k, False, True, block_m)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
