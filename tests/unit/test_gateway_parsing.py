"""OpenAI request bodies -> ParsedRequest, and every refusal's exact status, type and param."""

from __future__ import annotations

import pytest

from pagemesh.common.messages import GenerateRequest
from pagemesh.common.sampling import MAX_TOKENS_LIMIT, SamplingParams
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.parsing import check_model, parse_chat, parse_completion, parse_json

CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "Hello", **fields}


def chat(**fields) -> dict:
    return {"model": "m", "messages": CHAT, **fields}


def refusal(parse, body) -> tuple:
    with pytest.raises(ApiError) as info:
        parse(body)
    e = info.value
    return e.status, e.type, e.param


# ---- accepted


def test_minimal_completion_defaults():
    p = parse_completion({"prompt": "Hello"})
    assert (p.kind, p.model, p.prompts, p.messages) == ("completion", None, (("Hello", None),), None)
    assert p.sampling == SamplingParams(max_tokens=16)
    assert (p.stream, p.include_usage, p.logprobs, p.include_stop_str_in_output) == (False, False, None, False)


def test_every_sampling_field_is_read():
    p = parse_completion(
        completion(
            n=2,
            temperature=0,
            top_p=0.5,
            top_k=3,
            min_p=0.1,
            seed=42,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            max_tokens=7,
            min_tokens=2,
            stop_token_ids=[5, 6],
            stop=["a", "b"],
            ignore_eos=True,
            logprobs=3,
            user="an end user's id",
            include_stop_str_in_output=True,
            stream=True,
            stream_options={"include_usage": True},
            best_of=2,
        )
    )
    assert p.sampling == SamplingParams(
        n=2,
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        min_p=0.1,
        seed=42,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        max_tokens=7,
        min_tokens=2,
        stop_token_ids=(5, 6),
        stop=("a", "b"),
        ignore_eos=True,
        logprobs=3,
        best_of=2,
    )
    assert (p.stream, p.include_usage, p.logprobs, p.include_stop_str_in_output) == (True, True, 3, True)


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("x", (("x", None),)),
        (["x"], (("x", None),)),
        ([1, 2, 3], ((None, [1, 2, 3]),)),
        ([[1, 2, 3]], ((None, [1, 2, 3]),)),
        ("", (("", None),)),  # empty prompts are the tokenizer's to refuse (it knows whether BOS is added)
        (["a", "b"], (("a", None), ("b", None))),
        ([[1, 2], "b", [3]], ((None, [1, 2]), ("b", None), (None, [3]))),
    ],
)
def test_prompt_forms(prompt, prompts):
    assert parse_completion(completion(prompt=prompt)).prompts == prompts


def test_echo_asks_for_the_prompt_logprobs_when_logprobs_are_on():
    assert (
        parse_completion(completion(echo=True)).echo,
        parse_completion(completion(echo=True)).sampling.prompt_logprobs,
    ) == (True, None)
    p = parse_completion(completion(echo=True, logprobs=2))
    assert (p.echo, p.sampling.logprobs, p.sampling.prompt_logprobs) == (True, 2, 2)
    assert parse_completion(completion(logprobs=2)).sampling.prompt_logprobs is None


def test_a_batch_of_prompts_becomes_one_request_per_prompt():
    p = parse_completion(completion(prompt=["a", [7, 8]], n=2))
    requests = p.to_generate_requests("cmpl-1", "served", "ipc:///r", 12.5)
    assert [(r.request_id, r.prompt_text, r.prompt_token_ids, r.sampling.n) for r in requests] == [
        ("cmpl-1-0", "a", None, 2),
        ("cmpl-1-1", None, [7, 8], 2),
    ]
    [single] = parse_completion(completion(prompt=["a"])).to_generate_requests("cmpl-1", "served", "ipc:///r", 12.5)
    assert single.request_id == "cmpl-1"


