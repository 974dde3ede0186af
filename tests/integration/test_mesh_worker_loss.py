"""A worker that dies mid-request (SIGKILL, as a container of a scaled pool can): its streams go on
on the pool's other worker, with the text of a run without the fault, no token lost or repeated
and no error event (greedy, and seeded sampling, which continues its seed's sequence; a request of
two choices moves each with its own tokens); so does
the stream of a worker whose engine raised in a step (it tells the scheduler and exits). A request
that keeps losing its workers ends at `--max-migrations` with the OpenAI error event, and so does
one whose pool has no worker left. A prefill worker killed while its KV pages are on their way to
the decode worker (held there by a test-only delay): the request moves and ends with the fault-free
text, and the decode worker keeps no page of the lost handoff.

One mesh for the module's tests, of a prefill and two decode workers under the defaults (the
default model as served by default, no `--batch-invariant`), its processes started one by one as
compose starts them (`pagemesh up` would stop the whole mesh when a child exits), so that a
killed worker can be started again. The texts are exact because the resume is (issue 35,
services/scheduler/migration.py): the prefill worker kept the pages it handed off and sends the
same bits to the other decode worker, which decodes the streamed tokens again one step each, as
they were first decoded; while a stream runs its prompt's pages stay on the prefill worker, and
once it ends they are freed. (A mixed worker recomputes a migrated request whole: see
tests/unit/test_scheduler_migration.py; exact there only with `--batch-invariant`, as
test_mesh_tokenizer_replicas.py runs.)
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, LATE_S, SeparateProcesses, metrics, per_worker, sample_until, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.workers.shell.faults import DELAY_ENV, FAIL_ENV, KV_SEND_DELAY_ENV

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 5.0  # the default: a step on a loaded CPU can starve heartbeats for seconds
MAX_MIGRATIONS = 1
# Long enough that the kill lands mid-stream: the holder is read from heartbeats (0.25 s apart)
# through /metrics scrapes, which take a while on a loaded machine.
GREEDY = dict(prompt="Count on and on:", max_tokens=64, temperature=0)
SEEDED = dict(prompt="Tell me a story:", max_tokens=64, temperature=0.9, top_p=0.95, seed=1234)
# The tests that must kill a stream's holder before the stream ends start their workers with each
# step slowed by this much (64 steps take 13 s or more): on an idle machine 64 tokens once came out
# of the second worker before the test had read the holder and killed it, and the stream ended
# without the error event the test waits for. Well under the heartbeat timeout.
SLOW_STEP = {DELAY_ENV: "0.2"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    procs = SeparateProcesses(
        str(tmp_path_factory.mktemp("mesh")),
        "--prefill",
        "1",
        "--decode",
        "2",
        "--heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT_S),
        "--max-migrations",
        str(MAX_MIGRATIONS),
        # no wait for a lost worker's return: a request with no worker left fails at once (what
        # one test here checks); the wait is tests/unit/test_scheduler_migration.py's
        "--worker-return-wait",
        "0",
    )
    try:
        procs.start()  # every process started and ready; nobody watches them after
        yield procs
    finally:
        procs.stop()


def prefill_usage(mesh) -> float | None:
    return per_worker(metrics(mesh.url), "pagemesh_kv_cache_usage_ratio").get("prefill-0")


def client_of(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def stream(client, pieces: list[str], **request) -> Exception | None:
    """Stream a completion to its end, appending its text pieces to `pieces` as they come (another
    thread can wait on them); returns the error event that ended it, or None."""
    try:
        for chunk in client.completions.create(
            model=DEFAULT_MODEL_NAME, stream=True, extra_body={"ignore_eos": True}, **request
        ):
            if chunk.choices and chunk.choices[0].text:
                pieces.append(chunk.choices[0].text)
    except openai.APIError as e:
        return e
    return None


def fault_free(client, **request) -> str:
    pieces: list[str] = []
    assert stream(client, pieces, **request) is None
    return "".join(pieces)


def pool_of(mesh) -> list[str]:
    """The two workers a stream runs on (mixed, or decode), by name."""
    return sorted(name for name in mesh.children if name.startswith(("mixed-", "decode-")))


def llm_workers(mesh) -> set[str]:
    return {name for name in mesh.children if name.startswith(("mixed-", "decode-", "prefill-"))}


def running(mesh) -> dict[str, float]:
    samples = per_worker(metrics(mesh.url), "pagemesh_num_requests_running")
    return {name: n for name, n in samples.items() if name in pool_of(mesh)}  # not a prefill worker's


def pool_idle(mesh) -> bool:
    """Every worker of the pool reports no running request. Wait for this before starting the
    stream whose holder is wanted: a heartbeat sent just before the previous request ended still
    counts it (CI once killed that stale holder, and the stream went on untouched elsewhere)."""
    return wait_until(lambda: sum(running(mesh).values()) == 0)


def holder_once_streaming(mesh, pieces: list, at_least: int, sequences: int = 1) -> str:
    """The worker running the one request, once `at_least` pieces of it have arrived (the pool
    was idle before it started: see pool_idle). `sequences`: how many the worker counts running
    for it (one per choice)."""
    counts = sample_until(lambda: running(mesh), lambda c: sum(c.values()) == sequences and len(pieces) >= at_least)
    assert counts, "the stream never ran"
    return max(counts, key=counts.get)


def migrations(mesh) -> float | None:
    """The scheduler's count of moves; None when it did not answer the gateway in time (the
    gateway then leaves the cluster's series out rather than show stale ones)."""
    return metrics(mesh.url).get("pagemesh_request_migrations_total")


