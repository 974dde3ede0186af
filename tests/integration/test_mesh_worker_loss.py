"""A worker that dies mid-request, as a container of a scaled pool can (a mixed worker, or a decode
worker behind a prefill worker): its requests end with an error in the OpenAI shape within the
heartbeat timeout (no hung stream), the scheduler drops it, and the other worker of its pool serves
the next requests.

The processes are started one by one, as compose starts them (`pagemesh up` would stop the whole
mesh when a child exits); they are the same processes with the same arguments.
"""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from bench.local_mesh import HANG_S, LATE_S, SeparateProcesses, metrics, per_worker, sample_until, wait_until
from common.model_files import DEFAULT_MODEL_NAME
from tests.integration.conftest import stream_counting

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 2.0


@pytest.fixture(params=[("--mixed", "2"), ("--prefill", "1", "--decode", "2")], ids=["2 mixed", "1P+2D"])
def two_worker_mesh(tmp_path, request):
    procs = SeparateProcesses(str(tmp_path), *request.param, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    try:
        procs.start()  # every process started and ready; nobody watches them after
        yield procs
    finally:
        procs.stop()


def test_a_killed_worker_fails_its_requests_and_the_other_serves_on(two_worker_mesh):
    url, children = two_worker_mesh.url, two_worker_mesh.children
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    request = dict(
        model=DEFAULT_MODEL_NAME,
        prompt="Count on and on:",
        max_tokens=400,
        temperature=0,
        extra_body={"ignore_eos": True},
    )

    def running() -> dict[str, float]:
        return per_worker(metrics(url), "pagemesh_num_requests_running")

    received = [0, 0, 0]  # text chunks per stream, so far

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream_counting, client, received, k, **request) for k in range(3)]
        counts = sample_until(running, lambda c: sum(c.values()) == 3 and all(received))  # tokens flow
        assert counts
        victim = max(counts, key=counts.get)
        lost = int(counts[victim])
        killed_at = time.monotonic()
        two_worker_mesh.kill(victim)
        results = [s.result(timeout=HANG_S) for s in streams]

    failed = [r for r in results if r[1] is not None]
    assert len(failed) == lost >= 1, results
    for pieces, error, ended in failed:
        assert pieces > 0  # it was streaming when its worker died
        assert isinstance(error, openai.APIError) and "stopped responding" in str(error), repr(error)
        # not hung until the client's or the request's timeout: ended at the heartbeat timeout,
        # however late a loaded machine notices it
        assert ended - killed_at < HEARTBEAT_TIMEOUT_S + LATE_S
    assert all(pieces > 0 for pieces, error, _ in results if error is None)  # the survivor's ran on

    assert children[victim].poll() is not None
    alive = next(name for name in children if name.startswith(victim.split("-")[0]) and name != victim)
    r = client.completions.create(
        model=DEFAULT_MODEL_NAME, prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 5
    finished = 3 - lost + 1  # the streams that ran on, and this one
    assert wait_until(lambda: per_worker(metrics(url), "pagemesh_worker_requests_total").get(alive) == finished)
    usage = sample_until(lambda: per_worker(metrics(url), "pagemesh_kv_cache_usage_ratio"), lambda u: alive in u)
    assert usage is not None and victim not in usage  # one answer that lists the survivor