def test_single_string_stop_and_nulls_mean_defaults():
    p = parse_completion(completion(stop="\n", temperature=None, n=None, max_tokens=None, logprobs=None))
    assert p.sampling == SamplingParams(stop=("\n",), max_tokens=16)


def test_chat_defaults_to_the_context_and_reads_max_completion_tokens_first():
    assert parse_chat(chat()).sampling.max_tokens is None  # what the context leaves: the tokenizer resolves it
    assert parse_chat(chat(max_tokens=5)).sampling.max_tokens == 5
    assert parse_chat(chat(max_tokens=5, max_completion_tokens=9)).sampling.max_tokens == 9


def test_chat_content_parts_are_joined_and_extra_keys_dropped():
    p = parse_chat(
        chat(
            messages=[
                {"role": "system", "content": "be brief", "name": "boss", "extra": 1},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        )
    )
    assert p.messages == [
        {"role": "system", "content": "be brief", "name": "boss"},
        {"role": "user", "content": "a\nb"},
    ]


@pytest.mark.parametrize(
    "fields, logprobs",
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
    ],
)
def test_chat_logprobs(fields, logprobs):
    p = parse_chat(chat(**fields))
    assert p.logprobs == p.sampling.logprobs == logprobs


def test_response_format_text_json_object_and_json_schema():
    assert not parse_chat(chat(response_format={"type": "text"})).sampling.constrained
    assert parse_chat(chat(response_format={"type": "json_object"})).sampling.json_object is True
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
    sampling = parse_chat(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    ).sampling
    assert (
        sampling.json_schema
        == '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}},"required":["a"]}'
    )
    # whether a schema compiles is the app's check (llguidance): tests/unit/test_gateway_structured_outputs.py


def test_to_generate_requests():
    p = parse_chat(chat(stream=True, include_stop_str_in_output=True))
    assert p.to_generate_requests("cmpl-1", "served", "ipc:///r", 12.5) == [
        GenerateRequest(
            request_id="cmpl-1",
            model="served",
            prompt_text=None,
            prompt_token_ids=None,
            messages=CHAT,
            sampling=p.sampling,
            stream=True,
            reply_to="ipc:///r",
            arrival_time=12.5,
            include_stop_str_in_output=True,
        )
    ]


# ---- refused


