"""Every dense model family through the mesh, tensor-parallel (issue 30): `pagemesh up --model
<folder> --dtype float32 --mixed 1 -tp 2` on test_model_families.py's tiny checkpoints (4 query
and 2 KV heads: two a rank, one KV head each), driven by the official openai client. The greedy
continuation of 8 prompts x 24 tokens equals Hugging Face transformers', and a chat rendered by
the folder's own chat template answers with HF's greedy tokens after the prompt the template
makes. The tokenizer's token i is the word `w{i}`, so an answer's text gives its token ids.

One mesh per family; the single-rank engine against HF, and the checks that each family's
features matter on these prompts, are in test_model_families.py.
"""

from __future__ import annotations

import pytest

from pagemesh.bench.local_mesh import running_mesh
from pagemesh.tests.integration.conftest import openai_client
from pagemesh.tests.integration.test_model_families import (  # noqa: F401 (family_checkpoints: a fixture)
    FAMILIES,
    NEW_TOKENS,
    family_checkpoints,
    hf_greedy_all,
    prompts,
)

pytestmark = pytest.mark.slow


def token_ids(text: str) -> list[int]:
    words = text.split()
    assert all(w.startswith("w") for w in words), text
    return [int(w[1:]) for w in words]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_mesh_serves_hf_greedy_tokens(family, family_checkpoints):  # noqa: F811 (the fixture)
    folder, hf = family_checkpoints(family)
    flags = ("--model", str(folder), "--dtype", "float32", "--mixed", "1", "-tp", "2", "--threads-per-worker", "1")
    with running_mesh(*flags) as url:
        client = openai_client(type("Mesh", (), {"url": url}))
        model = client.models.list().data[0].id
        ps = prompts()
        r = client.completions.create(
            model=model, prompt=ps, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        served = [token_ids(c.text) for c in sorted(r.choices, key=lambda c: c.index)]
        assert [len(s) for s in served] == [NEW_TOKENS] * len(ps)
        assert served == hf_greedy_all(hf, ps, served)

        # the folder's chat template: "w3 {content} w4 " per message, then "w5"
        messages = [{"role": "user", "content": "w10 w11 w12 w13"}]
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        answer = token_ids(chat.choices[0].message.content)
        assert chat.usage.prompt_tokens == 7 and len(answer) == 8
        assert answer == hf_greedy_all(hf, [[3, 10, 11, 12, 13, 4, 5]], [answer])[0]
