"""Disaggregation between parallel workers in the real mesh, driven by the official openai client:
`pagemesh up -tp 3 --quantization gguf --kv-cache-dtype fp8_e4m3` (one prefill and one decode
worker of three ranks each, SmolLM2-135M's 3 KV heads one per rank, every rank's linears on its
shard of the GGUF's Q4_1 blocks, its KV pool fp8 with its heads' scales) and `pagemesh up -pp 2`
(dense; two pipeline stages each, layers [0, 15) and [15, 30)). Each rank's KV pages go to the
decode worker's same rank (its heads, its stage's layers; relayed by the two rank-0 processes,
one KVPagesHeader per rank, an fp8 part with its rank's scales); greedy text equals the
single-rank engine's of the same quantization and KV dtype, for a completion with n = 2 and a
streamed chat.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, SeparateProcesses, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.tests.default_model import tokenizer
from pagemesh.tests.integration.conftest import greedy_texts, openai_client
from pagemesh.tests.integration.test_mesh_tensor_parallel import children, is_rank, stream_text

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL_NAME
# longer than a page (16 tokens), so that several pages of every rank travel
PROMPT = "The three primary colours are red, yellow and blue. Mixing two of them gives the secondary colours:"
CHAT = "Name a fruit that is yellow."
MAX_TOKENS = 8
PAGE_SIZE = 16  # pagemesh up's default


def start_mesh(run_dir, *parallel: str):
    """One prefill and one decode worker of the `parallel` flags' shape, fp32."""
    # a small pool: by default each rank takes --kv-cache-memory-bytes (2G) for its KV heads
    flags = ("--prefill", "1", "--decode", "1", *parallel, "--dtype", "float32", "--num-pages", "256")
    with SeparateProcesses(str(run_dir), *flags) as procs:
        yield procs


QUANTIZED = ("--quantization", "gguf", "--kv-cache-dtype", "fp8_e4m3")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    yield from start_mesh(tmp_path_factory.mktemp("tp-disagg-mesh"), "-tp", "3", *QUANTIZED)


@pytest.fixture(scope="module")
def pp_mesh(tmp_path_factory):
    yield from start_mesh(tmp_path_factory.mktemp("pp-disagg-mesh"), "-pp", "2")


@pytest.fixture(scope="module")
def client(mesh):
    return openai_client(mesh)


@pytest.fixture(scope="module")
def offline(single_rank_engine):
    """What a single-rank engine produces (fp32, greedy): the completion's and the chat's text."""
    return greedy_texts(single_rank_engine, [PROMPT, [{"role": "user", "content": CHAT}]], MAX_TOKENS)


def status_workers(mesh) -> dict[str, dict]:
    with urllib.request.urlopen(mesh.url + "/status", timeout=HANG_S) as response:
        return {w["id"]: w for w in json.load(response)["workers"]}


def check_greedy_text_and_handoff(mesh, client, offline, ranks: int) -> None:
    """A completion (n = 2) and a streamed chat equal the single-rank engine's text, through
    workers of `ranks` processes each, and KV bytes crossed between them."""
    completion, chat = offline
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.text for c in r.choices] == [completion, completion]  # both choices' first tokens travel too
    messages = [{"role": "user", "content": CHAT}]
    s = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert stream_text(s, chat=True) == chat

    workers = status_workers(mesh)
    assert {w: workers[w]["ranks"] for w in ("prefill-0", "decode-0")} == {"prefill-0": ranks, "decode-0": ranks}
    for name in ("prefill-0", "decode-0"):  # the followers of each; rank 0 is the worker process
        assert len([pid for pid in children(mesh.children[name].pid) if is_rank(pid)]) == ranks - 1
    # the pages took the handoff (the figures come with each worker's next heartbeat: wait for both)
    assert wait_until(lambda: status_workers(mesh)["decode-0"]["kv"]["bytes_received"] > 0)
    assert wait_until(lambda: status_workers(mesh)["prefill-0"]["kv"]["bytes_sent"] > 0)


@pytest.fixture(scope="module")
def offline_quantized():
    """The single-rank engine's text with the mesh's gguf weights and fp8 KV pool (fp32)."""
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    engine = Engine(EngineConfig(dtype="float32", num_pages=256, quantization="gguf", kv_cache_dtype="fp8_e4m3"))
    return greedy_texts(engine, [PROMPT, [{"role": "user", "content": CHAT}]], MAX_TOKENS)


def test_quantized_fp8_tensor_parallel_prefill_and_decode_give_the_single_rank_engines_text(
    mesh, client, offline_quantized
):
    # (the dense fp32 engine gives these two texts too: what shows the mesh ran quantized and
    # fp8 is below, the ranks' command lines and the bytes that crossed)
    check_greedy_text_and_handoff(mesh, client, offline_quantized, ranks=3)
    for name in ("prefill-0", "decode-0"):
        for pid in [pid for pid in children(mesh.children[name].pid) if is_rank(pid)]:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"--quantization=gguf" in argv and b"--kv-cache-dtype=fp8_e4m3" in argv
    # every rank's part: its KV head's pages of the 30 layers in fp8, one byte a value (fp32: 4)
    tok = tokenizer()
    prompts = [tok.encode(PROMPT), tok.encode_chat([{"role": "user", "content": CHAT}])]
    pages = sum(-(-len(ids) // PAGE_SIZE) for ids in prompts)
    want = pages * 3 * (30 * 2 * PAGE_SIZE * 1 * 64)  # ranks x (layers x K|V x slots x a head x head_dim)
    assert wait_until(lambda: status_workers(mesh)["decode-0"]["kv"]["bytes_received"] == want)
    assert wait_until(lambda: status_workers(mesh)["prefill-0"]["kv"]["bytes_sent"] == want)


def test_greedy_text_through_pipeline_parallel_prefill_and_decode_equals_the_single_rank_engine(pp_mesh, offline):
    # each stage's pages (layers [0, 15) from rank 0, [15, 30) from rank 1) go to the same stage
    check_greedy_text_and_handoff(pp_mesh, openai_client(pp_mesh), offline, ranks=2)


def test_a_prompt_larger_than_the_kv_pool_gets_a_400_naming_it_and_the_mesh_serves_on(pp_mesh, offline):
    # 256 pages of 16 tokens, one of them the null page: 4,080 tokens; the context length is 8,192
    client = openai_client(pp_mesh)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[300] * 4085, max_tokens=1, temperature=0)
    assert "do not fit any worker's KV pool (the largest holds 255 pages of 16 tokens)" in str(refused.value)
    assert refused.value.body["param"] == "prompt"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == offline[0]
