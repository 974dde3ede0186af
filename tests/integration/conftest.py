"""Fixtures that load the real default model once per test session."""

import json
import threading
import time

import openai
import pytest
import torch

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common.model_files import default_model_path
from pagemesh.tests import default_model


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    return default_model.hf_tokenizer()  # the one tests/unit/test_tokenizer.py compares with


@pytest.fixture(scope="session")
def engine_fp32():
    """fp32 engine with the prefill chunk forced small so chunks and decodes mix."""
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    return Engine(
        EngineConfig(
            dtype="float32", max_num_batched_tokens=32, max_prefill_chunk=32, num_pages=1024, max_model_len=1024
        )
    )


@pytest.fixture(scope="module")
def single_rank_engine():
    """A single-rank fp32 engine on the default model: the reference a parallel mesh's output is
    checked against (one per module)."""
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    return Engine(EngineConfig(dtype="float32", num_pages=256))


def greedy_texts(engine, prompts: list[str | list[dict]], max_tokens: int) -> list[str]:
    """What `engine` answers greedily, a text per prompt: a string (a completion) or a list of
    chat messages. The prompts run as one batch."""
    from pagemesh.common.sampling import SamplingParams

    tok = engine.tokenizer
    ids = [tok.encode(p) if isinstance(p, str) else tok.encode_chat(p) for p in prompts]
    return [r.texts[0] for r in engine.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens))]


def openai_client(mesh) -> openai.OpenAI:
    """The official client on a mesh's gateway (`mesh.url`), no retries, a hang's ceiling."""
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def hf_greedy(hf_model, prompt_ids, max_new_tokens, **generate_kwargs):
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **generate_kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_argmax_after_each(hf_model, prompt_ids, tokens) -> list[int]:
    """HF's greedy choice after the prompt and each prefix of `tokens`, from one teacher-forced
    forward pass. Equal to `tokens` exactly when `tokens` is HF's greedy continuation (by
    induction on the prefix), at the cost of one pass instead of `len(tokens)` decode steps."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([list(prompt_ids) + list(tokens)])).logits[0]
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)].argmax(-1).tolist()


def stream_counting(
    client, received: list[int], k: int, stop: threading.Event | None = None, **request
) -> tuple[int, Exception | None, float]:
    """Stream a completion to its end (or until `stop` is set: the client closes it), counting its
    text chunks in `received[k]` as they come (another thread can wait for them); returns
    (chunks, the error that ended it or None, when)."""
    try:
        with client.completions.create(stream=True, **request) as chunks:
            for chunk in chunks:
                received[k] += bool(chunk.choices and chunk.choices[0].text)
                if stop is not None and stop.is_set():
                    break
    except Exception as e:  # the error event of a failed stream
        return received[k], e, time.monotonic()
    return received[k], None, time.monotonic()


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A tiny random Qwen2-style model (QKV bias, untied head) written as safetensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.3,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # make biases non-zero so they are tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(folder, safe_serialization=True)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    return folder, model
