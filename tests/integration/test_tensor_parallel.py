"""Tensor parallel inside a worker: the real rank processes (`FollowerRanks` starts them; gloo on
loopback, or the shared-memory all-reduce), this test process being rank 0, on a tiny random Llama
whose heads divide by 2 and 4.
The logits of every step equal the single-rank model's, over mixed prefill chunks and decodes,
copy-on-write page copies and prompt-logprob rows."""

from __future__ import annotations

import os

import pytest
import torch

from pagemesh.common.model_config import read_model_config
from pagemesh.workers.engine.model_input import ModelInput
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.engine.tensor_parallel import (
    FollowerRanks,
    FollowerSpec,
    check_tensor_parallel,
    create_shared_all_reduce,
    rank_context,
)
from pagemesh.workers.model.loader import load_model

PAGE_SIZE = 4
NUM_PAGES = 48


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-llama-tp")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def steps() -> list[ModelInput]:
    """Steps of four sequences: A's prompt in two chunks, B's in one, then decodes mixed with C's
    prompt chunks; D forks from B (copy-on-write of B's last page) and decodes; A is swapped out
    to host memory (its page 1 overwritten meanwhile) and back into other pages, and decodes."""
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (14, 6, 21))
    pa, pb, pc, pd = [1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14], [6, 15, 16]
    pa2 = [17, 18, 19, 20, 21]
    return [
        # A chunk 0..10, B whole prompt (samples); B also scores its prompt
        ModelInput(a[:10] + b, [10, 6], [10, 6], [pa, pb], [15], [10, 11, 12, 13, 14]),
        # B decodes, A's last chunk (samples), C's first chunk
        ModelInput([b[-1]] + a[10:] + c[:5], [1, 4, 5], [7, 14, 5], [pb, pa, pc], [0, 4], [], 1),
        # D = a fork of B: copy B's partly filled page 7 to 15; A, B, D decode; C's last chunk
        ModelInput(
            [a[-1], b[0], b[1]] + c[5:],
            [1, 1, 1, 16],
            [15, 8, 8, 21],
            [pa, pb, pd, pc],
            [0, 1, 2, 18],
            [],
            3,
            page_copies=[(7, 15)],
        ),
        # A preempted by swap: its pages go to host memory (page 1 is reused at once); B decodes
        ModelInput([b[2]], [1], [9], [pb], [0], [], 1, swap_out=[(0, pa)], page_copies=[(6, 1)]),
        # A back in other pages, decoding beside B
        ModelInput([a[0], b[3]], [1, 1], [16, 10], [pa2, pb], [0, 1], [], 2, swap_in=[(0, pa2)]),
    ]


def run_steps(runner: ModelRunner) -> list[torch.Tensor]:
    return [runner.execute(step).clone() for step in steps()]


@pytest.fixture(scope="module")
def single_rank_logits(tiny_llama):
    model = load_model(tiny_llama, torch.float32, torch.device("cpu"))
    return run_steps(ModelRunner(model, NUM_PAGES, PAGE_SIZE, torch.device("cpu")))


