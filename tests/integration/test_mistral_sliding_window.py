"""A Mistral checkpoint whose sliding window is shorter than its context (issue 30): pagemesh
attends to every position, so it serves at most `sliding_window` tokens a sequence, where that is
exactly HF's windowed attention, and refuses longer requests instead of answering them wrong."""

import json
import logging

import pytest
import torch

from pagemesh.common.model_config import default_max_model_len
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration.conftest import hf_argmax_after_each
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

WINDOW = 16


def mistral(window: int | None):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=window,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # spread-out logits: no near-tie decides a greedy token
    return model


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    """A tiny random Mistral with a 16-token window (3 layers, fp32) as safetensors."""
    model = mistral(WINDOW)
    folder = tmp_path_factory.mktemp("tiny-mistral-sw")
    model.save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == WINDOW
    return folder, model


def test_hf_window_is_the_last_w_positions_with_the_query_itself(tiny_mistral):
    """The semantics the cap rests on: HF's windowed Mistral equals full attention at every query
    position below W (so every row of a sequence of at most W tokens) and no further."""
    _, windowed = tiny_mistral
    full = mistral(None)
    full.load_state_dict(windowed.state_dict())
    ids = torch.randint(0, 320, (1, WINDOW + 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        diff = (windowed(ids).logits - full(ids).logits)[0].abs().amax(-1)
    assert diff[:WINDOW].max() == 0 and diff[WINDOW] > 0


def test_engine_serves_up_to_the_window_as_hf_and_refuses_beyond(tiny_mistral, caplog):
    folder, hf = tiny_mistral
    with caplog.at_level(logging.INFO, logger="pagemesh.workers.model.loader"):
        engine = Engine(
            EngineConfig(
                model=str(folder), dtype="float32", max_num_batched_tokens=8, max_prefill_chunk=8, num_pages=64
            )
        )
    assert [r.message for r in caplog.records if "sliding_window=16" in r.message]  # one load line says so
    assert engine.max_model_len == WINDOW and default_max_model_len(folder) == WINDOW  # engine, tokenizer, gateway

    gen = torch.Generator().manual_seed(1)
    lengths = (1, 2, 4, 6, 8, 10, 13, 15)  # 8 prompts, each filling the window with its greedy tokens
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=WINDOW - n, ignore_eos=True) for n in lengths]
    results = engine.generate(prompts, params)  # chunked prefills (8 tokens a step) beside decodes
    for prompt, result in zip(prompts, results):
        tokens = result.token_ids[0]
        assert len(prompt) + len(tokens) == WINDOW and result.finish_reasons == ["length"]
        assert tokens == hf_argmax_after_each(hf, prompt, tokens)  # HF's greedy, window and all

    with pytest.raises(ValueError, match="exceeds the context length 16"):  # one token past the window
        engine.generate([prompts[5]], SamplingParams(temperature=0, max_tokens=WINDOW - len(prompts[5]) + 1))
    with pytest.raises(ValueError, match="no room in the context length 16"):
        engine.generate([list(range(WINDOW))], SamplingParams(temperature=0, max_tokens=1))
    engine.blocks.check_invariants([])

    with pytest.raises(ValueError, match=r"max_model_len 64: .*sliding_window=16"):  # an explicit longer context
        Engine(EngineConfig(model=str(folder), dtype="float32", num_pages=64, max_model_len=64))
    assert Engine(EngineConfig(model=str(folder), dtype="float32", num_pages=64, max_model_len=16)).max_model_len == 16
