"""Exact migration under the defaults (issue 35): `--prefill 1 --decode 2`, the default model as
served by default, no `--batch-invariant`. A greedy or seeded stream whose decode worker gets
SIGKILL goes on on the other decode worker with the text of the run without the fault: the
prefill worker kept the pages it handed off and sends the same bits again, and the new decode
worker decodes the streamed tokens again one step each (services/scheduler/migration.py). While a
stream runs its prompt's pages stay on the prefill worker; once it ends they are freed.

(test_mesh_worker_loss.py runs its mesh with `--batch-invariant`, for the request of two choices,
which is recomputed whole where it moves.)
"""

from __future__ import annotations

import concurrent.futures

import pytest

from pagemesh.bench.local_mesh import HANG_S, LATE_S, SeparateProcesses, metrics, per_worker, sample_until, wait_until
from pagemesh.tests.integration.test_mesh_worker_loss import (
    GREEDY,
    SEEDED,
    both_workers_live,
    client_of,
    fault_free,
    holder_once_streaming,
    migrations,
    pool_idle,
    stream,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    procs = SeparateProcesses(
        str(tmp_path_factory.mktemp("mesh")),
        "--prefill",
        "1",
        "--decode",
        "2",
        "--heartbeat-timeout",
        "5",
        "--max-migrations",
        "1",
    )
    try:
        procs.start()
        yield procs
    finally:
        procs.stop()


def prefill_usage(mesh) -> float | None:
    return per_worker(metrics(mesh.url), "pagemesh_kv_cache_usage_ratio").get("prefill-0")


@pytest.mark.parametrize("request_kind", ["greedy", "seeded"])
def test_a_killed_decode_workers_stream_goes_on_with_the_fault_free_text_under_the_defaults(mesh, request_kind):
    request = GREEDY if request_kind == "greedy" else SEEDED
    client = client_of(mesh)
    assert both_workers_live(mesh)
    expected = fault_free(client, **request)
    assert wait_until(lambda: prefill_usage(mesh) == 0)  # what it kept for that stream is freed at its end
    before = sample_until(lambda: migrations(mesh), lambda n: n is not None)
    pieces: list[str] = []
    assert pool_idle(mesh)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ended = pool.submit(stream, client, pieces, **request)
        victim = holder_once_streaming(mesh, pieces, at_least=3)
        mesh.kill(victim)
        try:
            # the prompt's pages stay on the prefill worker while the stream waits to move (seconds:
            # the heartbeat timeout), which a heartbeat of the prefill worker shows...
            kept = wait_until(lambda: (prefill_usage(mesh) or 0) > 0)
            assert ended.result(timeout=HANG_S) is None  # one unbroken stream
            assert "".join(pieces) == expected  # the same tokens after the seam, not only before
            moved = sample_until(lambda: migrations(mesh), lambda n: n is not None and n >= before + 1, timeout=LATE_S)
            assert moved is not None
            assert kept
            assert wait_until(lambda: prefill_usage(mesh) == 0)  # ...until the stream ended
        finally:
            mesh.restart(victim)
