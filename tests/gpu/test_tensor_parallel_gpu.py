"""Tensor parallel on CUDA (run by scripts/gpu_check.sh with the other GPU tests; skipped unless
two GPUs are visible): this process is rank 0 on the first GPU, `FollowerRanks` starts rank 1 on
the second, the all-reduces go over NCCL. The logits of every step (mixed prefill chunks and
decodes, a copy-on-write page, a swap to host memory and back) equal the single-rank model's
on the first GPU, within fp32 tolerance. Not run in the session that wrote it (no two GPUs)."""

import pytest
import torch

from pagemesh.tests.integration.test_tensor_parallel import NUM_PAGES, PAGE_SIZE, steps, tiny_llama  # noqa: F401
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.engine.tensor_parallel import FollowerRanks, FollowerSpec, rank_context
from pagemesh.workers.model.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def test_two_ranks_on_two_gpus_give_the_single_rank_logits(tiny_llama):  # noqa: F811
    gpu = torch.device("cuda:0")
    single = ModelRunner(load_model(tiny_llama, torch.float32, gpu), NUM_PAGES, PAGE_SIZE, gpu, cuda_graphs=False)
    want = [single.execute(step).clone() for step in steps()]
    model = load_model(tiny_llama, torch.float32, gpu, rank_context(0, 2, None, 0, torch.float32))
    followers = FollowerRanks(FollowerSpec(tiny_llama, "float32", "cuda", NUM_PAGES, PAGE_SIZE, 2, threads=1))
    try:
        runner = ModelRunner(model, NUM_PAGES, PAGE_SIZE, gpu, followers=followers)
        assert runner.graphs is None  # no CUDA graphs across ranks
        got = [runner.execute(step).clone() for step in steps()]
    finally:
        followers.close()
        torch.distributed.destroy_process_group()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)
