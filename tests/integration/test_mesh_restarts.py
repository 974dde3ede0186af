"""Processes restarted in place, as compose's `restart: unless-stopped` does:

- a worker restarted under the same id (before its heartbeats are missed): the requests the old
  process held end with an error as soon as the new one registers, not at the heartbeat timeout;
- a restarted scheduler: the workers register with it again and the mesh serves on.

The processes are started one by one, as compose starts them, so that one can be restarted.
"""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from common.model_files import DEFAULT_MODEL_NAME
from services.local_mesh import SeparateProcesses, metrics, per_worker, wait_until
from tests.integration.conftest import stream_counting

pytestmark = pytest.mark.slow


@pytest.fixture
def processes(tmp_path, request):
    procs = SeparateProcesses(str(tmp_path), *request.param)
    try:
        procs.start()
        yield procs
    finally:
        procs.stop()


def complete(client, max_tokens=5):
    return client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hello", max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True})


@pytest.mark.parametrize("processes", [("--mixed", "1", "--heartbeat-timeout", "60")], indirect=True)
def test_a_worker_restarted_under_its_id_fails_what_the_old_process_held(processes):
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=120)

    received = [0]  # text chunks so far

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_counting, client, received, 0, model=DEFAULT_MODEL_NAME, prompt="Go on:",
                              max_tokens=2000, temperature=0, extra_body={"ignore_eos": True})
        assert wait_until(lambda: received[0] > 0, 60)  # it is streaming
        restarted_at = time.monotonic()
        processes.restart("mixed-0")
        pieces, error, ended = running.result(timeout=120)
    assert pieces > 0 and isinstance(error, openai.APIError) and "restarted" in str(error), repr(error)
    assert ended - restarted_at < 40  # its start-up, far below the 60 s heartbeat timeout
    assert complete(client).usage.completion_tokens == 5


@pytest.mark.parametrize("processes", [("--mixed", "1", "--heartbeat-timeout", "2")], indirect=True)
def test_a_restarted_scheduler_gets_its_workers_back(processes):
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert complete(client).usage.completion_tokens == 5
    processes.restart("scheduler")
    assert wait_until(lambda: "mixed-0" in per_worker(metrics(processes.url), "pagemesh_kv_cache_usage_ratio"), 30, 0.5)
    assert complete(client).usage.completion_tokens == 5
