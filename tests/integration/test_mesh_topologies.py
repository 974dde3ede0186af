"""Placement across several decode workers, and admission limits."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from common.model_files import DEFAULT_MODEL_NAME
from bench.local_mesh import metrics, per_worker, running_mesh, wait_until

pytestmark = pytest.mark.slow


def test_requests_land_on_both_decode_workers_and_usage_returns_to_zero():
    with running_mesh("--prefill", "1", "--decode", "2", "--threads-per-worker", "1") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        def one(i: int) -> int:
            r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=f"Item {i}:", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(8))) == [30] * 8
        def served() -> dict[str, float]:
            return per_worker(metrics(url), "pagemesh_worker_requests_total")

        assert wait_until(lambda: served().get("decode-0", 0) + served().get("decode-1", 0) == 8, 3.0)
        assert served()["decode-0"] > 0 and served()["decode-1"] > 0
        assert wait_until(lambda: all(v == 0 for v in per_worker(metrics(url), "pagemesh_kv_cache_usage_ratio").values()), 2.0)
        assert set(per_worker(metrics(url), "pagemesh_kv_cache_usage_ratio")) == {"prefill-0", "decode-0", "decode-1"}


def test_no_capacity_is_a_503_with_retry_after_and_the_mesh_recovers():
    with running_mesh("--mixed", "1", "--max-num-seqs", "1", "--max-queue", "1") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        long = dict(model=DEFAULT_MODEL_NAME, prompt="Go on:", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = pool.submit(client.completions.create, **long)
            assert wait_until(lambda: sum(per_worker(metrics(url), "pagemesh_num_requests_running").values()) == 1, 10)
            queued = pool.submit(client.completions.create, **long)
            assert wait_until(lambda: metrics(url).get("pagemesh_scheduler_queued_requests", 0) == 1, 10)
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(**long)
            assert err.value.status_code == 503
            assert err.value.response.headers.get("retry-after")
            assert err.value.body["code"] == "overloaded" or err.value.response.json()["error"]["code"] == "overloaded"
            assert running.result().usage.completion_tokens == 200
            assert queued.result().usage.completion_tokens == 200
        r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens <= 4
