"""Placement across several decode workers, and admission limits."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, metrics, pages_free, per_worker, running_mesh, sample_until, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow


def test_requests_land_on_both_decode_workers_and_usage_returns_to_zero():
    with running_mesh("--prefill", "1", "--decode", "2", "--threads-per-worker", "1") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)

        def one(i: int) -> int:
            r = client.completions.create(
                model=DEFAULT_MODEL_NAME,
                prompt=f"Item {i}:",
                max_tokens=30,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(8))) == [30] * 8

        def served() -> dict[str, float]:
            return per_worker(metrics(url), "pagemesh_worker_requests_total")

        counts = sample_until(served, lambda c: c.get("decode-0", 0) + c.get("decode-1", 0) == 8)
        assert counts and counts["decode-0"] > 0 and counts["decode-1"] > 0
        assert wait_until(lambda: pages_free(metrics(url), {"prefill-0", "decode-0", "decode-1"}))


def test_no_capacity_is_a_503_with_retry_after_and_the_mesh_recovers():
    with running_mesh("--mixed", "1", "--max-num-seqs", "1", "--max-queue", "1") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        long = dict(
            model=DEFAULT_MODEL_NAME, prompt="Go on:", max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
        )
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = pool.submit(client.completions.create, **long)
            assert wait_until(lambda: sum(per_worker(metrics(url), "pagemesh_num_requests_running").values()) == 1)
            queued = pool.submit(client.completions.create, **long)
            assert wait_until(lambda: metrics(url).get("pagemesh_scheduler_queued_requests", 0) == 1)
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(**long)
            assert err.value.status_code == 503
            assert err.value.response.headers.get("retry-after")
            assert err.value.body["code"] == "overloaded" or err.value.response.json()["error"]["code"] == "overloaded"
            assert running.result().usage.completion_tokens == 200
            assert queued.result().usage.completion_tokens == 200
        r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens <= 4
