"""Tokenizer replicas (`pagemesh up --tokenizers 2`) over real processes: two greedy streams, one
through each replica, and a replica SIGKILLed mid-stream. Both streams end without an error event,
with the text a run without the fault gives, no token lost or repeated: the gateway sends the lost
replica's streams again through the other one with what their clients have had, and the worker
recomputes those tokens and goes on. Then the killed replica, restarted, serves again.

As in tests/integration/test_mesh_worker_loss.py, a prefill and a decode worker run the default
model under the defaults (no `--batch-invariant`): the gateway aborts the lost replica's request
naming the id it goes on under (AbortRequest.moved_to), so the pages the prefill worker kept of it
are sent again for that id and the decode worker replays the streamed tokens as decode steps: the
same bits (services/scheduler/migration.py). Each step is slowed a little (a test-only delay) so
the kill lands mid-stream on an idle machine.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, SeparateProcesses, metrics, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.workers.shell.faults import DELAY_ENV

pytestmark = pytest.mark.slow

PROMPTS = ("Count on and on:", "Tell me about the sea:")
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DELAY_ENV, "0.08")  # the workers' steps (96 take 8 s or more)
        procs = SeparateProcesses(
            str(tmp_path_factory.mktemp("mesh")), "--prefill", "1", "--decode", "1", "--tokenizers", "2"
        )
        try:
            procs.start()
            yield procs
        finally:
            procs.stop()


def stream(client, prompt: str, received: list[int], k: int) -> tuple[str, Exception | None]:
    """A greedy stream to its end: its text, and the error that ended it (None if none)."""
    text = ""
    try:
        for chunk in client.completions.create(
            model=DEFAULT_MODEL_NAME,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices and chunk.choices[0].text:
                text += chunk.choices[0].text
                received[k] += 1
    except openai.APIError as e:
        return text, e
    return text, None


def both_streams(client, kill=None) -> list[tuple[str, Exception | None]]:
    received = [0, 0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(stream, client, prompt, received, k) for k, prompt in enumerate(PROMPTS)]
        if kill is not None:
            assert wait_until(lambda: min(received) >= 8)  # both mid-stream
            kill()
        return [run.result(timeout=HANG_S) for run in runs]


def test_streams_of_a_killed_tokenizer_replica_go_on_through_the_other_with_the_same_text(mesh):
    client = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    fault_free = both_streams(client)
    assert all(error is None and text for text, error in fault_free), fault_free
    # the gateway spreads requests over the replicas: one stream through each, so one is moved
    with_fault = both_streams(client, kill=lambda: mesh.kill("tokenizer"))
    assert [error for _, error in with_fault] == [None, None]
    assert [text for text, _ in with_fault] == [text for text, _ in fault_free]
    assert metrics(mesh.url).get("pagemesh_tokenizer_moves_total", 0) >= 1
    mesh.restart("tokenizer")
    again = both_streams(client)  # the restarted replica serves its share again
    assert [text for text, _ in again] == [text for text, _ in fault_free]
