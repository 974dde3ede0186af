"""The whole mesh as processes on loopback, driven by the official openai client."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import zmq

from pagemesh.bench.local_mesh import (
    HANG_S,
    LATE_S,
    metrics,
    pages_free,
    per_worker,
    running_mesh,
    sample_until,
    wait_until,
)
from pagemesh.common.model_files import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME
from pagemesh.common.sampling import SamplingParams
from pagemesh.common.transport import CONTROL, ipc_address
from pagemesh.tests.default_model import tokenizer as default_tokenizer
from pagemesh.tests.rogue_peers import MALFORMED, connect, logged

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL_NAME
PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):",
    "A short poem about the sea:\n",
    "Paged attention stores the KV cache in",
]
CHATS = ["What is 2 + 2?", "Name a fruit that is yellow.", "Write one sentence about rain."]
MAX_TOKENS = 24
WORKERS = {"prefill-0", "decode-0"}  # `pagemesh up`'s default mesh


# the workers speculate (n-gram drafts): every greedy test here also checks it changes no token
SPECULATIVE_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("run"))  # the mesh's ipc sockets: where a rogue connects


@pytest.fixture(scope="module")
def mesh_output():
    return []  # the mesh's log lines, as they come


@pytest.fixture(scope="module")
def mesh(run_dir, mesh_output):
    with running_mesh(
        "--dtype", "float32", "--speculative-config", SPECULATIVE_CONFIG, "--run-dir", run_dir, output=mesh_output
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def engine():
    """An engine alone, as the mesh's workers run it (fp32)."""
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    return Engine(EngineConfig(dtype="float32", num_pages=512))


@pytest.fixture(scope="module")
def offline(engine):
    """What the engine alone produces for the same prompts (fp32, greedy)."""
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    completions = engine.generate([tok.encode(p) for p in PROMPTS], params)
    chats = engine.generate([tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS], params)
    return [r.texts[0] for r in completions], [r.texts[0] for r in chats]


def stream_text(stream, chat: bool) -> str:
    parts = []
    for chunk in stream:
        for choice in chunk.choices:
            parts.append((choice.delta.content or "") if chat else choice.text)
    return "".join(parts)


def test_greedy_completions_and_chats_equal_the_offline_engine(client, offline):
    completions, chats = offline
    for prompt, expected in zip(PROMPTS, completions):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == expected
        assert r.usage.completion_tokens <= MAX_TOKENS
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


def test_a_batch_of_prompts_answers_each_as_alone(client, mesh, offline):
    completions, _ = offline
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in r.choices] == completions
    tokenizer = default_tokenizer()
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    texts, chunks, sent = [""] * len(PROMPTS), [0] * len(PROMPTS), time.monotonic()
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            chunks[choice.index] += bool(choice.text)
    # a decode step of this machine as loaded now, over-estimated (the prefill is in it) so that
    # chunks the client read together never make it short
    step_s = (time.monotonic() - sent) / max(chunks)
    assert texts == completions
    # one prompt too long: a 400 for the batch, and the others are stopped (no page stays used):
    # their pages are free long before the 300 tokens of the first could have been decoded
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(
            model=MODEL,
            prompt=["Count: one, two,", "word " * 9000],
            max_tokens=300,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    refused = time.monotonic()
    assert wait_until(lambda: pages_free(metrics(mesh), WORKERS))
    assert time.monotonic() - refused < 300 * step_s / 4


PARAGRAPH = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He lit the great lamp, "
    "wound the clockwork that turned the lens, and wrote the weather in a leather book. Ships passed "
    "the rocks safely for forty years, and nobody in the village ever learned his name."
)


def test_speculation_changes_no_greedy_text_and_each_worker_counts_its_drafts(client, mesh):
    """Quoting makes the decode worker speculate; the same requests with `"speculative": false`
    give the same text and finish reasons: completions (max_tokens and a stop string met
    mid-draft, n=2), streamed, and chat."""
    prompt = f"Copy this text exactly.\nText: {PARAGRAPH}\nCopy: {PARAGRAPH[:40]}"
    off = {"speculative": False}
    for kw in (
        {"max_tokens": 40},
        {"max_tokens": 9},
        {"max_tokens": 40, "stop": [" forty"]},
        {"max_tokens": 16, "n": 2},
    ):
        want = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body=off, **kw)
        got = client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)
        assert [(c.text, c.finish_reason) for c in got.choices] == [(c.text, c.finish_reason) for c in want.choices]
        if kw.get("n", 1) == 1:
            streamed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, stream=True, **kw)
            assert stream_text(streamed, chat=False) == want.choices[0].text
    assert got.choices[0].text == want.choices[0].text != ""
    stopped = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=[" forty"])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text.endswith("safely for")
    messages = [{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{PARAGRAPH}"}]
    want = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40, extra_body=off)
    got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    assert got.choices[0].message.content == want.choices[0].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40, stream=True)
    assert stream_text(streamed, chat=True) == want.choices[0].message.content

    def counted(samples):
        accepted = per_worker(samples, "pagemesh_spec_decode_accepted_tokens_total")
        drafts = per_worker(samples, "pagemesh_spec_decode_draft_tokens_total")
        return accepted.get("decode-0", 0) > 20 and drafts["decode-0"] >= accepted["decode-0"]

    assert sample_until(lambda: metrics(mesh), counted) is not None


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client, engine):
    """The pattern of evaluation harnesses (lm-eval's loglikelihood): echo, logprobs, 1 token."""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=1, temperature=0, echo=True, logprobs=1)
    [choice] = r.choices
    prompt_ids = engine.tokenizer.encode(PROMPTS[3])
    [alone] = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1))
    assert choice.text == PROMPTS[3] + alone.texts[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [x.logprob for x in alone.prompt_logprobs] + [alone.logprobs[0][0].logprob]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected)) < 1e-3
    assert lp.tokens == [engine.tokenizer.token_text(i) for i in prompt_ids + alone.token_ids[0]]