# shared up to 64 tokens: every step's all-reduces go through shared memory; shared up to 8: the
# long steps' go over gloo, the decode steps' through shared memory
@pytest.mark.parametrize(
    ("world_size", "shared_up_to"), [(2, 0), (2, 64), (4, 8)], ids=["tp2-gloo", "tp2-shared", "tp4-both"]
)
def test_tensor_parallel_logits_equal_the_single_rank_model(tiny_llama, single_rank_logits, world_size, shared_up_to):
    cpu = torch.device("cpu")
    cfg = read_model_config(tiny_llama)
    shm_path, shm_numel = None, 0
    if shared_up_to:
        shm_path, shm_numel = create_shared_all_reduce(world_size, cfg, shared_up_to, torch.float32, cpu)
        assert shm_path is not None  # an x86 CPU
    tp = rank_context(0, world_size, shm_path, shm_numel, torch.float32)
    model = load_model(tiny_llama, torch.float32, cpu, tp)
    assert model.layers[0].self_attn.num_heads == 8 // world_size
    assert model.layers[0].self_attn.num_kv_heads == 4 // world_size
    spec = FollowerSpec(tiny_llama, "float32", "cpu", NUM_PAGES, PAGE_SIZE, world_size, 1, shm_path, shm_numel)
    followers = FollowerRanks(spec)
    try:
        assert shm_path is None or not os.path.exists(shm_path)  # unlinked once every rank mapped it
        runner = ModelRunner(model, NUM_PAGES, PAGE_SIZE, cpu, followers=followers)
        assert runner.kv_cache.shape[4] == 4 // world_size  # this rank's KV heads only
        logits = run_steps(runner)
        assert all(p.poll() is None for p in followers.procs)
        if tp.shared is not None:  # 2 layers x 2 all-reduces per step that fits
            fitting = [s for s in steps() if len(s.token_ids) <= shared_up_to]
            assert tp.shared.generation == 2 * 2 * len(fitting) and len(fitting) >= 2
    finally:
        followers.close()
        torch.distributed.destroy_process_group()
    assert [p.returncode for p in followers.procs] == [0] * (world_size - 1)  # stdin closed: a clean exit
    for got, want in zip(logits, single_rank_logits):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_the_sizes(tiny_llama):
    cfg = read_model_config(tiny_llama)
    check_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 does not divide .*8 query heads.*4 KV heads"):
        check_tensor_parallel(cfg, 3)


def test_the_engine_refuses_a_sharding_of_the_default_model_at_start():
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    # SmolLM2-135M: 9 query heads, 3 KV heads; refused before any weight loads or rank starts
    with pytest.raises(ValueError, match=r"tensor-parallel size 2 does not divide the model's 9 query heads and 3 KV"):
        Engine(EngineConfig(tensor_parallel_size=2))


def test_a_tensor_parallel_engine_generates_what_one_rank_does(tiny_llama):
    """The engine as a worker runs it (`tensor_parallel_size=2`: it starts its follower itself),
    under page pressure (preemption by swap), with shared prompt prefixes (the prefix cache),
    n > 1 and beam search: every greedy token equals the single-rank engine's."""
    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 256, (24,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    beams = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2, use_beam_search=True)

    def run(engine: Engine) -> list[list[list[int]]]:
        texts = [r.token_ids for r in engine.generate(prompts, greedy)]
        texts += [r.token_ids for r in engine.generate(prompts[:1], beams)]
        return texts

    base = dict(model=str(tiny_llama), dtype="float32", num_pages=24, page_size=4, max_num_batched_tokens=32)
    base.update(max_prefill_chunk=16, preemption_mode="swap", swap_space_gb=0.01)
    want = run(Engine(EngineConfig(**base)))
    engine = Engine(EngineConfig(**base, tensor_parallel_size=2))
    try:
        assert engine.runner.model.tp.shared is not None  # this CPU all-reduces in shared memory
        got = run(engine)
        assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_used_pages == 0
    finally:
        engine.close()
        torch.distributed.destroy_process_group()
    assert got == want


def test_a_tensor_parallel_engine_embeds_what_one_rank_does(tiny_llama):
    """Embedding requests (`pooling`): rank 0 pools alone, since after each layer's all-reduce it
    holds the whole hidden state, and its final norm's rows are the single-rank model's; the
    follower neither samples nor pools. Prompts of 1 to 40 tokens, in chunks of 16."""
    from pagemesh.common.messages import Pooling
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine
    from pagemesh.workers.engine.pooling import embed

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    base = dict(model=str(tiny_llama), dtype="float32", num_pages=48, page_size=4, max_num_batched_tokens=32)
    base.update(max_prefill_chunk=16)
    one_rank = Engine(EngineConfig(**base))
    want = {pooling: embed(one_rank, prompts, pooling) for pooling in Pooling}
    engine = Engine(EngineConfig(**base, tensor_parallel_size=2))
    try:
        for pooling in Pooling:
            got = embed(engine, prompts, pooling)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want[pooling]), rtol=1e-4, atol=1e-5)
        assert engine.blocks.num_used_pages == 0
    finally:
        engine.close()
        torch.distributed.destroy_process_group()
