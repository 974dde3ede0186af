"""Schemathesis against a real mesh through the gateway's own OpenAPI document: valid and invalid
requests to every route it describes. Nothing may answer 5xx, every 4xx is in OpenAI's error
shape (Anthropic's under /v1/messages), and the mesh serves a normal request afterwards.

Bounded for CI: one mixed worker with a 64-token context (a generation the fuzzer asks for costs at
most that), and FUZZ_EXAMPLES examples per route (PAGEMESH_FUZZ_EXAMPLES raises it for a longer
run by hand). A diffusion worker serves the embedded digits model, so /v1/images/generations is
fuzzed too.
"""

from __future__ import annotations

import json
import os

import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from pagemesh.bench.local_mesh import HANG_S, running_mesh
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.gateway.openapi import DOCUMENT

pytestmark = pytest.mark.slow
KEY = "sk-fuzz"
FUZZ_EXAMPLES = int(os.environ.get("PAGEMESH_FUZZ_EXAMPLES", "25"))
# a max_tokens the fuzzer picks is capped here, and set where it picks none (chat's default is the
# rest of the context): this tests the doors, not long outputs, and a loaded CPU makes ~2 tokens/s
MAX_FUZZ_TOKENS = 8
IMAGE_MODEL = "digits-dit"  # the embedded image model the mesh's diffusion worker serves
# every route but the transcriptions: this mesh has no audio worker, so a well-formed upload's right
# answer is a 503 (tests/integration/test_mesh_audio.py covers that route, its refusals included)
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT).exclude(path="/v1/audio/transcriptions")
# each generating route's output-length fields (the first is set when the fuzzer gives none)
OUTPUT_LIMITS = {
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/messages": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}


@pytest.fixture(scope="module")
def mesh():
    if os.environ.get("PAGEMESH_FUZZ_URL"):  # fuzz a gateway already running (started with --api-key sk-fuzz)
        yield os.environ["PAGEMESH_FUZZ_URL"]
        return
    # a long heartbeat timeout: on a loaded machine one engine step can outlast the default 5 s
    # and the worker would be judged dead (issue 19) -- that is not what this test is about
    flags = ("--mixed", "1", "--diffusion", "1", "--max-model-len", "64", "--heartbeat-timeout", "600")
    flags += ("--api-key", KEY)
    with running_mesh(*flags) as url:
        yield url


def test_the_served_document_is_the_one_fuzzed(mesh):
    import urllib.request

    with urllib.request.urlopen(mesh + "/openapi.json", timeout=HANG_S) as response:
        assert json.loads(response.read()) == DOCUMENT


@SCHEMA.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,  # the same examples every run: a CI failure is reproducible
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_fuzzed_requests_get_no_5xx_and_openai_shaped_errors(mesh, case):
    body = case.body
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):  # a random name is a 404 before the mesh: name ours
            body["model"] = IMAGE_MODEL if case.path == "/v1/images/generations" else DEFAULT_MODEL_NAME
        limits = OUTPUT_LIMITS.get(case.path, ())
        for field in limits:
            value = body.get(field)
            if type(value) is int and value > MAX_FUZZ_TOKENS:
                body[field] = MAX_FUZZ_TOKENS
        if limits and not any(field in body for field in limits):  # chat's default: the context
            body[limits[0]] = MAX_FUZZ_TOKENS
    print("request:", case.method, case.path, json.dumps(body)[:2000] if isinstance(body, dict) else repr(body)[:500])
    response = case.call(base_url=mesh, headers={"Authorization": f"Bearer {KEY}"}, timeout=HANG_S)
    what = f"{case.method} {case.path} {str(body)[:300]} -> {response.status_code} {response.text[:300]}"
    assert response.status_code < 500, what
    if response.status_code >= 400:
        payload = response.json()
        error = payload["error"]
        if case.path.startswith("/v1/messages"):  # Anthropic's shape
            assert payload["type"] == "error" and set(error) == {"type", "message"}, what
        else:
            assert set(error) == {"message", "type", "param", "code"}, what
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), what


def test_the_mesh_serves_a_normal_request_after_the_fuzzing(mesh):
    client = openai.OpenAI(base_url=mesh + "/v1", api_key=KEY, max_retries=0, timeout=HANG_S)
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=mesh + "/v1", api_key="wrong", max_retries=0).models.list()
