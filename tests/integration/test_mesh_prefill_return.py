"""A prefill worker stopped (SIGSTOP) before a request's first token, long enough to be judged
lost, that comes back: the request, moved with nothing streamed, waits for a place
(--worker-return-wait), is prefilled again by the same worker and handed to the same decode worker
it had before the loss, and streams to its end. The chaos soak (bench/chaos.py) found it hanging
until the gateway's timeout: the tokenizer ignored tokens from the decode worker, one of the
request's lost holders, because a decode worker never said it had taken a handed-off request.

The decode worker runs one request at a time and is busy with another stream, so the moved
request cannot go to it alone (as a recompute) and waits until both halves can take it.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, LATE_S, SeparateProcesses, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.tests.integration.conftest import stream_counting
from pagemesh.workers.shell.faults import DELAY_ENV

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 2.0
PREFILL_STEP_S = 3.0  # the prefill worker's steps: it is stopped inside one, before the first token


def test_a_request_moved_back_to_the_same_prefill_and_decode_workers_streams_to_its_end(tmp_path):
    flags = ("--prefill", "1", "--decode", "1", "--max-num-seqs", "2", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    with SeparateProcesses(str(tmp_path), *flags) as mesh:
        client = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        go_on = dict(model=DEFAULT_MODEL_NAME, temperature=0, extra_body={"ignore_eos": True})
        received = [0, 0, 0]
        enough = threading.Event()  # the busy stream's client leaves once the other two have ended

        def stream(k: int, prompt: str, max_tokens: int):
            stop = enough if k == 0 else None
            return pool.submit(
                stream_counting, client, received, k, stop=stop, prompt=prompt, max_tokens=max_tokens, **go_on
            )

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            busy = stream(0, "Count on:", 3000)  # one of the decode worker's two places, for a while
            assert wait_until(lambda: received[0] > 0, timeout=LATE_S)
            mesh.restart("prefill-0", env={DELAY_ENV: str(PREFILL_STEP_S)})
            moved = stream(1, "Go on:", 24)  # the other place; its prefill sleeps first
            time.sleep(PREFILL_STEP_S / 2)
            prefill = mesh.children["prefill-0"]
            os.kill(prefill.pid, signal.SIGSTOP)  # before its first token
            later = stream(2, "Then:", 24)  # queued ahead of the moved request: no place for it
            time.sleep(HEARTBEAT_TIMEOUT_S + 2.0)  # judged lost: the request moves, with nothing streamed
            os.kill(prefill.pid, signal.SIGCONT)  # `later` goes first; `moved` waits for `busy`'s place
            for k, run in ((1, moved), (2, later)):
                pieces, error, _ = run.result(timeout=HANG_S)
                assert error is None and received[k] == pieces > 0, (k, repr(error))
            enough.set()  # (its place is no longer needed: its 3000 tokens took a minute here)
            assert busy.result(timeout=HANG_S)[1] is None
        answer = client.completions.create(prompt="Go on:", max_tokens=24, **go_on)
        assert answer.usage.completion_tokens == 24
