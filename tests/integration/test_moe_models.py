"""Mixtral and Qwen3-MoE give Hugging Face transformers' greedy tokens (issue 30): tiny random
checkpoints made by transformers at test time (tests/integration/moe_checkpoints.py), 8 prompts x
24 greedy tokens each, checked against HF's fp32 model teacher-forced.

    tp 1                          the Engine in this process (and a Mixtral with a sliding window)
    -tp 2                         `pagemesh up --model <folder> --dtype float32 -tp 2`, the openai client
    -tp 2 --enable-expert-parallel the same mesh with the experts placed whole on the two ranks
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemesh.bench.local_mesh import running_mesh
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration import moe_checkpoints
from pagemesh.tests.integration.conftest import hf_argmax_after_each

MAX_TOKENS = 24
FAMILIES = {"mixtral": moe_checkpoints.mixtral_model, "qwen3_moe": moe_checkpoints.qwen3_moe_model}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(folder, HF model) of one family."""
    hf = FAMILIES[request.param]()
    return moe_checkpoints.save(hf, tmp_path_factory.mktemp(request.param)), hf


def assert_hf_greedy(hf, prompts: list[list[int]], served: list[list[int]]) -> None:
    assert [len(tokens) for tokens in served] == [MAX_TOKENS] * len(prompts)
    for prompt, tokens in zip(prompts, served):
        assert tokens == hf_argmax_after_each(hf, prompt, tokens)


def test_engine_gives_hf_greedy_tokens(checkpoint):
    """tp 1, prompt chunks of 16 tokens mixed with decodes (MoE rows of several sequences in one step)."""
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    folder, hf = checkpoint
    config = EngineConfig(
        model=str(folder), dtype="float32", num_pages=64, max_num_batched_tokens=16, max_prefill_chunk=16
    )
    engine = Engine(config)
    prompts = moe_checkpoints.prompts()
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert_hf_greedy(hf, prompts, [r.token_ids[0] for r in results])
    engine.blocks.check_invariants([])


def test_mixtral_sliding_window_gives_hf_greedy_tokens(tmp_path):
    """A window of 8 on every layer (transformers' Mixtral slides wherever `sliding_window` is
    set): prompts and continuations run past it, and the tokens are the windowed model's."""
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    hf = moe_checkpoints.mixtral_model(sliding_window=8)
    folder = moe_checkpoints.save(hf, tmp_path)
    engine = Engine(
        EngineConfig(model=str(folder), dtype="float32", num_pages=64, max_num_batched_tokens=16, max_prefill_chunk=16)
    )
    assert engine.model_config.layer_windows == (8, 8, 8)
    prompts = moe_checkpoints.prompts()
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert_hf_greedy(hf, prompts, [r.token_ids[0] for r in results])


def command_lines() -> list[str]:
    lines = []
    for proc in Path("/proc").iterdir():
        try:
            lines.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_mesh_gives_hf_greedy_tokens(checkpoint, expert_parallel):
    folder, hf = checkpoint
    flags = ["--model", str(folder), "--dtype", "float32", "--mixed", "1", "-tp", "2"]
    flags += ["--enable-expert-parallel"] if expert_parallel else []
    prompts = moe_checkpoints.prompts()
    with running_mesh(*flags) as url:
        # the flag reached the worker (rank 0) and, through it, rank 1
        ranks = [line for line in command_lines() if str(folder) in line and "--world-size=2" in line]
        assert len(ranks) == 1 and ("--enable-expert-parallel" in ranks[0]) == expert_parallel
        served = moe_checkpoints.mesh_greedy_tokens(url, prompts, MAX_TOKENS)
    with torch.inference_mode():
        assert_hf_greedy(hf, prompts, served)