BAD_COMPLETIONS = [
    (completion(prompt=None), "prompt"),
    ({"model": "m"}, "prompt"),
    (completion(prompt=5), "prompt"),
    (completion(prompt=[]), "prompt"),
    (completion(prompt=["a"] * 257), "prompt"),
    (completion(prompt=["a", 5]), "prompt[1]"),
    (completion(prompt=[[1], []]), "prompt[1]"),
    (completion(prompt=[[1], [-2]]), "prompt[1]"),
    (completion(prompt=[1, "a"]), "prompt[0]"),
    (completion(prompt=[1, -1]), "prompt"),
    (completion(prompt=[1, True]), "prompt"),
    (completion(prompt=[1, 2.0]), "prompt"),
    (completion(prompt=[1 << 31]), "prompt"),
    (completion(n=0), "n"),
    (completion(n=17), "n"),
    (completion(n=True), "n"),
    (completion(n=2.0), "n"),
    (completion(temperature="hot"), "temperature"),
    (completion(temperature=-1), "temperature"),
    (completion(temperature=10**400), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(top_k=0), "top_k"),
    (completion(min_p=2), "min_p"),
    (completion(seed=-1), "seed"),
    (completion(seed=1 << 70), "seed"),
    (completion(presence_penalty=3), "presence_penalty"),
    (completion(frequency_penalty=-3), "frequency_penalty"),
    (completion(repetition_penalty=0), "repetition_penalty"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(max_tokens=MAX_TOKENS_LIMIT + 1), "max_tokens"),
    (completion(max_tokens="5"), "max_tokens"),
    (completion(min_tokens=20, max_tokens=10), "min_tokens"),
    (completion(stop=["x"] * 17), "stop"),
    (completion(stop=[""]), "stop"),
    (completion(stop=["x" * 257]), "stop"),
    (completion(stop=[1]), "stop"),
    (completion(stop={"a": 1}), "stop"),
    (completion(stop_token_ids=[1] * 17), "stop_token_ids"),
    (completion(stop_token_ids=[-1]), "stop_token_ids"),
    (completion(logprobs=21), "logprobs"),
    (completion(logprobs=True), "logprobs"),
    (completion(ignore_eos="yes"), "ignore_eos"),
    (completion(stream="yes"), "stream"),
    (completion(stream_options={"include_usage": True}), "stream_options"),
    (completion(stream=True, stream_options=[]), "stream_options"),
    (completion(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
    (completion(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (completion(model=5), "model"),
    (completion(echo="yes"), "echo"),
    (completion(suffix="x"), "suffix"),
    (completion(best_of=3, stream=True), "stream"),
    (completion(use_beam_search=True, logprobs=2), "logprobs"),
    (completion(best_of=1, n=2), "best_of"),
    (completion(priority=1.5), "priority"),
    (completion(logit_bias={"x": 5}), "logit_bias"),
    (completion(logit_bias={"-1": 5}), "logit_bias"),
    (completion(logit_bias={"1.0": 5}), "logit_bias"),
    (completion(logit_bias={"99999999999": 5}), "logit_bias"),
    (completion(logit_bias={"7": 1, "07": 2}), "logit_bias"),
    (completion(logit_bias={"1": "5"}), "logit_bias"),
    (completion(logit_bias={"1": 101}), "logit_bias"),
    (completion(logit_bias={"1": 10**400}), "logit_bias"),
    (completion(logit_bias={"1": True}), "logit_bias"),
    (completion(logit_bias=[[1, 5]]), "logit_bias"),
    (completion(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
]


def test_logit_bias_maps_token_ids_to_biases():
    assert parse_completion(completion(logit_bias={"5": -100, "17": 2.5})).sampling.logit_bias == (
        (5, -100.0),
        (17, 2.5),
    )
    assert parse_chat(chat(logit_bias={"0": 100})).sampling.logit_bias == ((0, 100.0),)
    assert parse_chat(chat(logit_bias={})).sampling.logit_bias == ()


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_fields_are_400_naming_the_field(body, param):
    assert refusal(parse_completion, body) == (400, "invalid_request_error", param)


BAD_CHATS = [
    ({"model": "m"}, "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[CHAT[0]] * 4097), "messages"),
    (chat(messages=["hi"]), "messages[0]"),
    (chat(messages=[{"content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": 1, "content": "x"}]), "messages[0].role"),
    (chat(messages=[CHAT[0], {"role": "user"}]), "messages[1].content"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0].image_url",
    ),
    (chat(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]), "messages[0].content"),
    (chat(logprobs=1), "logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_completion_tokens=10, min_tokens=11), "min_tokens"),
    (chat(tools=[{"type": "function"}]), "tools[0].function"),
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (chat(response_format={"type": "yaml"}), "response_format"),
    (chat(response_format="json"), "response_format"),
    (chat(response_format={"type": "json_object"}, use_beam_search=True, n=2), "response_format"),
]


@pytest.mark.parametrize("body, param", BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_fields_are_400_naming_the_field(body, param):
    assert refusal(parse_chat, body) == (400, "invalid_request_error", param)


def test_error_message_starts_with_the_field():
    with pytest.raises(ApiError) as info:
        parse_chat(chat(max_completion_tokens=10, min_tokens=11))
    assert info.value.message == "min_tokens: must be in [0, max_tokens]"
    with pytest.raises(ApiError) as info:
        parse_chat(chat(logprobs=True, top_logprobs=21))
    assert info.value.message == "top_logprobs: must be in [0, 20]"
    with pytest.raises(ApiError) as info:
        parse_completion(completion(prompt=["a", 5]))
    assert info.value.message == "prompt[1]: must be a string or a non-empty list of token ids"


@pytest.mark.parametrize(
    "raw", [b"{", b"[1]", b"null", b'{"a": NaN}', b'{"a": Infinity}', b"\xff", b"", b"[" * 200_000]
)
def test_malformed_json_is_400(raw):
    with pytest.raises(ApiError) as info:
        parse_json(raw)
    assert (info.value.status, info.value.type, info.value.param) == (400, "invalid_request_error", None)


def test_unknown_model_is_404_model_not_found():
    names = ("SmolLM2", "/models/smol.gguf")
    for name in (None, "SmolLM2", "/models/smol.gguf"):
        check_model(parse_completion(completion(model=name)), names)
    with pytest.raises(ApiError) as info:
        check_model(parse_completion(completion(model="gpt-4")), names)
    assert info.value.body() == {
        "error": {
            "message": "The model `gpt-4` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert info.value.status == 404


def test_beam_search_fields_are_read():
    p = parse_completion(
        completion(n=2, best_of=4, use_beam_search=True, length_penalty=0.5, priority=-3, temperature=0)
    )
    assert (p.sampling.n, p.sampling.best_of, p.sampling.use_beam_search) == (2, 4, True)
    assert (p.sampling.length_penalty, p.sampling.priority) == (0.5, -3)
    assert not p.sampling.streams


def test_random_bodies_are_parsed_or_refused_with_an_api_error_never_a_crash():
    import random

    fields = [
        "prompt",
        "messages",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "logprobs",
        "top_logprobs",
        "best_of",
        "use_beam_search",
        "logit_bias",
        "echo",
        "stream",
        "stream_options",
        "response_format",
        "tools",
        "max_completion_tokens",
        "priority",
    ]
    values = [
        None,
        True,
        False,
        0,
        1,
        -1,
        2**31,
        2**64,
        10**400,
        0.5,
        "",
        "x",
        "0",
        "json_object",
        "json_schema",
        {"type": "object"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
    ]

    def value(rng, depth=0):
        if depth < 2 and rng.random() < 0.2:
            return {
                rng.choice(fields + ["type", "schema", "json_schema", "include_usage", "7"]): value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))
            }
        if depth < 2 and rng.random() < 0.2:
            return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
        return rng.choice(values)

    rng = random.Random(0)
    for _ in range(3000):
        body = {name: value(rng) for name in rng.sample(fields, rng.randint(0, 6))}
        if rng.random() < 0.5:
            body["prompt"], body["messages"] = rng.choice(["hi", [1, 2], ["a", [3]]]), CHAT
        for parse in (parse_completion, parse_chat):
            try:
                parse(body)
            except ApiError as e:
                assert e.status == 400 and e.message


@pytest.mark.parametrize(
    ("parse", "body", "field", "message"),
    [
        (parse_completion, completion(max_token=5), "max_token", "Unrecognized request argument supplied: max_token"),
        (parse_chat, chat(unknown_extra={"x": 1}), "unknown_extra", "Unrecognized request argument supplied"),
        (parse_chat, chat(structural_tag="{}"), "structural_tag", "structural_tag: not supported"),
        (parse_chat, chat(skip_special_tokens=False), "skip_special_tokens", "not supported by this server"),
        (parse_completion, completion(bad_words=["x"]), "bad_words", "bad_words: not supported"),
        (parse_chat, chat(store=True), "store", "store: not supported"),
    ],
)
def test_no_field_is_silently_ignored(parse, body, field, message):
    with pytest.raises(ApiError, match=message) as info:
        parse(body)
    assert (info.value.status, info.value.param) == (400, field)


def test_a_null_field_means_the_default_and_is_never_refused():
    assert parse_chat(chat(guided_choice=None, max_token=None)).sampling.max_tokens is None
