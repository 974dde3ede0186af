"""A tensor-parallel worker in the real mesh: the processes `pagemesh up --mixed 1 -tp 3` starts
(one worker of three ranks: SmolLM2-135M's 9 query heads and 3 KV heads split 3 and 1 per rank),
driven by the official openai client. Greedy text equals the single-rank engine's for
completions and chats, streamed and not, n > 1; the greedy tokens served are Hugging Face
transformers' (fp32, teacher-forced); beam search gives the single-rank engine's beams; then a
rank killed mid-stream takes its worker down: the stream ends with an OpenAI error, the worker and
its other ranks exit, nothing hangs.
Last, a second mesh, `pagemesh up --mixed 1 -pp 2` (two pipeline stages of 15 layers each), gives
the same greedy text.

The processes are started one by one (`SeparateProcesses`), with `pagemesh up`'s arguments,
because `pagemesh up` itself stops the whole mesh when one of them exits.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, LATE_S, SeparateProcesses, sample_until, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration.conftest import greedy_texts, hf_argmax_after_each, openai_client, stream_counting

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL_NAME
PROMPTS = ["The three primary colours are", "def fibonacci(n):"]
CHATS = ["What is 2 + 2?", "Name a fruit that is yellow."]
MAX_TOKENS = 12
BEAM_TOKENS = 6
HEARTBEAT_TIMEOUT_S = 20.0  # a loaded 2-core machine runs three ranks slowly; the loss test waits this long


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def is_rank(pid: int) -> bool:
    try:
        return b"pagemesh.workers.engine.rank" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp-mesh")
    flags = ("--mixed", "1", "-tp", "3", "--dtype", "float32", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    flags += ("--worker-return-wait", "0")  # the killed worker's stream fails at once (nobody restarts it)
    with SeparateProcesses(str(run_dir), *flags) as procs:
        yield procs


@pytest.fixture(scope="module")
def client(mesh):
    return openai_client(mesh)


@pytest.fixture(scope="module")
def engine(single_rank_engine):
    """The single-rank engine (conftest.py) the mesh's output is checked against."""
    return single_rank_engine


@pytest.fixture(scope="module")
def offline(engine):
    """What a single-rank engine produces for the same prompts (fp32, greedy)."""
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    return greedy_texts(engine, PROMPTS, MAX_TOKENS), greedy_texts(engine, chats, MAX_TOKENS)


def stream_text(stream, chat: bool) -> str:
    parts = []
    for chunk in stream:
        for choice in chunk.choices:
            parts.append((choice.delta.content or "") if chat else choice.text)
    return "".join(parts)


def test_the_worker_runs_three_ranks(mesh):
    ranks = [pid for pid in children(mesh.children["mixed-0"].pid) if is_rank(pid)]
    assert len(ranks) == 2  # ranks 1 and 2; rank 0 is the worker process itself
    with urllib.request.urlopen(mesh.url + "/status", timeout=HANG_S) as response:  # the status page's figures
        workers = {w["id"]: w for w in json.load(response)["workers"]}
    assert workers["mixed-0"]["ranks"] == 3


def test_greedy_text_equals_the_single_rank_engine(client, offline):
    completions, chats = offline
    for prompt, expected in zip(PROMPTS, completions):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, n=2)
        assert [c.text for c in r.choices] == [expected, expected]
        s = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        assert stream_text(s, chat=False) == expected
    for content, expected in zip(CHATS, chats):
        messages = [{"role": "user", "content": content}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.content == expected
        s = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert stream_text(s, chat=True) == expected


def token_ids_of(hf_tokenizer, token_bytes: list[bytes]) -> list[int]:
    """The ids of tokens given as their bytes (what a logprobs entry names): SmolLM2's vocabulary
    is byte-level BPE, one string per byte sequence, so the mapping is exact; a token whose bytes
    are not one vocabulary entry raises KeyError."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars, vocab = bytes_to_unicode(), hf_tokenizer.get_vocab()
    return [vocab["".join(chars[b] for b in token)] for token in token_bytes]


def test_the_greedy_tokens_served_are_hf_transformers(client, engine, hf_model, hf_tokenizer):
    """The tokens the TP mesh sends (read from their logprobs entries) are HF's greedy choice
    after the prompt and each prefix of them: one teacher-forced pass per answer."""
    tok = engine.tokenizer
    prompt = tok.encode(PROMPTS[1])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    served = token_ids_of(hf_tokenizer, [t.encode() for t in r.choices[0].logprobs.tokens])
    assert len(served) == r.usage.completion_tokens > 1 and tok.decode(served) == r.choices[0].text
    assert served == hf_argmax_after_each(hf_model, prompt, served)

    messages = [{"role": "user", "content": CHATS[0]}]
    prompt = tok.encode_chat(messages)
    assert prompt == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True
    )
    served = token_ids_of(hf_tokenizer, [bytes(t.bytes) for t in r.choices[0].logprobs.content])
    assert len(served) == r.usage.completion_tokens > 1 and tok.decode(served) == r.choices[0].message.content
    assert served == hf_argmax_after_each(hf_model, prompt, served)


def test_beam_search_gives_the_single_rank_engines_beams(client, engine):
    beams = dict(n=2, best_of=3, max_tokens=BEAM_TOKENS)
    [want] = engine.generate([engine.tokenizer.encode(PROMPTS[0])], SamplingParams(use_beam_search=True, **beams))
    assert len(set(want.texts)) == 2  # two different beams, the best first
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], extra_body={"use_beam_search": True}, **beams)
    assert [c.text for c in r.choices] == want.texts


def test_a_killed_rank_takes_its_worker_down_and_its_stream_ends_with_an_error(mesh, client):
    # last in the module: it ends the mesh's only worker
    worker = mesh.children["mixed-0"]
    ranks = [pid for pid in children(worker.pid) if is_rank(pid)]
    request = dict(
        model=MODEL, prompt="Count on and on:", max_tokens=400, temperature=0, extra_body={"ignore_eos": True}
    )
    received = [0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_counting, client, received, 0, **request)
        assert sample_until(lambda: received[0], lambda n: n >= 2)  # tokens flow
        os.kill(ranks[-1], 9)
        killed_at = time.monotonic()
        chunks, error, ended_at = stream.result(timeout=HANG_S)
    assert isinstance(error, openai.APIError), error  # the OpenAI error event, not a hang
    assert "worker" in str(error).lower()
    assert chunks < 400
    assert ended_at - killed_at < HEARTBEAT_TIMEOUT_S + LATE_S
    assert worker.wait(timeout=HANG_S) == 1  # the worker went down as a whole
    assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() and is_rank(pid) for pid in ranks))


@pytest.fixture(scope="module")
def pp_mesh(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("pp-mesh"))
    with SeparateProcesses(run_dir, "--mixed", "1", "-pp", "2", "--dtype", "float32") as procs:
        yield procs


def test_two_pipeline_stages_give_the_single_rank_engines_greedy_text(pp_mesh, offline):
    ranks = [pid for pid in children(pp_mesh.children["mixed-0"].pid) if is_rank(pid)]
    assert len(ranks) == 1  # stage 1; stage 0 is the worker process itself
    client = openai_client(pp_mesh)
    completions, chats = offline
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.text for c in r.choices] == [completions[0], completions[0]]
    messages = [{"role": "user", "content": CHATS[0]}]
    s = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert stream_text(s, chat=True) == chats[0]
