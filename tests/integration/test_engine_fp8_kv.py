"""The engine with an fp8 KV pool (`kv_cache_dtype`) on the real model and a tiny one.

Quality floor: teacher-forced through fixed greedy continuations as decode steps
(bench/fp8_kv.decode_logits), the fp8_e4m3 engine's next-token argmax must agree with the same
model's float pool at >= 0.93 of the positions and its mean KL stay <= 0.02 nats. Measured
(docs/perf/fp8_kv.md, 696 positions against bf16): 0.977 and 0.005; the floor leaves room for
other CPUs' rounding and catches a broken scale or a misread page (those fall to chance level:
agreement near 0, KL of nats).
"""

from __future__ import annotations

import pytest
import torch

from pagemesh.bench.fp8_kv import agreement_and_kl, decode_logits
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

pytestmark = pytest.mark.slow
PROMPTS = ["The history of the Roman Empire begins with", "def quicksort(items):\n    ", "Here is a list of"]
AGREEMENT_FLOOR = 0.93
KL_CEILING = 0.02


def test_fp8_pool_holds_twice_the_pages_of_bf16_in_the_same_memory(tiny_qwen2):
    folder, _ = tiny_qwen2
    base = dict(model=str(folder), dtype="bfloat16", kv_cache_memory_gb=0.001, cuda_graphs=False)
    bf16 = Engine(EngineConfig(**base))
    for kv, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        fp8 = Engine(EngineConfig(**base, kv_cache_dtype=kv), model=bf16.runner.model, tokenizer=bf16.tokenizer)
        assert fp8.runner.kv_cache.dtype == dtype and fp8.runner.kv_cache.element_size() == 1
        assert fp8.runner.page_bytes * 2 == bf16.runner.page_bytes
        budget = int(0.001 * 2**30)
        assert fp8.blocks.num_pages == budget // fp8.runner.page_bytes
        assert fp8.blocks.num_pages in (2 * bf16.blocks.num_pages, 2 * bf16.blocks.num_pages + 1)  # floor
        assert fp8.runner.kv_scales.shape == (3, 2, 2) and (fp8.runner.kv_scales > 0).all()


def test_fp8_engine_agrees_with_the_float_pool_above_the_floor(engine_fp32):
    tok = engine_fp32.tokenizer
    prompts = [tok.encode(p)[:16] for p in PROMPTS]
    n = min(len(p) for p in prompts)
    prompts = [p[:n] for p in prompts]
    # engines of their own on the session's model: decode_logits writes pool pages directly
    config = dict(dtype="float32", num_pages=256, max_model_len=512, enable_prefix_caching=False)
    ref = Engine(EngineConfig(**config), model=engine_fp32.runner.model, tokenizer=tok)
    fp8 = Engine(EngineConfig(**config, kv_cache_dtype="fp8_e4m3"), model=engine_fp32.runner.model, tokenizer=tok)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    sequences = [p + r.token_ids[0] for p, r in zip(prompts, ref.generate(prompts, params))]
    agree, kl = agreement_and_kl(decode_logits(ref, sequences), decode_logits(fp8, sequences))
    assert agree >= AGREEMENT_FLOOR and kl <= KL_CEILING, (agree, kl)
    assert kl > 0  # the pool really is fp8: the logits moved

    # the engine's own loop (scheduler, block manager, decodes batched with a chunk) runs on it
    outs = fp8.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(r.token_ids[0]) for r in outs] == [8] * len(prompts)
    assert not fp8.has_unfinished() and fp8.blocks.num_free_pages == fp8.blocks.num_pages - 1