def test_json_object_and_json_schema_answers_across_the_handoff(client):
    messages = [{"role": "user", "content": "Describe a cat with its name and age."}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=80, temperature=0, response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_object"},
        stream=True,
    )
    assert stream_text(stream, chat=True) == r.choices[0].message.content
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "color": {"enum": ["black", "white", "ginger"]},
        },
        "required": ["name", "age", "color"],
        "additionalProperties": False,  # else any other key may follow, as JSON Schema says
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}},
    )
    cat = json.loads(r.choices[0].message.content)
    assert (
        list(cat) == ["name", "age", "color"]
        and isinstance(cat["age"], int)
        and cat["color"] in schema["properties"]["color"]["enum"]
    )
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):  # what llguidance cannot enforce
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "cat",
                    "schema": {"type": "object", "properties": {"names": {"type": "array", "uniqueItems": True}}},
                },
            },
        )


def test_logit_bias_reaches_the_sampler(client):
    tokenizer = default_tokenizer()
    [sea] = tokenizer.encode(" sea", add_special_tokens=False)
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0.7, seed=1, logit_bias={str(sea): 100}, logprobs=1
    )
    assert r.choices[0].text == " sea" * 4
    assert r.choices[0].logprobs.token_logprobs[0] < -3  # reported as the model gave it: not biased
    unbiased = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    banned = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=1,
        temperature=0,
        logit_bias={str(tokenizer.encode(unbiased.choices[0].text, add_special_tokens=False)[0]): -100},
    )
    assert banned.choices[0].text != unbiased.choices[0].text


