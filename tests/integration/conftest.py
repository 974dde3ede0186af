"""Fixtures that load the real default model once per test session."""

import pytest
import torch

from common.model_files import default_model_path


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


@pytest.fixture(scope="session")
def engine_fp32():
    """fp32 engine with the prefill chunk forced small so chunks and decodes mix."""
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    return Engine(EngineConfig(dtype="float32", max_num_batched_tokens=32, max_prefill_chunk=32, num_pages=1024, max_model_len=1024))


def hf_greedy(hf_model, prompt_ids, max_new_tokens):
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()
