"""The gateway's checks of /v1/embeddings, /tokenize and /detokenize bodies, and the embeddings
response (base64 as OpenAI's: little-endian float32 bytes)."""

from __future__ import annotations

import base64
import struct

import pytest

from pagemesh.common.messages import Embedding, EmbedRequest, Pooling
from pagemesh.gateway.embeddings import EmbeddingsCall, embeddings_response, parse_embeddings
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.tokens import parse_detokenize, parse_tokenize


def call(**body) -> EmbeddingsCall:
    return parse_embeddings({"model": "m", **body})


@pytest.mark.parametrize(
    "given, inputs",
    [
        ("hi", (("hi", None),)),
        (["a", "b"], (("a", None), ("b", None))),
        ([1, 2, 3], ((None, [1, 2, 3]),)),
        ([[1, 2], [3]], ((None, [1, 2]), (None, [3]))),
    ],
)
def test_openai_s_four_input_shapes(given, inputs):
    assert call(input=given).inputs == inputs


def test_defaults_and_extras():
    got = call(input="x")
    assert (got.encoding_format, got.dimensions, got.add_special_tokens, got.priority, got.pooling) == (
        "float",
        None,
        True,
        0,
        Pooling.LAST,
    )
    got = call(input="x", encoding_format="base64", add_special_tokens=False, priority=3, pooling="mean", user="u")
    assert (got.encoding_format, got.add_special_tokens, got.priority, got.pooling) == (
        "base64",
        False,
        3,
        Pooling.MEAN,
    )
    assert call(input="x", encoding_format=None, dimensions=None).encoding_format == "float"  # null: the default


def test_a_batch_is_one_request_per_input_in_order():
    requests = call(input=["a", [7, 8]], pooling="mean").requests("embd-1", "gw", 3.0)
    assert [r.request_id for r in requests] == ["embd-1-0", "embd-1-1"]
    assert requests[1] == EmbedRequest(
        request_id="embd-1-1",
        prompt_text=None,
        prompt_token_ids=[7, 8],
        add_special_tokens=True,
        pooling=Pooling.MEAN,
        priority=0,
        reply_to="gw",
        arrival_time=3.0,
    )
    assert [r.request_id for r in call(input="a").requests("embd-2", "gw", 3.0)] == ["embd-2"]


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({}, "input", "input: required"),
        ({"input": ""}, "input", "non-empty"),
        ({"input": []}, "input", "non-empty"),
        ({"input": ["a", ""]}, "input[1]", "non-empty"),
        ({"input": [[1], []]}, "input[1]", "non-empty"),
        ({"input": [[1], [-1]]}, "input[1]", "token ids"),
        ({"input": [1, "a"]}, "input[0]", "non-empty string"),
        ({"input": 5}, "input", "non-empty string or list"),
        ({"input": ["a"] * 2049}, "input", "at most 2048"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "a", "encoding_format": 1}, "encoding_format", "a string"),
        ({"input": "a", "dimensions": 0}, "dimensions", "positive"),
        ({"input": "a", "dimensions": 2.0}, "dimensions", "an integer"),
        ({"input": "a", "pooling": "cls"}, "pooling", "one of ['last', 'mean']"),
        ({"input": "a", "priority": 2**31}, "priority", "32-bit"),
        ({"input": "a", "user": 3}, "user", "a string"),
        ({"input": "a", "normalize": False}, "normalize", "normalize: not supported by this server"),
        ({"input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "not supported"),
        ({"input": "a", "max_tokens": 3}, "max_tokens", "Unrecognized request argument supplied: max_tokens"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(body, param, says):
    with pytest.raises(ApiError) as e:
        parse_embeddings(body)
    assert (e.value.status, e.value.param) == (400, param) and says in e.value.message


def test_the_response_in_openai_s_shape_with_base64_as_little_endian_float32():
    values = [0.5, -0.25, 1 / 3]
    results = [
        Embedding(request_id="a", values=values, prompt_tokens=3),
        Embedding(request_id="b", values=[1.0, 0.0, 0.0], prompt_tokens=4),
    ]
    floats = embeddings_response(call(input=["a", "b"]), "m", results)
    assert floats == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": values},
            {"object": "embedding", "index": 1, "embedding": [1.0, 0.0, 0.0]},
        ],
        "model": "m",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    packed = embeddings_response(call(input=["a", "b"], encoding_format="base64"), "m", results)
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert raw == b"\x00\x00\x00\x3f\x00\x00\x80\xbe" + struct.pack("<f", 1 / 3)
    assert list(struct.unpack("<3f", raw))[:2] == [0.5, -0.25]


def test_tokenize_defaults_follow_vllm():
    prompt = parse_tokenize({"prompt": "hi"})
    assert (prompt.prompt, prompt.messages, prompt.add_special_tokens, prompt.return_token_strs) == (
        "hi",
        None,
        True,
        False,
    )
    chat = parse_tokenize({"model": "m", "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True})
    assert chat.messages == [{"role": "user", "content": "hi"}]
    assert (chat.add_special_tokens, chat.add_generation_prompt, chat.return_token_strs) == (False, True, True)
    request = chat.request("tok-1", "gw")
    assert (request.prompt_text, request.messages, request.add_generation_prompt) == (None, chat.messages, True)
    assert parse_tokenize({"prompt": "", "continue_final_message": False}).prompt == ""


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
        ({"prompt": 1}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "b"}]}, "messages[0].role"),
        ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"messages": [{"role": "user", "content": "b"}], "continue_final_message": True}, "continue_final_message"),
        ({"prompt": "a", "chat_template": "{{ x }}"}, "chat_template"),
        ({"prompt": "a", "max_tokens": 1}, "max_tokens"),
        ({"prompt": "a", "model": 3}, "model"),
    ],
)
def test_bad_tokenize_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_tokenize(body)
    assert (e.value.status, e.value.param) == (400, param)


def test_detokenize_takes_token_ids_only():
    assert parse_detokenize({"model": "m", "tokens": [1, 2]}).tokens == [1, 2]
    assert parse_detokenize({"tokens": []}).tokens == []
    for body, param in (({}, "tokens"), ({"tokens": [1, -1]}, "tokens"), ({"tokens": [1], "prompt": "a"}, "prompt")):
        with pytest.raises(ApiError) as e:
            parse_detokenize(body)
        assert (e.value.status, e.value.param) == (400, param)
