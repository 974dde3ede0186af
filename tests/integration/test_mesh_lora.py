"""Multi-LoRA through a 1 prefill + 1 decode mesh (issue 31): adapters named in a request's
`model` give HF + peft's greedy tokens with the official `openai` client, beside base requests;
/v1/models lists them with their parent; vLLM's load and unload routes add and drop one at run
time on every worker; bad input gets a 400 or 404 that names what is wrong, and nothing that was
served changes; vLLM's lora_requests_info gauge is exported."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, metrics, running_mesh, sample_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.tests.lora_adapters import hf_greedy_text, make_adapters

pytestmark = pytest.mark.slow
TOKENS = 16


@pytest.fixture(scope="module")
def adapters(model_path, tmp_path_factory):
    return make_adapters(model_path, tmp_path_factory.mktemp("adapters"))


def post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def greedy(client, model: str, prompt: list[int]) -> str:
    """The mesh's greedy continuation of token ids `prompt`."""
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.model == model and r.usage.completion_tokens == TOKENS  # an adapter's answer names it, as vLLM's
    return r.choices[0].text


def test_adapters_through_a_prefill_decode_mesh(adapters, hf_tokenizer, tmp_path):
    peft_model, folders = adapters
    flags = ["--prefill", "1", "--decode", "1", "--dtype", "float32", "--enable-lora", "--max-loras", "2"]
    flags += ["--lora-modules", f"poet={folders['poet']}"]
    with running_mesh(*flags) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        cards = {m.id: m for m in client.models.list()}
        assert set(cards) == {DEFAULT_MODEL_NAME, "poet"}
        assert cards["poet"].model_extra["parent"] == DEFAULT_MODEL_NAME

        prompts = [hf_tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Rain")]
        runs = [
            (DEFAULT_MODEL_NAME, prompts[0]),
            ("poet", prompts[0]),
            ("poet", prompts[1]),
            (DEFAULT_MODEL_NAME, prompts[2]),
        ]
        with ThreadPoolExecutor(len(runs)) as pool:  # concurrently: base and adapter rows share steps
            got = list(pool.map(lambda run: greedy(client, *run), runs))
        for (model, prompt), text in zip(runs, got):
            adapter = None if model == DEFAULT_MODEL_NAME else model
            assert text == hf_greedy_text(peft_model, hf_tokenizer, adapter, prompt, TOKENS), model
        assert got[0] != got[1]  # the same prompt: the adapter changes what the model says

        # an adapter loaded at run time serves on both workers (its prompt runs on one, its decode on the other)
        assert post(url + "/v1/load_lora_adapter", {"lora_name": "coder", "lora_path": folders["coder"]}) == (
            200,
            "Success: LoRA adapter 'coder' added successfully.",
        )
        assert greedy(client, "coder", prompts[1]) == hf_greedy_text(
            peft_model, hf_tokenizer, "coder", prompts[1], TOKENS
        )

        # bad input: named, and nothing changes
        status, body = post(url + "/v1/load_lora_adapter", {"lora_name": "coder", "lora_path": folders["coder"]})
        assert status == 400 and "has already been loaded" in json.loads(body)["error"]["message"]
        status, body = post(url + "/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": str(tmp_path / "none")})
        assert status == 404 and "no adapter folder" in json.loads(body)["error"]["message"]
        dora = tmp_path / "dora"
        shutil.copytree(folders["poet"], dora)
        config = json.loads((dora / "adapter_config.json").read_text())
        (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        status, body = post(url + "/v1/load_lora_adapter", {"lora_name": "dora", "lora_path": str(dora)})
        assert status == 400 and "use_dora=True is not served" in json.loads(body)["error"]["message"]
        status, body = post(url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": folders["poet"], "extra": 1})
        assert status == 400 and json.loads(body)["error"]["param"] == "extra"
        assert {m.id for m in client.models.list()} == {DEFAULT_MODEL_NAME, "poet", "coder"}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="dora", prompt="Hi", max_tokens=2)

        assert post(url + "/v1/unload_lora_adapter", {"lora_name": "coder"}) == (
            200,
            "Success: LoRA adapter 'coder' removed successfully.",
        )
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="coder", prompt="Hi", max_tokens=2)
        assert err.value.response.json()["error"]["code"] == "model_not_found"
        status, body = post(url + "/v1/unload_lora_adapter", {"lora_name": "coder"})
        assert status == 404 and "cannot be found" in json.loads(body)["error"]["message"]
        # what was served before is served the same
        assert greedy(client, "poet", prompts[2]) == hf_greedy_text(
            peft_model, hf_tokenizer, "poet", prompts[2], TOKENS
        )

        samples = sample_until(lambda: metrics(url), lambda s: any(k.startswith("vllm:lora_requests_info") for k in s))
        assert samples is not None
        info = [k for k in samples if k.startswith("vllm:lora_requests_info")]
        assert len(info) == 2 and all('max_lora="2"' in k for k in info), info  # one per worker
