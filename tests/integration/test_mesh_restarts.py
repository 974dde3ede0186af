"""Processes restarted in place, as compose's `restart: unless-stopped` does:

- a worker restarted under the same id (before its heartbeats are missed), with migration off
  (`--max-migrations 0`): the requests the old process held end with an error as soon as the new
  one registers, not at the heartbeat timeout;
- a restarted scheduler: the workers register with it again (listing what they hold, and sending
  a snapshot of their prefix caches' keys) and the mesh serves on; what it had queued is sent to
  it again by the tokenizer, and the requests already on workers go on to their end;
- a restarted tokenizer: the gateway sends the streams that went through it to the new process,
  with what their clients have had, and they go on to their end (the old placement is aborted);
- a paused scheduler (SIGSTOP, as a starved one): the requests that waited in its socket are
  served when it runs again, and no worker is judged dead by the heartbeats it could not read;
- a killed gateway: its requests are aborted once its pings have been missing for a while (or at
  once by the gateway's new process, if it is restarted), and their pages are free.

The processes are started one by one, as compose starts them, so that one can be restarted.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import openai
import pytest
import zmq

from pagemesh.bench.local_mesh import HANG_S, LATE_S, SeparateProcesses, metrics, per_worker, sample_until, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.common.protocol import ClusterStatus, StatusRequest, decode, encode
from pagemesh.services.tokenizer.gateway_liveness import GATEWAY_TIMEOUT_S
from pagemesh.tests.integration.conftest import stream_counting

pytestmark = pytest.mark.slow
# A heartbeat timeout no restart comes near, where the test is not about losing a worker (a
# worker's restart took up to a minute on a loaded machine), and a short one where it is.
NEVER_S = str(HANG_S)
HEARTBEAT_TIMEOUT_S = 2.0


@pytest.fixture
def processes(tmp_path, request):
    procs = SeparateProcesses(str(tmp_path), *request.param)
    try:
        procs.start()
        yield procs
    finally:
        procs.stop()


GO_ON = dict(model=DEFAULT_MODEL_NAME, prompt="Go on:", temperature=0, extra_body={"ignore_eos": True})


def start_stream(pool, client, received: list[int], max_tokens: int) -> concurrent.futures.Future:
    """A greedy stream of `max_tokens` in `pool`, counting its chunks in received[0] (its future:
    stream_counting's result)."""
    return pool.submit(stream_counting, client, received, 0, max_tokens=max_tokens, **GO_ON)


def complete(client, max_tokens=5):
    return client.completions.create(
        model=DEFAULT_MODEL_NAME, prompt="Hello", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )


# migration off: with it, the request would move to the new process (test_mesh_worker_loss.py)
@pytest.mark.parametrize(
    "processes", [("--mixed", "1", "--heartbeat-timeout", NEVER_S, "--max-migrations", "0")], indirect=True
)
def test_a_worker_restarted_under_its_id_fails_what_the_old_process_held(processes):
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)

    received = [0]  # text chunks so far

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = start_stream(pool, client, received, 2000)
        assert wait_until(lambda: received[0] > 0)  # it is streaming
        ready_at = processes.restart("mixed-0")
        pieces, error, ended = running.result(timeout=HANG_S)
    assert pieces > 0 and isinstance(error, openai.APIError) and "restarted" in str(error), repr(error)
    assert ended - ready_at < LATE_S  # when the new process registered (just before it was ready)
    assert complete(client).usage.completion_tokens == 5


@pytest.mark.parametrize("processes", [("--mixed", "1", "--heartbeat-timeout", NEVER_S)], indirect=True)
def test_a_restarted_scheduler_gets_its_workers_back(processes):
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    assert complete(client).usage.completion_tokens == 5
    processes.restart("scheduler")
    assert wait_until(lambda: "mixed-0" in per_worker(metrics(processes.url), "pagemesh_kv_cache_usage_ratio"))
    assert complete(client).usage.completion_tokens == 5


