"""A tensor-parallel rank that dies mid-stream (SIGKILL) takes its worker down, and the worker's
stream goes on on the pool's other tensor-parallel worker with the text of a run without the
fault: no token lost or repeated, no error event (issue 35: "also when a TP rank dies").

A prefill and two decode workers of two ranks each (`--prefill 1 --decode 2 -tp 2`), under the
defaults otherwise (no `--batch-invariant`), on test_model_families.py's tiny Llama checkpoint
(its yarn-rope variant: 4 query and 2 KV heads, two a rank and one KV head each; its token i is
the word `w{i}`) in fp32. The resume is exact (services/scheduler/migration.py): the prefill
worker's ranks kept the pages they handed off and send them again, rank by rank, and the other
decode worker decodes the streamed tokens again one step each, as the lost one did (one row a
step both times). Each step is slowed (the test-only step delay of workers/shell/faults.py) so
that the kill lands mid-stream. The processes are started one by one (`SeparateProcesses`)
because `pagemesh up` stops the whole mesh when one of them exits.
"""

from __future__ import annotations

import concurrent.futures
import os

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, SeparateProcesses, metrics, per_worker, sample_until, wait_until
from pagemesh.tests.integration.test_mesh_tensor_parallel import children, is_rank
from pagemesh.tests.integration.test_model_families import family_checkpoints  # noqa: F401 (a fixture)
from pagemesh.workers.shell.faults import DELAY_ENV

pytestmark = pytest.mark.slow
HEARTBEAT_TIMEOUT_S = 20.0  # four ranks on a loaded 2-core machine run slowly
STEP_DELAY_S = "0.1"  # 64 steps take 6 s or more: the kill lands before the stream ends
PROMPT = [10, 11, 12, 13, 14]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, family_checkpoints):  # noqa: F811 (the fixture)
    folder, _ = family_checkpoints("llama-yarn")
    flags = ("--model", str(folder), "--dtype", "float32", "--prefill", "1", "--decode", "2", "-tp", "2")
    flags += ("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--max-migrations", "1")
    saved = os.environ.get(DELAY_ENV)
    os.environ[DELAY_ENV] = STEP_DELAY_S  # the workers (and their ranks) inherit it
    try:
        procs = SeparateProcesses(str(tmp_path_factory.mktemp("tp-migration")), *flags)
        procs.start()
    finally:
        if saved is None:
            os.environ.pop(DELAY_ENV, None)
        else:
            os.environ[DELAY_ENV] = saved
    try:
        yield procs
    finally:
        procs.stop()


def stream(client, model: str, pieces: list[str]) -> Exception | None:
    request = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    try:
        for chunk in client.completions.create(stream=True, **request):
            if chunk.choices and chunk.choices[0].text:
                pieces.append(chunk.choices[0].text)
    except openai.APIError as e:
        return e
    return None


def running(mesh) -> dict[str, float]:
    return per_worker(metrics(mesh.url), "pagemesh_num_requests_running")


def test_a_killed_rank_moves_its_workers_stream_to_the_other_worker_with_the_fault_free_text(mesh):
    client = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    model = client.models.list().data[0].id
    clean: list[str] = []
    assert stream(client, model, clean) is None
    assert len("".join(clean).split()) == MAX_TOKENS
    assert wait_until(lambda: sum(running(mesh).values()) == 0)  # no stale holder from the clean run
    pieces: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ended = pool.submit(stream, client, model, pieces)
        counts = sample_until(lambda: running(mesh), lambda c: sum(c.values()) == 1 and len(pieces) >= 3)
        assert counts, "the stream never ran"
        holder = max(counts, key=counts.get)
        ranks = [pid for pid in children(mesh.children[holder].pid) if is_rank(pid)]
        assert ranks, f"{holder} has no rank process"
        os.kill(ranks[-1], 9)
        error = ended.result(timeout=HANG_S)
    assert error is None, error  # no error event: the stream moved
    assert len(pieces) < MAX_TOKENS + 1 and "".join(pieces) == "".join(clean)  # every token once, as without the fault
    assert metrics(mesh.url).get("pagemesh_request_migrations_total") == 1
    assert mesh.children[holder].wait(timeout=HANG_S) == 1  # the rank's worker went down as a whole
