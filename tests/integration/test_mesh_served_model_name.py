"""`pagemesh up --served-model-name NAME [NAME ...]`, as vLLM: the first name is the model's id in
/v1/models, in answers and in the metrics' labels; every name is accepted in a request's `model`;
any other name (the Hugging Face id included) is the usual 404."""

from __future__ import annotations

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, metrics, running_mesh, sample_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow


def test_served_model_names_are_the_names_clients_see_and_use():
    output: list[str] = []
    with running_mesh("--mixed", "1", "--served-model-name", "my-model", "my-alias", output=output) as url:
        assert any("model my-model (alias my-alias)" in line for line in output)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        assert [m.id for m in client.models.list()] == ["my-model"]
        assert client.models.retrieve("my-alias").id == "my-model"

        chat = client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert chat.model == "my-model"
        assert chat.choices[0].message.content and chat.usage.completion_tokens >= 1
        completion = client.completions.create(model="my-alias", prompt="Hello", max_tokens=2, temperature=0)
        assert completion.model == "my-model"  # any served name is accepted; the first is reported
        stream = client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, stream=True
        )
        assert {chunk.model for chunk in stream} == {"my-model"}

        for other in (DEFAULT_MODEL_NAME, "no-such-model"):
            with pytest.raises(openai.NotFoundError) as err:
                client.chat.completions.create(model=other, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert err.value.response.json()["error"]["code"] == "model_not_found"

        # the gateway's series and those of the worker's registration carry the served name
        samples = sample_until(lambda: metrics(url), lambda s: any(k.startswith("vllm:kv_cache_usage_perc") for k in s))
        assert samples is not None
        labelled = [key for key in samples if key.startswith("vllm:") and "model_name=" in key]
        assert labelled and all('model_name="my-model"' in key for key in labelled), labelled
