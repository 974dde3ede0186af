"""Prefix caching across the mesh: a request sharing a long prefix with an earlier one moves only
the KV pages the decode worker lacks, and decodes exactly what the engine alone does."""

from __future__ import annotations

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, metrics, running_mesh, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.common.sampling import SamplingParams

pytestmark = pytest.mark.slow
PAGE = 16
SHARED = [(37 * i) % 5000 + 100 for i in range(200)]  # 200 tokens: 12 full pages + 8 tokens
PROMPTS = [SHARED + list(range(17, 27)), SHARED + list(range(901, 911))]  # 210 tokens each: 14 pages
MAX_TOKENS = 8


def test_a_shared_prefix_is_not_sent_again_and_outputs_equal_the_engine_without_prefix_caching():
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    reference = Engine(EngineConfig(dtype="float32", num_pages=256, enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [r.texts[0] for r in reference.generate(PROMPTS, params)]
    del reference

    with running_mesh("--dtype", "float32") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)

        def kv_bytes() -> float:
            return metrics(url).get("pagemesh_kv_transfer_bytes_total", 0.0)

        def complete(prompt: list[int]) -> tuple[str, float, int]:
            """Greedy text, the KV bytes the request moved (one transfer per request), and the
            prompt tokens the prefill worker took from its prefix cache (usage.cached_tokens)."""
            before = kv_bytes()
            r = client.completions.create(
                model=DEFAULT_MODEL_NAME,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert wait_until(lambda: kv_bytes() > before)  # the prefill worker's next heartbeat
            return r.choices[0].text, kv_bytes() - before, r.usage.prompt_tokens_details.cached_tokens

        text1, sent1, cached1 = complete(PROMPTS[0])  # 210 tokens: all 14 pages travel
        text2, sent2, cached2 = complete(PROMPTS[1])  # the decode worker holds the 12 shared full pages
        text3, sent3, cached3 = complete(PROMPTS[0])  # all 13 reusable pages held: only the last travels
        events = metrics(url)  # the scheduler's prefix index read every worker's KV events, none unreadable
        assert events["pagemesh_scheduler_kv_event_batches_total"] >= 3
        assert events["pagemesh_scheduler_kv_event_malformed_total"] == 0
    page_bytes = sent1 / 14
    assert page_bytes == int(page_bytes) > 0
    assert (sent2, sent3) == (2 * page_bytes, 1 * page_bytes)
    assert [text1, text2, text3] == [expected[0], expected[1], expected[0]]
    # the prefill worker's cache: nothing, then the 12 shared pages, then the 13 full pages of prompt 0
    assert (cached1, cached2, cached3) == (0, 12 * PAGE, 13 * PAGE)