@pytest.mark.parametrize(
    "processes", [("--prefill", "1", "--decode", "1", "--heartbeat-timeout", NEVER_S)], indirect=True
)
def test_a_restarted_scheduler_learns_the_workers_prefix_caches_again(processes):
    """The workers' snapshots (KV events, seq 0, after registering again) rebuild the new
    scheduler's prefix index: the decode worker holds the prompt's full pages, so only the last,
    partial page travels again."""
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    prompt = [(37 * i) % 5000 + 100 for i in range(200)] + list(range(17, 27))  # 210 tokens: 14 pages of 16

    def kv_bytes() -> float:
        return metrics(processes.url).get("pagemesh_kv_transfer_bytes_total", 0.0)

    def moved() -> float:
        """The KV bytes one request of `prompt` moved from the prefill to the decode worker."""
        before = kv_bytes()
        client.completions.create(
            model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
        )
        assert wait_until(lambda: kv_bytes() > before)  # the workers' next heartbeats
        return kv_bytes() - before

    first = moved()  # every page
    processes.restart("scheduler")

    def both_back() -> bool:  # registered again (their snapshots follow at once), counters reported
        samples = metrics(processes.url)
        workers = set(per_worker(samples, "pagemesh_kv_cache_usage_ratio"))
        return workers == {"prefill-0", "decode-0"} and samples.get("pagemesh_kv_transfer_bytes_total") == first

    assert wait_until(both_back)
    assert moved() == first / 14


PAUSED_TIMEOUT_S = 3.0  # short, so that the pause outlasts it; not so short that a busy machine's stall does