def registered(mesh) -> set[str]:
    return set(per_worker(metrics(mesh.url), "pagemesh_kv_cache_usage_ratio"))


def both_workers_live(mesh) -> bool:
    return wait_until(lambda: registered(mesh) == llm_workers(mesh))


@pytest.mark.parametrize("request_kind", ["greedy", "seeded"])
def test_a_killed_workers_stream_goes_on_on_the_other_with_the_fault_free_text(mesh, request_kind):
    request = GREEDY if request_kind == "greedy" else SEEDED
    client = client_of(mesh)
    assert both_workers_live(mesh)
    expected = fault_free(client, **request)
    assert wait_until(lambda: prefill_usage(mesh) == 0)  # what prefill-0 kept for it is freed at its end
    before = sample_until(lambda: migrations(mesh), lambda n: n is not None)
    pieces: list[str] = []
    assert pool_idle(mesh)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ended = pool.submit(stream, client, pieces, **request)
        victim = holder_once_streaming(mesh, pieces, at_least=3)
        mesh.kill(victim)
        try:
            # its prompt's pages stay on prefill-0 while the stream waits to move (the heartbeat
            # timeout: seconds), which a heartbeat of prefill-0 shows...
            kept = wait_until(lambda: (prefill_usage(mesh) or 0) > 0)
            error = ended.result(timeout=HANG_S)
            assert error is None  # one unbroken stream
            assert "".join(pieces) == expected  # nothing lost, nothing repeated, the same tokens
            moved = sample_until(lambda: migrations(mesh), lambda n: n is not None and n >= before + 1, timeout=LATE_S)
            assert moved is not None
            assert kept
            assert wait_until(lambda: prefill_usage(mesh) == 0)  # ...until the stream ended
        finally:
            mesh.restart(victim)  # the pool is whole again for the next test, whatever this one found


def stream_choices(client, pieces: list[tuple[int, str]], **request) -> Exception | None:
    """`stream` for a request of several choices: (choice index, text piece) as they come."""
    try:
        for chunk in client.completions.create(
            model=DEFAULT_MODEL_NAME, stream=True, extra_body={"ignore_eos": True}, **request
        ):
            pieces += [(c.index, c.text) for c in chunk.choices if c.text]
    except openai.APIError as e:
        return e
    return None


