"""The parts of a tensor-parallel worker that need no second process: the step's wire form
(msgpack, what rank 0 writes down each follower's pipe), the check that the sizes divide the
heads, and the shared-memory all-reduce (its ranks as threads here; as processes in
tests/integration/test_tensor_parallel.py)."""

from __future__ import annotations

import io
import threading

import msgpack
import pytest
import torch

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.engine.model_input import ModelInput, decode_model_input, encode_model_input
from pagemesh.workers.engine.tensor_parallel import check_tensor_parallel, follower_step, read_step, write_step
from pagemesh.workers.model.shm_allreduce import SharedMemoryAllReduce, create_file

STEP = ModelInput(
    [5, 6, 7, 8],
    [1, 3],
    [9, 3],
    [[4, 2], [7]],
    [0, 3],
    [1, 2],
    1,
    page_copies=[(2, 6)],
    swap_out=[(5, [1, 2])],
    swap_in=[(6, [7])],
    swap_discard=[8],
    pool_spans=[(1, 4)],
    lora_rows=[0, -1, -1, -1],
    lora_loads=[(0, "/adapters/sql")],
)


def test_a_step_crosses_the_pipe_as_it_was_and_the_pipe_ends_with_none():
    pipe = io.BytesIO()
    write_step(pipe, STEP)
    write_step(pipe, STEP)
    pipe.seek(0)
    for _ in range(2):
        got = read_step(pipe)
        assert got.token_ids == STEP.token_ids and got.block_tables == STEP.block_tables
        assert got.logit_rows == [0, 3, 1, 2] and got.num_decodes == 1
        assert [tuple(p) for p in got.page_copies] == [(2, 6)]
        assert [(s, list(p)) for s, p in got.swap_out] == [(5, [1, 2])] and got.swap_discard == [8]
        assert [tuple(s) for s in got.pool_spans] == [(1, 4)]
        assert got.lora_rows == [0, -1, -1, -1] and [tuple(x) for x in got.lora_loads] == [(0, "/adapters/sql")]
    assert read_step(pipe) is None  # end of file: rank 0 is gone
    whole = io.BytesIO()
    write_step(whole, STEP)
    assert read_step(io.BytesIO(whole.getvalue()[:-1])) is None  # cut short: rank 0 died mid-write
    assert decode_model_input(encode_model_input(STEP)) == decode_model_input(whole.getvalue()[8:])


def test_decode_refuses_what_is_not_a_model_input():
    with pytest.raises(ValueError, match="expected 18 fields"):
        decode_model_input(msgpack.packb([1, 2, 3]))
    with pytest.raises(ValueError, match="expected 18 fields"):
        decode_model_input(msgpack.packb({"token_ids": []}))


def test_a_follower_neither_samples_nor_pools():
    """Rank 0 pools the hidden states (the all-reduces leave the whole of them on every rank);
    the last pipeline stage's tp rank 0, which computes the logits for rank 0, does not pool."""
    for computes_logits in (False, True):
        step = follower_step(STEP, computes_logits)
        assert step.pool_spans == [] and step.token_ids == STEP.token_ids
        assert step.logit_rows == (STEP.logit_rows if computes_logits else [])


def cfg(heads: int, kv_heads: int, intermediate: int = 1536) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=100,
        hidden_size=heads * 64,
        intermediate_size=intermediate,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


def test_sizes_that_do_not_divide_the_heads_are_named():
    check_tensor_parallel(cfg(9, 3), 3)
    check_tensor_parallel(cfg(9, 3), 1)
    with pytest.raises(ValueError, match=r"^tensor-parallel size 2 does not divide the model's 9 query heads and 3 KV"):
        check_tensor_parallel(cfg(9, 3), 2)
    with pytest.raises(ValueError, match=r"size 4 does not divide the model's 6 KV heads \(it has 8 query heads"):
        check_tensor_parallel(cfg(8, 6, 1024), 4)
    with pytest.raises(ValueError, match="MLP intermediate size"):
        check_tensor_parallel(cfg(4, 4, 1030), 4)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_tensor_parallel(cfg(4, 4), 0)


def test_the_shared_memory_all_reduce_sums_every_ranks_tensor_in_place(tmp_path):
    path, world, numel = str(tmp_path / "shm"), 3, 64
    create_file(path, world, numel, torch.float32)
    ranks = [SharedMemoryAllReduce(path, r, world, numel, torch.float32, timeout=300) for r in range(world)]
    results: dict[int, list[torch.Tensor]] = {}

    def run(rank: int) -> None:  # five rounds of different sizes: both buffers reused
        outs = []
        for k in range(5):
            x = torch.full((k + 1, 8), float(10 * k + rank))
            outs.append(ranks[rank].all_reduce(x))
        results[rank] = outs

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in range(world):
        for k, out in enumerate(results[rank]):
            assert out.shape == (k + 1, 8) and torch.all(out == 3 * 10 * k + 0 + 1 + 2)
    assert ranks[0].fits(torch.zeros(8, 8)) and not ranks[0].fits(torch.zeros(9, 8))
    assert not ranks[0].fits(torch.zeros(2, dtype=torch.bfloat16))


def test_a_rank_that_never_arrives_is_an_error_not_a_hang(tmp_path):
    path = str(tmp_path / "shm")
    create_file(path, 2, 16, torch.float32)
    alone = SharedMemoryAllReduce(path, 0, 2, 16, torch.float32, timeout=0.2)
    with pytest.raises(RuntimeError, match="a rank did not reach all-reduce 1"):
        alone.all_reduce(torch.ones(4))


def test_pagemesh_up_passes_the_size_to_mixed_prefill_and_decode_workers(tmp_path):
    from pagemesh.services import launcher

    args = launcher.parse(["--mixed", "1", "-tp", "3"])
    [worker] = [argv for name, argv in launcher.plan(args, str(tmp_path)) if name == "mixed-0"]
    assert worker[worker.index("--tensor-parallel-size") + 1] == "3"
    args = launcher.parse(["-tp", "3"])  # the default mesh: one prefill and one decode worker, 3 ranks each
    pair = [argv for name, argv in launcher.plan(args, str(tmp_path)) if name in ("prefill-0", "decode-0")]
    assert [argv[argv.index("--tensor-parallel-size") + 1] for argv in pair] == ["3", "3"]
