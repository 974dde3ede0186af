"""Response bodies, stream chunks, logprob shapes and SSE framing, as exact dicts and bytes."""

from __future__ import annotations

import dataclasses
import json
import math

from pagemesh.common.messages import RequestFailed, TextDelta, TokenLogprob
from pagemesh.gateway.errors import from_request_failed
from pagemesh.gateway.responses import SSE_DONE, ResponseBuilder, sse_event

TEXTS = {1: "He", 2: "llo", 3: " wor", 4: "ld", 5: "é"}


def builder(kind="completion", n=1, logprobs=None, include_usage=False) -> ResponseBuilder:
    return ResponseBuilder(
        kind=kind,
        request_id="cmpl-abc",
        model="smol",
        created=1700000000,
        n=n,
        logprobs=logprobs,
        include_usage=include_usage,
        token_text=TEXTS.__getitem__,
    )


def delta(text, ids, finish=None, index=0, completion_tokens=None, logprobs=None) -> TextDelta:
    return TextDelta(
        request_id="cmpl-abc",
        index=index,
        text=text,
        token_ids=ids,
        logprobs=logprobs,
        finish_reason=finish,
        prompt_tokens=3,
        completion_tokens=completion_tokens if completion_tokens is not None else len(ids),
    )


def test_completion_response_and_chunks():
    b = builder()
    assert b.first_chunks() == []
    assert b.add(delta("Hello", [1, 2])) == {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 1700000000,
        "model": "smol",
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": None}],
    }
    assert b.add(delta("", [3], completion_tokens=3)) is None  # held text, no logprobs: nothing to send
    assert not b.finished
    assert b.add(delta(" world", [4], "length", completion_tokens=4))["choices"] == [
        {"index": 0, "text": " world", "logprobs": None, "finish_reason": "length"}
    ]
    assert b.finished
    assert b.add(delta("late", [5], completion_tokens=5)) is None
    assert b.response() == {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 1700000000,
        "model": "smol",
        "choices": [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def test_chat_response_and_chunks_with_usage():
    b = builder("chat", n=2, include_usage=True)
    assert b.first_chunks() == [
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "smol",
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
            "usage": None,
        }
        for i in (0, 1)
    ]
    assert b.add(delta("Hi", [1], index=1))["choices"] == [
        {"index": 1, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
    ]
    assert b.add(delta("", [2], "stop", index=1, completion_tokens=2))["choices"] == [
        {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    ]
    b.add(delta("Yo", [3, 4], "length", index=0))
    assert b.usage_chunk() == {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "smol",
        "choices": [],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    assert b.response() == {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "smol",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Yo", "refusal": None},
                "logprobs": None,
                "finish_reason": "length",
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "Hi", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            },
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


LOGPROBS = [
    TokenLogprob(token_id=1, logprob=-0.5, top_ids=[1, 2], top_logprobs=[-0.5, -1.0]),
    TokenLogprob(token_id=5, logprob=-math.inf, top_ids=[], top_logprobs=[]),
]
LOGPROBS_TOP1 = [
    TokenLogprob(token_id=1, logprob=-0.5, top_ids=[1], top_logprobs=[-0.5]),
    TokenLogprob(token_id=5, logprob=-math.inf, top_ids=[1], top_logprobs=[-0.1]),
]


def test_completion_logprobs_shape_with_running_text_offsets():
    b = builder(logprobs=1)
    first = b.add(delta("Heé", [1, 5], logprobs=LOGPROBS_TOP1))
    # top_logprobs: the k most likely, plus the sampled token when it is not among them
    assert first["choices"][0]["logprobs"] == {
        "tokens": ["He", "é"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"He": -0.5}, {"He": -0.1, "é": -9999.0}],
        "text_offset": [0, 2],
    }
    b.add(
        delta(
            "llo",
            [2],
            "stop",
            completion_tokens=3,
            logprobs=[TokenLogprob(token_id=2, logprob=-0.25, top_ids=[], top_logprobs=[])],
        )
    )
    assert b.response()["choices"][0]["logprobs"] == {
        "tokens": ["He", "é", "llo"],
        "token_logprobs": [-0.5, -9999.0, -0.25],
        "top_logprobs": [{"He": -0.5}, {"He": -0.1, "é": -9999.0}, {"llo": -0.25}],
        "text_offset": [0, 2, 3],
    }


def test_chat_logprobs_shape():
    b = builder("chat", logprobs=2)
    chunk = b.add(delta("Heé", [1, 5], "stop", logprobs=LOGPROBS))
    expected = {
        "content": [
            {
                "token": "He",
                "logprob": -0.5,
                "bytes": [72, 101],
                "top_logprobs": [
                    {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
                    {"token": "llo", "logprob": -1.0, "bytes": [108, 108, 111]},
                ],
            },
            {"token": "é", "logprob": -9999.0, "bytes": [195, 169], "top_logprobs": []},
        ]
    }
    assert chunk["choices"][0]["logprobs"] == expected
    assert b.response()["choices"][0]["logprobs"] == expected


def test_held_text_with_logprobs_still_sends_a_chunk():
    b = builder("chat", logprobs=0)
    chunk = b.add(delta("", [1], logprobs=[TokenLogprob(token_id=1, logprob=-0.5, top_ids=[], top_logprobs=[])]))
    assert chunk["choices"][0]["delta"] == {} and chunk["choices"][0]["logprobs"]["content"][0]["token"] == "He"


def test_sse_framing():
    assert sse_event({"a": "é", "b": [1, None]}) == 'data: {"a":"é","b":[1,null]}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_request_failed_becomes_openai_error_with_retry_after_on_503():
    e = from_request_failed(
        RequestFailed(
            request_id="r",
            status=503,
            error_type="service_unavailable",
            message="no capacity",
            param=None,
            code="no_capacity",
        )
    )
    assert (e.status, e.headers) == (503, {"Retry-After": "1"})
    assert json.loads(sse_event(e.body())[6:]) == {
        "error": {"message": "no capacity", "type": "service_unavailable", "param": None, "code": "no_capacity"}
    }
    e = from_request_failed(
        RequestFailed(
            request_id="r",
            status=400,
            error_type="invalid_request_error",
            message="too long",
            param="prompt",
            code="context_length_exceeded",
        )
    )
    assert (e.status, e.headers, e.param, e.code) == (400, {}, "prompt", "context_length_exceeded")


def test_cached_tokens_come_from_each_prompts_first_token_delta():
    """A batch of two prompts (n=2 each): prompt 0 found 16 tokens in a prefix cache, prompt 1
    none. A later delta's count (a disaggregated decode worker's own) does not replace it."""
    b = ResponseBuilder(
        kind="completion",
        request_id="cmpl-abc",
        model="smol",
        created=1,
        n=4,
        logprobs=None,
        include_usage=False,
        token_text=TEXTS.__getitem__,
        choices_per_prompt=2,
    )
    for index, cached in ((0, 16), (1, 16), (2, 0), (3, 0)):
        b.add(dataclasses.replace(delta("He", [1], index=index), cached_tokens=cached))
    b.add(dataclasses.replace(delta("llo", [2], "stop", index=0, completion_tokens=2), cached_tokens=0))
    b.add(dataclasses.replace(delta("llo", [2], "stop", index=2, completion_tokens=2), cached_tokens=32))
    assert b.usage()["prompt_tokens_details"] == {"cached_tokens": 16}