def texts_by_choice(pieces: list[tuple[int, str]]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for index, text in pieces:
        texts[index] = texts.get(index, "") + text
    return texts


def test_a_killed_workers_stream_of_two_choices_goes_on_with_both_fault_free_texts(mesh):
    """n = 2, seeded: each choice moves with the tokens its client received and draws on from
    its own seed (seed + index), so both texts are those of the run without the fault."""
    request = dict(SEEDED, n=2, max_tokens=160)  # long enough for the holder to be seen mid-stream
    client = client_of(mesh)
    assert both_workers_live(mesh)
    expected: list[tuple[int, str]] = []
    assert stream_choices(client, expected, **request) is None
    assert len(set(texts_by_choice(expected).values())) == 2  # two different choices
    before = sample_until(lambda: migrations(mesh), lambda n: n is not None)
    pieces: list[tuple[int, str]] = []
    assert pool_idle(mesh)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ended = pool.submit(stream_choices, client, pieces, **request)
        victim = holder_once_streaming(mesh, pieces, at_least=6, sequences=2)  # both choices under way
        mesh.kill(victim)
        try:
            assert ended.result(timeout=HANG_S) is None  # one unbroken stream
            assert texts_by_choice(pieces) == texts_by_choice(expected)
            moved = sample_until(lambda: migrations(mesh), lambda n: n is not None and n >= before + 1, timeout=LATE_S)
            assert moved is not None
        finally:
            mesh.restart(victim)


def prefill_holds_pages_for_a_transfer(mesh) -> bool:
    """prefill-0 has prefilled (runs nothing) and still holds pages: they wait for the transfer."""
    samples = metrics(mesh.url)
    used = per_worker(samples, "pagemesh_kv_cache_usage_ratio").get("prefill-0", 0)
    return used > 0 and per_worker(samples, "pagemesh_num_requests_running").get("prefill-0") == 0


def pool_pages_free(mesh) -> bool:
    usage = per_worker(metrics(mesh.url), "pagemesh_kv_cache_usage_ratio")
    return all(usage.get(name) == 0 for name in pool_of(mesh))


def test_a_prefill_worker_killed_mid_transfer_loses_nothing(mesh):
    client = client_of(mesh)
    assert both_workers_live(mesh)
    expected = fault_free(client, **GREEDY)
    before = sample_until(lambda: migrations(mesh), lambda n: n is not None)
    mesh.restart("prefill-0", env={KV_SEND_DELAY_ENV: str(HANG_S)})  # it never sends: killed first
    try:
        assert both_workers_live(mesh)
        pieces: list[str] = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ended = pool.submit(stream, client, pieces, **GREEDY)
            assert wait_until(lambda: prefill_holds_pages_for_a_transfer(mesh))
            mesh.kill("prefill-0")  # its pages packed, the decode worker waiting for them
            error = ended.result(timeout=HANG_S)
        assert error is None  # one unbroken stream
        assert "".join(pieces) == expected
        assert sample_until(lambda: migrations(mesh), lambda n: n is not None and n >= before + 1, timeout=LATE_S)
        assert wait_until(lambda: pool_pages_free(mesh))  # the decode half gave back what it pinned
    finally:
        mesh.restart("prefill-0")  # without the delay, for the next tests


def test_an_engine_that_fails_in_a_step_moves_its_stream_to_the_other_worker(mesh):
    """An exception in a step (the engine is dead, the process lives to say so): the worker tells
    the scheduler at once, and its stream goes on on the pool's other worker with the fault-free
    text. decode-0 takes the stream: the pool is idle, the prompt is new to both workers (no
    prefix to prefer), and placement breaks the tie by worker id."""
    client = client_of(mesh)
    faulty = pool_of(mesh)[0]
    assert faulty == "decode-0"
    before = sample_until(lambda: migrations(mesh), lambda n: n is not None)
    mesh.restart(faulty, env={FAIL_ENV: "6"})  # its sixth step of work raises
    request = dict(GREEDY, prompt="Name the days of the week, then the months:")
    try:
        assert both_workers_live(mesh)
        assert pool_idle(mesh)
        pieces: list[str] = []
        assert stream(client, pieces, **request) is None  # one unbroken stream
        assert mesh.children[faulty].wait(timeout=LATE_S) == 1  # it ran the stream and its engine failed
        assert sample_until(lambda: migrations(mesh), lambda n: n is not None and n >= before + 1, timeout=LATE_S)
    finally:
        mesh.restart(faulty)  # without the fault, for the next tests
    assert both_workers_live(mesh)
    assert "".join(pieces) == fault_free(client, **request)


def test_a_request_that_keeps_losing_its_workers_ends_at_max_migrations(mesh):
    client = client_of(mesh)
    for name in pool_of(mesh):
        mesh.restart(name, env=SLOW_STEP)
    assert both_workers_live(mesh)
    pieces: list[str] = []
    assert pool_idle(mesh)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ended = pool.submit(stream, client, pieces, **GREEDY)
        first = holder_once_streaming(mesh, pieces, at_least=3)
        mesh.kill(first)
        moved_at = len(pieces)
        second = holder_once_streaming(mesh, pieces, at_least=moved_at + 2)  # streaming on the other one
        assert second != first
        mesh.kill(second)
        error = ended.result(timeout=HANG_S)
    assert isinstance(error, openai.APIError), repr(error)
    assert f"--max-migrations is {MAX_MIGRATIONS}" in str(error) and "stopped responding" in str(error)


def test_with_no_worker_left_in_the_pool_the_stream_ends_with_the_error_event(mesh):
    client = client_of(mesh)
    survivor, dead = pool_of(mesh)
    mesh.restart(survivor, env=SLOW_STEP)  # the pool's only live worker (the previous test killed both)
    assert wait_until(lambda: registered(mesh) == llm_workers(mesh) - {dead})
    pieces: list[str] = []
    assert pool_idle(mesh)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ended = pool.submit(stream, client, pieces, **GREEDY)
        assert holder_once_streaming(mesh, pieces, at_least=2) == survivor
        mesh.kill(survivor)
        error = ended.result(timeout=HANG_S)
    assert pieces and isinstance(error, openai.APIError), repr(error)
    assert "no workers are available" in str(error)