@pytest.mark.parametrize("processes", [("--mixed", "1", "--heartbeat-timeout", str(PAUSED_TIMEOUT_S))], indirect=True)
def test_a_paused_scheduler_serves_what_waited_for_it_and_drops_no_worker(processes):
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    scheduler = processes.children["scheduler"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scheduler.send_signal(signal.SIGSTOP)
        try:
            waiting = pool.submit(complete, client)  # read by the scheduler only once it runs again
            time.sleep(2 * PAUSED_TIMEOUT_S)  # longer than the heartbeat timeout, in which
        finally:  # the worker's heartbeats wait unread
            scheduler.send_signal(signal.SIGCONT)
        assert waiting.result(timeout=HANG_S).usage.completion_tokens == 5  # not a 503: no workers
    assert "mixed-0" in per_worker(metrics(processes.url), "pagemesh_kv_cache_usage_ratio")
    assert complete(client).usage.completion_tokens == 5


def queued_at_scheduler(url: str) -> float:
    return metrics(url).get("pagemesh_scheduler_queued_requests", 0.0)


@pytest.mark.parametrize(
    "processes", [("--mixed", "1", "--max-num-seqs", "3", "--heartbeat-timeout", NEVER_S)], indirect=True
)
def test_a_restarted_scheduler_loses_nothing_queued_or_placed(processes):
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    received = [0, 0]
    running = lambda: per_worker(metrics(processes.url), "pagemesh_num_requests_running").get("mixed-0", 0)  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streaming = start_stream(pool, client, received, 400)
        assert wait_until(lambda: received[0] > 0)
        # two sequences that send nothing until they end (best_of): only the worker knows it runs
        silent = pool.submit(
            client.completions.create,
            model=DEFAULT_MODEL_NAME,
            prompt="Hold on:",
            max_tokens=600,
            best_of=2,
            temperature=0.8,
            seed=1,
            extra_body={"ignore_eos": True},
        )
        assert wait_until(lambda: running() == 3, interval=0.2)  # the worker is full
        queued = pool.submit(
            stream_counting, client, received, 1, model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=5, temperature=0
        )
        assert wait_until(lambda: queued_at_scheduler(processes.url) == 1, interval=0.2)
        processes.restart("scheduler")
        pieces, error, _ = queued.result(timeout=HANG_S)  # lost with the old process: sent to the new one
        assert error is None and pieces > 0, repr(error)
        pieces, error, _ = streaming.result(timeout=HANG_S)
        assert error is None and pieces > 300  # placed before the restart: streamed to its end
        assert silent.result(timeout=HANG_S).usage.completion_tokens == 600  # held by the worker: not failed
    assert complete(client).usage.completion_tokens == 5


@pytest.mark.parametrize("processes", [("--mixed", "1")], indirect=True)
def test_a_restarted_tokenizer_takes_its_streams_back_and_they_go_on_to_their_end(processes):
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    received = [0]
    running = lambda m: per_worker(m, "pagemesh_num_requests_running").get("mixed-0")  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = start_stream(pool, client, received, 600)
        assert wait_until(lambda: received[0] > 0)
        processes.restart("tokenizer")
        before_end = received[0]
        pieces, error, _ = streaming.result(timeout=HANG_S)
    assert error is None and pieces > before_end, repr(error)  # no error event: it went on after the restart
    samples = sample_until(lambda: metrics(processes.url), lambda m: running(m) == 0, interval=0.2)
    # the first placement was aborted (not counted as finished), the moved one ran to its end
    assert samples and per_worker(samples, "pagemesh_worker_requests_total").get("mixed-0") == 1
    assert samples.get("pagemesh_tokenizer_moves_total") == 1
    assert complete(client).usage.completion_tokens == 5


# no wait for the lost worker's return (nobody restarts it here): its stream fails at once
@pytest.mark.parametrize(
    "processes",
    [("--mixed", "1", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--worker-return-wait", "0")],
    indirect=True,
)
def test_after_a_scheduler_restart_a_worker_loss_still_ends_its_streams(processes):
    """The worker tells the new scheduler which requests it holds when it registers again, so
    losing it later fails them as it would have before the restart."""
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    received = [0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = start_stream(pool, client, received, 3000)
        assert wait_until(lambda: received[0] > 0)
        processes.restart("scheduler")
        assert wait_until(lambda: "mixed-0" in per_worker(metrics(processes.url), "pagemesh_kv_cache_usage_ratio"))
        streamed = received[0]
        killed_at = time.monotonic()
        processes.kill("mixed-0")
        pieces, error, ended = streaming.result(timeout=HANG_S)
    assert pieces >= streamed and isinstance(error, openai.APIError) and "stopped responding" in str(error), repr(error)
    assert ended - killed_at < HEARTBEAT_TIMEOUT_S + LATE_S  # the heartbeat timeout, not the 600 s request timeout


def scheduler_status(processes) -> ClusterStatus:
    """The scheduler's ClusterStatus, asked on its own socket (no gateway needed)."""
    address = processes.argv["scheduler"][processes.argv["scheduler"].index("--address") + 1]
    with zmq.Context.instance().socket(zmq.DEALER) as client:
        client.connect(address)
        client.send_multipart(encode(StatusRequest(requester="test-probe")))
        assert client.poll(HANG_S * 1000)
        status = decode(client.recv_multipart())
    assert isinstance(status, ClusterStatus)
    return status


def mixed_worker(status: ClusterStatus):
    return next(w for w in status.workers if w.worker_id == "mixed-0")


def idle(status: ClusterStatus) -> bool:
    """mixed-0 runs nothing and holds no page."""
    worker = mixed_worker(status)
    return worker.running == 0 and worker.kv is not None and worker.kv.used_pages == 0


@pytest.mark.parametrize("processes", [("--mixed", "1", "--heartbeat-timeout", NEVER_S)], indirect=True)
def test_a_killed_gateways_stream_is_aborted_and_its_pages_freed(processes):
    """Nothing leaks when a gateway dies mid-stream and stays dead: its pings stop, and after
    GATEWAY_TIMEOUT_S the tokenizer aborts its requests: the worker stops generating (the
    request is not counted as finished) and its pages are free. Started again, it serves."""
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    received = [0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = start_stream(pool, client, received, 4000)  # minutes of tokens: it must be stopped, not run out
        assert wait_until(lambda: received[0] > 0)
        # the scheduler has the worker's heartbeat saying it runs the request
        assert sample_until(lambda: scheduler_status(processes), lambda s: not idle(s), interval=0.2)
        processes.kill("gateway")
        killed_at = time.monotonic()
        _, error, _ = streaming.result(timeout=HANG_S)
    assert error is not None  # the client's connection dropped

    status = sample_until(lambda: scheduler_status(processes), idle, timeout=GATEWAY_TIMEOUT_S + LATE_S, interval=0.5)
    assert status is not None, "the dead gateway's request kept running"
    assert time.monotonic() - killed_at > GATEWAY_TIMEOUT_S - 1  # the tokenizer waited for the missing pings
    assert mixed_worker(status).requests_finished == 0  # aborted
    processes.restart("gateway")
    assert complete(client).usage.completion_tokens == 5


@pytest.mark.parametrize("processes", [("--mixed", "1", "--heartbeat-timeout", NEVER_S)], indirect=True)
def test_a_gateway_restarted_at_once_aborts_what_its_old_process_left(processes):
    """Restarted at the same address, it pings on, so the tokenizer's timeout never comes: the
    new process aborts the old one's request as its tokens arrive for a request it does not know."""
    client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    received = [0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = start_stream(pool, client, received, 4000)
        assert wait_until(lambda: received[0] > 0)
        assert sample_until(lambda: scheduler_status(processes), lambda s: not idle(s), interval=0.2)
        ready_at = processes.restart("gateway")
        streaming.result(timeout=HANG_S)
    status = sample_until(lambda: scheduler_status(processes), idle, timeout=LATE_S, interval=0.2)
    assert status is not None, "the old process's request kept running"
    assert time.monotonic() - ready_at < GATEWAY_TIMEOUT_S  # not the tokenizer's timeout
    assert mixed_worker(status).requests_finished == 0  # aborted