def test_sixteen_concurrent_streams_all_complete(client, mesh):
    def one(i: int) -> tuple[str, int]:
        stream = client.completions.create(
            model=MODEL,
            prompt=f"Story number {i}:",
            max_tokens=20,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert [n for _, n in results] == [20] * 16
    assert all(text for text, _ in results)
    assert wait_until(lambda: pages_free(metrics(mesh), WORKERS))


def test_a_dropped_stream_frees_its_pages_everywhere_at_once(client, mesh):
    """At once: in a small part of the time the rest of its 400 tokens would take at the rate it
    was streaming (an idle machine frees them within a second; a loaded one is slower at both,
    and a fixed second failed there)."""
    stream = client.completions.create(
        model=MODEL,
        prompt="Count slowly: one, two,",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    sent = time.monotonic()
    for i, _ in enumerate(stream):
        if i == 5:
            break
    step_s = (time.monotonic() - sent) / 6  # a decode step as loaded now, over-estimated (prefill in it)
    usage = sample_until(  # the pages show in a heartbeat or two (0.25 s each, later on a loaded machine)
        lambda: per_worker(metrics(mesh), "pagemesh_kv_cache_usage_ratio"),
        lambda u: set(u) == WORKERS and max(u.values()) > 0,
        timeout=LATE_S,
    )
    assert usage, "the stream's pages never showed in the workers' KV usage"
    stream.close()
    dropped = time.monotonic()
    assert wait_until(lambda: pages_free(metrics(mesh), WORKERS))
    assert time.monotonic() - dropped < (400 - 6) * step_s / 8


def post(mesh: str, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict, dict]:
    req = urllib.request.Request(mesh + path, data=body, headers={"content-type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=HANG_S) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


@pytest.mark.parametrize(
    "body, status, error_type, param, code",
    [
        (b"{not json", 400, "invalid_request_error", None, None),
        (
            json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode(),
            400,
            "invalid_request_error",
            "temperature",
            None,
        ),
        (json.dumps({"model": MODEL, "prompt": "hi", "n": 1000}).encode(), 400, "invalid_request_error", "n", None),
        (json.dumps({"model": MODEL, "prompt": [1, 2, 10**7]}).encode(), 400, "invalid_request_error", "prompt", None),
        (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "invalid_request_error", "prompt", None),
        (
            json.dumps({"model": MODEL, "prompt": "hi", "logit_bias": {"49152": 5}}).encode(),
            400,
            "invalid_request_error",
            "logit_bias",
            None,
        ),
        (
            json.dumps({"model": MODEL, "prompt": "hi", "stop_token_ids": [49152]}).encode(),
            400,
            "invalid_request_error",
            "stop_token_ids",
            None,
        ),
        (
            json.dumps({"model": MODEL, "prompt": "word " * 9000}).encode(),
            400,
            "invalid_request_error",
            None,
            "context_length_exceeded",
        ),
        (
            json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 10**6}).encode(),
            400,
            "invalid_request_error",
            None,
            None,
        ),
        (
            json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(),
            404,
            "invalid_request_error",
            "model",
            "model_not_found",
        ),
        (json.dumps({"model": MODEL, "prompt": "x" * (5 << 20)}).encode(), 413, "invalid_request_error", None, None),
    ],
)
def test_errors_have_the_openai_shape_and_the_mesh_keeps_serving(mesh, client, body, status, error_type, param, code):
    got_status, _, payload = post(mesh, "/v1/completions", body)
    assert got_status == status
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert "Traceback" not in error["message"]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_models_health_ready(mesh):
    models = json.loads(urllib.request.urlopen(mesh + "/v1/models", timeout=HANG_S).read())
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 8192
    r = openai.OpenAI(base_url=mesh + "/v1", api_key="none", max_retries=0, timeout=HANG_S).completions.create(
        model=DEFAULT_MODEL_ALIAS, prompt="Hi", max_tokens=1
    )  # the short name still works; answers name the real id
    assert r.model == MODEL == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert urllib.request.urlopen(mesh + "/health", timeout=HANG_S).status == 200
    assert urllib.request.urlopen(mesh + "/ready", timeout=HANG_S).status == 200


DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "pagemesh-vllm.json"


def test_every_series_the_vllm_dashboard_queries_is_in_metrics(client, mesh):
    """The series named by the expressions of our Grafana dashboard (vLLM's dashboard queries, plus
    prefix-cache hits) exist in /metrics after a request, labelled with the served model's id."""
    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]
    wanted = {name for expr in exprs for name in re.findall(r"vllm:[A-Za-z0-9_:]+", expr)}
    assert len(wanted) >= 20 and "vllm:e2e_request_latency_seconds_bucket" in wanted
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    samples = sample_until(lambda: metrics(mesh), lambda s: any(k.startswith("vllm:kv_cache_usage_perc") for k in s))
    assert samples is not None
    present = {key.partition("{")[0] for key in samples}
    assert sorted(wanted - present) == []
    for key in samples:
        if key.startswith("vllm:"):
            assert f'model_name="{MODEL}"' in key, key
    assert samples[f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'] >= 1


def test_malformed_messages_from_a_rogue_peer_are_dropped_logged_and_the_mesh_serves_on(client, run_dir, mesh_output):
    """Without keys, anyone who reaches a socket can send to it: malformed msgpack, an unknown type,
    wrong fields, pickle and json to every socket that binds (the scheduler, the tokenizer's two,
    the gateway's replies, the decode worker's KV endpoint), and a frame over the control
    sockets' MAXMSGSIZE to the scheduler. Each malformed message is dropped and logged by its
    process exactly once, the oversize one is never read (libzmq disconnects its sender), and
    every process serves on."""
    dropped = "dropped malformed message"
    targets = [
        ("scheduler", "scheduler", zmq.DEALER),
        ("tokenizer-0", "tokenizer", zmq.DEALER),
        ("tokenizer-0", "tokenizer-out", zmq.PUSH),
        ("gateway-0", "gateway-0", zmq.PUSH),
        ("decode-0", "kv-decode-0", zmq.DEALER),
    ]
    processes = {process for process, _, _ in targets}
    before = {p: logged(mesh_output, p, dropped) for p in processes}
    expected = {p: before[p] + len(MALFORMED) * sum(t[0] == p for t in targets) for p in processes}
    oversize = connect(ipc_address(run_dir, "scheduler"), zmq.DEALER)
    disconnected = oversize.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    rogues = [disconnected, oversize]
    try:
        oversize.send_multipart([b"Ready", bytes(CONTROL.max_msg_bytes + 1)])
        assert disconnected.poll(HANG_S * 1000)  # the scheduler read its size and hung up
        for _, name, kind in targets:
            rogues.append(sock := connect(ipc_address(run_dir, name), kind))
            for frames in MALFORMED.values():
                sock.send_multipart(frames)
        assert wait_until(lambda: all(logged(mesh_output, p, dropped) >= n for p, n in expected.items()))
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3  # through every process, the KV handoff too
        assert {p: logged(mesh_output, p, dropped) for p in processes} == expected  # the oversize one: never
    finally:
        for sock in rogues:
            sock.close()
