"""The engine against Hugging Face transformers on the same weights (fp32)."""

import pytest
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration.conftest import hf_argmax_after_each, hf_greedy
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

TEXT = (
    "The history of computing is a story of layers: transistors became gates, gates became "
    "processors, and processors learned to run programs that write other programs. "
)


def mixed_prompts(tokenizer) -> list[list[int]]:
    """8 prompts from 4 to ~300 tokens, chat-formatted and raw."""
    prompts = []
    for i, repeats in enumerate([0, 1, 2, 3, 5, 7, 9, 11]):
        if i % 2:
            text = f"Question {i}: " + TEXT * repeats + "Summarise that."
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(rendered, add_special_tokens=False)
        else:
            ids = tokenizer.encode(f"Note {i}. " + TEXT * repeats)
        prompts.append(list(ids))
    return prompts


@pytest.mark.slow
def test_greedy_64_tokens_match_hf_with_chunks_and_decodes_mixed(engine_fp32, hf_model, hf_tokenizer):
    prompts = mixed_prompts(hf_tokenizer)
    assert len({len(p) for p in prompts}) == 8 and max(len(p) for p in prompts) > 200
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    results = engine_fp32.generate(prompts, params)
    assert engine_fp32.stats.prefill_tokens > 0 and engine_fp32.stats.decode_tokens > 0
    for prompt, result in zip(prompts, results):
        assert len(result.token_ids[0]) == 64 and result.finish_reasons == ["length"]
        assert result.token_ids[0] == hf_argmax_after_each(hf_model, prompt, result.token_ids[0])  # HF's greedy
    engine_fp32.blocks.check_invariants([])


@pytest.mark.slow
def test_logit_bias_matches_hf_sequence_bias(engine_fp32, hf_model, hf_tokenizer):
    prompt = mixed_prompts(hf_tokenizer)[3]
    plain = hf_greedy(hf_model, prompt, 24)
    lifted = hf_tokenizer.encode(" however", add_special_tokens=False)[0]
    bias = {plain[0]: -100.0, plain[3]: -100.0, lifted: 4.0}
    expected = hf_greedy(hf_model, prompt, 24, sequence_bias={(t,): b for t, b in bias.items()})
    assert expected != plain
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=tuple(bias.items()))
    [result] = engine_fp32.generate([prompt], params)
    assert result.token_ids[0] == expected


@pytest.mark.slow
def test_prompt_logprobs_agree_with_hf_over_chunks_and_despite_the_prefix_cache(engine_fp32, hf_model, hf_tokenizer):
    prompt = mixed_prompts(hf_tokenizer)[4]  # ~100 tokens: several 32-token chunks
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    engine_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # its pages now in the prefix cache
    for result in engine_fp32.generate([prompt, prompt], params):  # twice in one batch, too
        assert [lp.token_id for lp in result.prompt_logprobs] == prompt[1:]
        for j, lp in enumerate(result.prompt_logprobs):
            row = ref[j]
            assert abs(lp.logprob - float(row[prompt[j + 1]])) < 2e-3
            assert lp.top_ids == row.topk(3).indices.tolist()
    assert engine_fp32.generate([prompt], SamplingParams(max_tokens=1))[0].prompt_logprobs is None
    engine_fp32.blocks.check_invariants([])


@pytest.mark.slow
def test_logprobs_agree_with_hf_logits_within_fp32_tolerance(engine_fp32, hf_model, hf_tokenizer):
    prompt = mixed_prompts(hf_tokenizer)[5]
    [result] = engine_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))
    full = torch.tensor([prompt + result.token_ids[0]])
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(full).logits[0].float(), dim=-1)
    for i, lp in enumerate(result.logprobs[0]):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == int(row.argmax())
        assert abs(lp.logprob - float(row[lp.token_id])) < 2e-3
        top = row.topk(5)
        assert lp.top_ids == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist())) < 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch-fallback"])
def test_tiny_qwen2_safetensors_matches_hf(tiny_qwen2, cpu_kernels, monkeypatch):
    folder, hf = tiny_qwen2
    if not cpu_kernels:  # the path taken where no C compiler is found
        monkeypatch.setattr("pagemesh.workers.engine.backend.cpu_kernels_usable", lambda dtype: False)
    engine = Engine(
        EngineConfig(model=str(folder), dtype="float32", max_num_batched_tokens=32, max_prefill_chunk=32, num_pages=256)
    )
    assert engine.model_config.architecture == "qwen2" and engine.model_config.attention_bias
    backend = type(engine.runner.attention).__name__
    assert backend == ("CpuKernelAttentionBackend" if cpu_kernels else "TorchAttentionBackend")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (3, 17, 40, 64, 90, 5, 33, 120)]
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert len(result.token_ids[0]) == 64
        assert result.token_ids[0] == hf_argmax_after_each(hf, prompt, result.token_ids[0])  # HF's greedy
    engine.blocks.check_invariants([])


@pytest.mark.slow
def test_bf16_greedy_tokens_are_hf_bf16_argmax_wherever_the_choice_is_clear(hf_model, hf_tokenizer):
    """The bf16 CPU path as served (C attention, packed linears where oneDNN has bf16 and AMX ones
    where the CPU has AMX, C argmax) against HF transformers in bf16, teacher-forced on our
    tokens: bf16 rounding may flip a near tie, so every position whose top-2 logit margin in HF
    exceeds 0.5 must agree."""
    import copy

    import pagemesh.kernels.cpu

    engine = Engine(EngineConfig(dtype="bfloat16", num_pages=512, enable_prefix_caching=False))
    gate_up = engine.runner.model.layers[0].mlp.gate_up_proj
    packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN's bf16 matmul: AVX-512 CPUs, not AVX2 ones
    assert (gate_up.packed is not None) == packs
    if packs:
        assert (gate_up.packed.amx is not None) == pagemesh.kernels.cpu.amx_available()
    prompts = mixed_prompts(hf_tokenizer)[:6]  # decode batches of up to 6 rows: the AMX kernel's side
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    decisive = agreed = 0
    for prompt, result in zip(prompts, results):
        tokens = result.token_ids[0]
        with torch.inference_mode():
            logits = hf_bf16(torch.tensor([prompt + tokens])).logits[0].float()
        for i, token in enumerate(tokens):
            top = logits[len(prompt) - 1 + i].topk(2)
            if float(top.values[0] - top.values[1]) > 0.5:
                decisive += 1
                agreed += token == int(top.indices[0])
    assert decisive >= 0.6 * 24 * len(prompts)  # the check covers most positions
    assert agreed == decisive
