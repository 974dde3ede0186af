"""/v1/embeddings, /tokenize and /detokenize through a whole mesh (`pagemesh up`'s default: a
prefill and a decode worker, fp32), driven by the official openai client and httpx, against
Hugging Face transformers on the same GGUF weights."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import torch

from pagemesh.bench.local_mesh import HANG_S, LATE_S, metrics, pages_free, running_mesh, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.tests.integration.conftest import openai_client

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL_NAME
WORKERS = {"prefill-0", "decode-0"}
INPUTS = [
    "The three primary colours are red, yellow and blue.",
    "def fibonacci(n):",
    "Paged attention stores the KV cache in fixed-size pages, allocated as a sequence grows. " * 3,
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a fruit that is yellow."},
    {"role": "assistant", "content": "A banana."},
    {"role": "user", "content": "And a red one?"},
]


@pytest.fixture(scope="module")
def mesh():
    with running_mesh("--dtype", "float32") as url:
        yield SimpleNamespace(url=url)


@pytest.fixture(scope="module")
def client(mesh) -> openai.OpenAI:
    return openai_client(mesh)


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.url, timeout=HANG_S) as c:
        yield c


def hf_embeddings(hf_model, hf_tokenizer, texts: list[str]) -> list[torch.Tensor]:
    """The last token's hidden state after the final norm, L2-normalised (vLLM's default pooling
    of a causal LM served for embeddings)."""
    out = []
    for text in texts:
        ids = hf_tokenizer(text)["input_ids"]
        with torch.inference_mode():
            hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        out.append(torch.nn.functional.normalize(hidden, dim=0))
    return out


def cosine(a, b: torch.Tensor) -> float:
    return float(torch.dot(torch.as_tensor(np.asarray(a, dtype=np.float32)), b))


def test_floats_base64_and_a_batch_of_three_equal_hf(client, hf_model, hf_tokenizer, mesh):
    expected = hf_embeddings(hf_model, hf_tokenizer, INPUTS)
    one = client.embeddings.create(model=MODEL, input=INPUTS[0], encoding_format="float")
    assert one.object == "list" and one.model == MODEL and len(one.data) == 1
    assert one.data[0].object == "embedding" and one.data[0].index == 0
    assert len(one.data[0].embedding) == hf_model.config.hidden_size
    assert cosine(one.data[0].embedding, expected[0]) > 1 - 1e-4
    n = len(hf_tokenizer(INPUTS[0])["input_ids"])
    assert (one.usage.prompt_tokens, one.usage.total_tokens) == (n, n)

    packed = client.embeddings.create(model=MODEL, input=INPUTS[0], encoding_format="base64")
    raw = np.frombuffer(base64.b64decode(packed.data[0].embedding), dtype="<f4")
    assert raw.tolist() == one.data[0].embedding  # the same float32 values, byte for byte

    batch = client.embeddings.create(model=MODEL, input=INPUTS)  # the client asks for base64 and decodes it
    assert [d.index for d in batch.data] == [0, 1, 2]
    for d, reference in zip(batch.data, expected):
        assert cosine(d.embedding, reference) > 1 - 1e-4
    assert batch.usage.prompt_tokens == sum(len(hf_tokenizer(t)["input_ids"]) for t in INPUTS)

    ids = hf_tokenizer(INPUTS[1])["input_ids"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    assert cosine(by_ids.data[0].embedding, expected[1]) > 1 - 1e-4
    # a worker keeps no KV page for an embedding once it ends (its cached prefix pages are free)
    assert wait_until(lambda: pages_free(metrics(mesh.url), WORKERS), timeout=LATE_S)


def test_mean_pooling_and_dimensions_equal_to_the_hidden_size(client, hf_model, hf_tokenizer):
    hidden = hf_model.config.hidden_size
    ids = hf_tokenizer(INPUTS[2])["input_ids"]
    with torch.inference_mode():
        mean = hf_model.model(torch.tensor([ids])).last_hidden_state[0].mean(0)
    got = client.embeddings.create(
        model=MODEL, input=INPUTS[2], encoding_format="float", dimensions=hidden, extra_body={"pooling": "mean"}
    )
    assert cosine(got.data[0].embedding, torch.nn.functional.normalize(mean, dim=0)) > 1 - 1e-4


@pytest.mark.parametrize(
    "request_body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 64}, "dimensions"),
        ({"input": "x", "normalize": False}, "normalize"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_field(client, request_body, param):
    body = {"model": MODEL, **request_body}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/embeddings", cast_to=object, body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_an_input_longer_than_the_context_is_a_400(http):
    max_model_len = http.post("/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": [[1] * (max_model_len + 1)]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    assert f"maximum context length is {max_model_len} tokens" in error["message"]


def test_tokenize_and_detokenize_round_trip_a_prompt_and_a_chat(http, hf_tokenizer):
    text = "Hello world, héllo <|im_end|> 123"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    ids = hf_tokenizer(text)["input_ids"]
    assert got == {
        "count": len(ids),
        "max_model_len": got["max_model_len"],
        "tokens": ids,
        "token_strs": hf_tokenizer.convert_ids_to_tokens(ids),
    }
    assert got["max_model_len"] > 0
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": text}

    chat = http.post("/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    expected = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert chat["tokens"] == expected and chat["count"] == len(expected) and chat["token_strs"] is None
    rendered = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json() == {"prompt": rendered}
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == expected[: bare["count"]] and bare["count"] < len(expected)


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"prompt": "x", "chat_template_kwargs": {"a": 1}}, 400, "chat_template_kwargs"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_token_requests_name_the_field(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
