"""Liveness is not step time, and a dead engine is noticed at once (issue 19):

- every step made slower than the heartbeat timeout on purpose (test-only switch): requests
  complete, nothing fails, the worker stays ready; a client that leaves mid-stream has its
  request dropped at the next step boundaries, not at its end; and a worker that is truly stopped
  (SIGSTOP) is still dropped at the heartbeat timeout, and serves again when it resumes;
- an exception in a step (test-only switch): the worker's stream ends with a 503 error event at
  once (the heartbeat timeout here is far longer than the test), /ready shows the lost capacity,
  the worker exits non-zero, and `pagemesh up` starts it again under its id;
- a process that keeps dying at start stops `pagemesh up`, which prints its log tail.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, LATE_S, SeparateProcesses, running_mesh, sample_until, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.tests.integration.conftest import stream_counting
from pagemesh.workers.shell.faults import DELAY_ENV, FAIL_ENV

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 5.0  # the default, the one a loaded machine's long step once ran past
STEP_DELAY_S = 6.0  # every step sleeps this long first: longer than the heartbeat timeout
# Where the heartbeat timeout is not what a test is about, one that no stall of a loaded
# machine (a full page cache stalls a process for seconds) comes near.
NEVER_S = str(LATE_S)


def ready_status(url: str) -> int:
    try:
        return urllib.request.urlopen(url + "/ready", timeout=HANG_S).status
    except urllib.error.HTTPError as e:
        return e.code


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


REQUEST = dict(model=DEFAULT_MODEL_NAME, prompt="Count on:", temperature=0, extra_body={"ignore_eos": True})


def test_an_engine_failure_fails_its_requests_at_once_and_the_worker_is_started_again():
    output: list[str] = []
    # the third step raises; the heartbeat timeout is far longer than the test: a prompt error
    # can only come from the worker saying its engine failed. No wait for the worker's return
    # (--worker-return-wait 0): its requests fail at once (with the wait they move to the restarted
    # worker, which fails again at its third step, here)
    flags = ("--mixed", "1", "--heartbeat-timeout", str(HANG_S), "--worker-return-wait", "0")
    with running_mesh(*flags, env={FAIL_ENV: "3"}, output=output) as url:
        client = client_of(url)
        received = [0]
        pieces, error, _ = stream_counting(client, received, 0, max_tokens=20, **REQUEST)
        assert 0 < pieces <= 2  # two steps ran, a token each
        assert isinstance(error, openai.APIError) and "the engine of worker mixed-0 failed" in str(error), repr(error)
        # the scheduler dropped it at once: /ready shows no LLM capacity until it is back
        assert sample_until(lambda: ready_status(url), lambda s: s == 503, timeout=LATE_S) == 503
        assert wait_until(lambda: any("mixed-0 exited with code 1; starting it again" in line for line in output))
        assert sample_until(lambda: ready_status(url), lambda s: s == 200) == 200  # started again under its id
        assert client.completions.create(max_tokens=2, **REQUEST).usage.completion_tokens == 2


def test_a_process_that_keeps_dying_at_start_stops_the_mesh_with_its_log_tail(tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")
    with pytest.raises(RuntimeError) as failed, running_mesh("--mixed", "1", "--model", missing):
        pass
    said = str(failed.value)
    assert "before it was ready, 3 times in a row; its last log lines:" in said, said
    assert "no-such-model" in said.split("its last log lines:", 1)[1], said  # the child's own words


def test_sigterm_drains_pagemesh_up_in_order_and_exits_0():
    # steps of 0.5 s keep requests in flight long enough to watch the drain; the long stream
    # outlasts the drain timeout, the short one does not
    drain_timeout_s = 20.0
    output: list[str] = []
    launcher: list = []
    env = {DELAY_ENV: "0.5"}
    flags = ("--mixed", "1", "--drain-timeout", str(drain_timeout_s), "--heartbeat-timeout", NEVER_S)
    with running_mesh(*flags, env=env, output=output, launcher=launcher) as url:
        client = client_of(url)
        received = [0, 0]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            short = pool.submit(stream_counting, client, received, 0, max_tokens=3, **REQUEST)
            long = pool.submit(stream_counting, client, received, 1, max_tokens=2000, **REQUEST)
            assert wait_until(lambda: all(received))  # both are streaming
            terminated_at = time.monotonic()
            launcher[0].send_signal(signal.SIGTERM)
            # the gateway stops admitting at once: /ready and new requests get 503 + Retry-After
            assert sample_until(lambda: ready_status(url), lambda s: s == 503, timeout=LATE_S) == 503
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(max_tokens=1, **REQUEST)
            assert refused.value.status_code == 503 and refused.value.code == "shutting_down"
            assert refused.value.response.headers["Retry-After"] == "5"
            pieces, error, _ = short.result(timeout=HANG_S)
            assert error is None and pieces > 0, repr(error)  # what was in flight finished
            pieces, error, ended = long.result(timeout=HANG_S)
        # ... but not past the drain timeout: then an error event
        assert isinstance(error, openai.APIError) and "shut down before it finished" in str(error), repr(error)
        assert drain_timeout_s <= ended - terminated_at < drain_timeout_s + LATE_S
        assert launcher[0].wait(timeout=HANG_S) == 0
    assert not any("exited with code" in line for line in output)  # nothing was restarted


@pytest.fixture(scope="module")
def slow_steps(tmp_path_factory):
    os.environ[DELAY_ENV] = str(STEP_DELAY_S)  # the children read it at start
    # no wait for a lost worker's return: the stopped worker's stream fails at once (nobody restarts it)
    flags = ("--mixed", "1", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--worker-return-wait", "0")
    procs = SeparateProcesses(str(tmp_path_factory.mktemp("slow")), *flags)
    try:
        procs.start()
    finally:
        del os.environ[DELAY_ENV]
    try:
        yield procs
    finally:
        procs.stop()


def test_steps_longer_than_the_heartbeat_timeout_fail_nothing(slow_steps):
    client = client_of(slow_steps.url)
    received = [0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream_counting, client, received, 0, max_tokens=2, **REQUEST)
        whole = pool.submit(client.completions.create, max_tokens=2, **REQUEST)
        pieces, error, _ = streamed.result(timeout=HANG_S)
        assert error is None and pieces > 0, repr(error)
        assert whole.result(timeout=HANG_S).usage.completion_tokens == 2
    # every step took STEP_DELAY_S, more than the heartbeat timeout: the worker stayed registered
    assert ready_status(slow_steps.url) == 200


def worker_row(url: str, worker_id: str) -> dict | None:
    """The worker's row of the status page's JSON (GET /status): its counters and pages."""
    doc = json.loads(urllib.request.urlopen(url + "/status", timeout=HANG_S).read())
    return next((w for w in doc["workers"] if w["id"] == worker_id), None)


def idle_and_settled(url: str, worker_id: str) -> dict | None:
    """The worker's row once it runs nothing and its counters stay the same across a few
    heartbeats (a load snapshot taken between a step and the sending of its output lags: it
    counts the requests that step finished only in the next one)."""
    last: list[dict | None] = [None]

    def counters() -> tuple | None:
        row = worker_row(url, worker_id)
        previous, last[0] = last[0], row
        key = lambda w: (w["produced"], w["requests_finished"], w["running"], w["kv"]["used_pages"])  # noqa: E731
        return (key(previous) if previous else None, key(row) if row else None)

    settled = sample_until(counters, lambda p: p[1] is not None and p[1][2] == 0 and p[0] == p[1], interval=1.0)
    return last[0] if settled is not None else None


def test_a_client_that_leaves_during_a_slow_step_is_dropped_at_the_next_step_boundaries(slow_steps):
    """On a CPU the step holds the worker's event loop thread, so an abort waits for the step in
    progress; the engine's state changes only between steps, so no design frees the pages
    sooner. What must hold is that it waits for no more than that (it waited two more steps
    before, workers/shell/shell.py TURNS_TO_HANDLE_A_MESSAGE): the request stops at the step
    boundary after the abort came, and gives back every page."""
    url = slow_steps.url
    before = idle_and_settled(url, "mixed-0")
    assert before is not None
    client = client_of(url)
    stream = client.completions.create(stream=True, max_tokens=200, **REQUEST)
    first = next(c for c in stream if c.choices and c.choices[0].text)  # step 1's token (the prefill)
    assert first.choices[0].finish_reason is None
    stream.close()  # the client leaves while step 2 computes

    def ended(w: dict) -> bool:  # a view from after the abort (one from before the request: produced equal)
        return w["produced"] > before["produced"] and w["running"] == 0 and w["kv"]["used_pages"] == 0

    after = sample_until(lambda: worker_row(url, "mixed-0"), ended)
    assert after is not None
    # the gateway finds the connection closed when it writes step 2's token (or at once), so the
    # abort reaches the worker during step 3 (or 2) and ends the request at its end; handled
    # two steps late it ran 4 or 5, and it would have run 200
    assert after["produced"] - before["produced"] <= 3
    assert after["requests_finished"] == before["requests_finished"]  # aborted, not run to its end
    assert ready_status(url) == 200


def test_a_stopped_worker_is_still_dropped_and_serves_again_when_it_resumes(slow_steps):
    client = client_of(slow_steps.url)
    worker = slow_steps.children["mixed-0"]
    received = [0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_counting, client, received, 0, max_tokens=200, **REQUEST)
        assert wait_until(lambda: received[0] > 0)  # tokens flow
        stopped_at = time.monotonic()
        worker.send_signal(signal.SIGSTOP)  # hung: no step, no heartbeat thread either
        try:
            pieces, error, ended = streaming.result(timeout=HANG_S)
            assert isinstance(error, openai.APIError) and "stopped responding" in str(error), repr(error)
            assert ended - stopped_at < HEARTBEAT_TIMEOUT_S + STEP_DELAY_S + LATE_S
            assert sample_until(lambda: ready_status(slow_steps.url), lambda s: s == 503, timeout=LATE_S) == 503
        finally:
            worker.send_signal(signal.SIGCONT)
    # resumed: its heartbeats are answered UnknownWorker, it registers again, the mesh is ready
    assert sample_until(lambda: ready_status(slow_steps.url), lambda s: s == 200) == 200
    assert client.completions.create(max_tokens=1, **REQUEST).usage.completion_tokens == 1
