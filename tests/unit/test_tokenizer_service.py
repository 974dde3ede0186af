"""The tokenizer service's logic (TokenizerCore) with the default model's real tokenizer."""

from __future__ import annotations

import dataclasses

import pytest

from pagemesh.common.messages import (
    AbortRequest,
    GenerateRequest,
    RequestFailed,
    RequestStarted,
    ScheduleRequest,
    TextDelta,
    TokenDelta,
    TokenDeltaBatch,
    TokenLogprob,
)
from pagemesh.common.sampling import SamplingParams
from pagemesh.services.tokenizer.core import TokenizerCore
from pagemesh.tests.default_model import tokenizer as default_tokenizer

TOKENIZER = default_tokenizer()  # one load per session, shared
OUTPUT = "ipc:///tmp/tok-out"
GATEWAY_A, GATEWAY_B = "ipc:///tmp/gw-a", "ipc:///tmp/gw-b"


def request(
    request_id="r1", *, text=None, ids=None, messages=None, reply_to=GATEWAY_A, include_stop=False, **sampling
) -> GenerateRequest:
    if text is None and ids is None and messages is None:
        text = "Hello"
    return GenerateRequest(
        request_id=request_id,
        model="m",
        prompt_text=text,
        prompt_token_ids=ids,
        messages=messages,
        sampling=SamplingParams(**sampling).validate(),
        stream=True,
        reply_to=reply_to,
        arrival_time=1000.0,
        include_stop_str_in_output=include_stop,
    )


def core(max_model_len: int = 64) -> TokenizerCore:
    return TokenizerCore(TOKENIZER, max_model_len, reply_to=OUTPUT)


def tokens(request_id, index, ids, finish=None, logprobs=None) -> TokenDelta:
    return TokenDelta(
        request_id=request_id,
        index=index,
        token_ids=list(ids),
        logprobs=logprobs,
        finish_reason=finish,
        num_prompt_tokens=0,
    )


def feed(c: TokenizerCore, *deltas: TokenDelta):
    return c.on_tokens(TokenDeltaBatch(worker_id="w0", deltas=list(deltas)))


def ids_of(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


# ---- admission


def test_prompt_text_is_encoded_and_scheduled_with_own_reply_address():
    c = core()
    out = c.admit(request(text="Hello world", max_tokens=5, stop=("x",)))
    assert out == ScheduleRequest(
        request_id="r1",
        prompt_token_ids=TOKENIZER.encode("Hello world"),
        sampling=SamplingParams(max_tokens=5, stop=("x",)),
        reply_to=OUTPUT,
        arrival_time=1000.0,
    )
    assert "r1" in c and len(c) == 1


def test_token_ids_and_messages_are_used_as_given():
    c = core()
    assert c.admit(request("a", ids=[1, 2, 3])).prompt_token_ids == [1, 2, 3]
    messages = [{"role": "user", "content": "hi"}]
    assert c.admit(request("b", messages=messages)).prompt_token_ids == TOKENIZER.encode_chat(messages)


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        (dict(text=""), "prompt", "prompt: the prompt is empty"),
        (dict(ids=[]), "prompt", "prompt: the prompt is empty"),
        (dict(ids=[5, 49152]), "prompt", "prompt: token id 49152 outside vocabulary [0, 49152)"),
        (dict(messages=[]), "messages", "messages: must be a non-empty list of message objects"),
        (
            dict(messages=[{"role": "", "content": "x"}]),
            "messages[0].role",
            "messages[0].role: required, must be a non-empty string",
        ),
        (
            dict(stop_token_ids=(2, 49152)),
            "stop_token_ids",
            "stop_token_ids: token id 49152 outside vocabulary [0, 49152)",
        ),
        (dict(logit_bias=((49153, 1.0),)), "logit_bias", "logit_bias: token id 49153 outside vocabulary [0, 49152)"),
    ],
)
def test_bad_prompts_fail_with_400_naming_the_field(kwargs, param, message):
    c = core()
    assert c.admit(request(**kwargs)) == RequestFailed(
        request_id="r1", status=400, error_type="invalid_request_error", message=message, param=param, code=None
    )
    assert len(c) == 0


def test_context_length_exceeded_message_for_prompt_and_messages():
    c = core(max_model_len=10)
    assert c.admit(request(ids=[1] * 5, max_tokens=6)) == RequestFailed(
        request_id="r1",
        status=400,
        error_type="invalid_request_error",
        message="This model's maximum context length is 10 tokens. However, you requested 11 tokens "
        "(5 in the prompt, 6 in the completion). Please reduce the length of the prompt or completion.",
        param="prompt",
        code="context_length_exceeded",
    )
    chat = [{"role": "user", "content": "hi"}]
    n = len(TOKENIZER.encode_chat(chat))
    failed = c.admit(request(messages=chat, max_tokens=None))
    assert (failed.status, failed.param, failed.code) == (400, "messages", "context_length_exceeded")
    assert failed.message == (
        f"This model's maximum context length is 10 tokens. However, your messages "
        f"resulted in {n} tokens. Please reduce the length of the messages."
    )
    assert len(c) == 0


def test_exactly_full_context_is_accepted():
    assert isinstance(core(max_model_len=10).admit(request(ids=[1] * 5, max_tokens=5)), ScheduleRequest)


def test_max_tokens_from_context_becomes_the_room_left():
    out = core(max_model_len=10).admit(request(ids=[1] * 4, max_tokens=None, min_tokens=8))
    assert (out.sampling.max_tokens, out.sampling.min_tokens) == (6, 6)


def test_duplicate_request_id_is_refused_and_the_first_kept():
    c = core()
    c.admit(request())
    assert c.admit(request()).message == "request_id: already in progress"
    assert len(c) == 1


# ---- tokens -> text


def test_text_streams_and_finish_flushes():
    c = core()
    c.admit(request(text="Hi"))
    ids = ids_of(" Hello there")
    out = feed(c, tokens("r1", 0, ids[:1]))
    assert out.aborts == []
    assert out.batches[GATEWAY_A].deltas == [
        TextDelta(
            request_id="r1",
            index=0,
            text=" Hello",
            token_ids=ids[:1],
            logprobs=None,
            finish_reason=None,
            prompt_tokens=1,
            completion_tokens=1,
        )
    ]
    out = feed(c, tokens("r1", 0, ids[1:], finish="length"))
    assert out.batches[GATEWAY_A].deltas == [
        TextDelta(
            request_id="r1",
            index=0,
            text=" there",
            token_ids=ids[1:],
            logprobs=None,
            finish_reason="length",
            prompt_tokens=1,
            completion_tokens=len(ids),
        )
    ]
    assert out.aborts == [] and len(c) == 0


def test_stop_string_across_deltas_cuts_text_and_aborts_the_request():
    c = core()
    c.admit(request(text="Hi", stop=("world",), max_tokens=50))
    ids = ids_of(" Hello world and more")  # " Hello", " world", ...
    texts, finishes = [], []
    for token in ids:
        out = feed(c, tokens("r1", 0, [token]))
        texts += [d.text for d in out.batches[GATEWAY_A].deltas]
        finishes += [d.finish_reason for d in out.batches[GATEWAY_A].deltas]
        if out.aborts:
            assert out.aborts == [AbortRequest(request_id="r1", reason="stop string")]
            break
    assert "".join(texts) == " Hello "
    assert finishes[-1] == "stop" and finishes[:-1] == [None] * (len(finishes) - 1)
    assert len(c) == 0
    assert feed(c, tokens("r1", 0, ids[-1:])).batches == {}  # late tokens: ignored


def test_stop_string_split_inside_a_token_is_held_then_released():
    c = core()
    c.admit(request(text="Hi", stop=("world!",), include_stop=True))
    ids = ids_of(" Hello world")
    out = feed(c, tokens("r1", 0, ids))
    held = out.batches[GATEWAY_A].deltas[0]
    assert held.text == " Hello " and held.finish_reason is None  # "world" may start "world!"
    out = feed(c, tokens("r1", 0, [], finish="length"))
    assert out.batches[GATEWAY_A].deltas[0].text == "world"
    assert out.batches[GATEWAY_A].deltas[0].finish_reason == "length"


def test_include_stop_str_in_output_keeps_the_stop_string():
    c = core()
    c.admit(request(text="Hi", stop=("world",), include_stop=True))
    out = feed(c, tokens("r1", 0, ids_of(" Hello world and")))
    assert [(d.text, d.finish_reason) for d in out.batches[GATEWAY_A].deltas] == [(" Hello world", "stop")]


def test_n_choices_finish_separately_and_abort_only_when_all_are_done():
    c = core()
    c.admit(request(text="Hi", n=2, stop=("STOP",), max_tokens=50))
    out = feed(c, tokens("r1", 0, ids_of(" a STOP")), tokens("r1", 1, ids_of(" b")))
    assert [(d.index, d.text, d.finish_reason) for d in out.batches[GATEWAY_A].deltas] == [
        (0, " a ", "stop"),
        (1, " b", None),
    ]
    assert out.aborts == [] and "r1" in c
    out = feed(c, tokens("r1", 0, ids_of(" more")), tokens("r1", 1, ids_of(" c"), finish="length"))
    assert [(d.index, d.text, d.finish_reason, d.completion_tokens) for d in out.batches[GATEWAY_A].deltas] == [
        (1, " c", "length", 2)
    ]
    # choice 0 is still running on the worker: the request is aborted
    assert out.aborts == [AbortRequest(request_id="r1", reason="stop string")] and len(c) == 0


def test_no_abort_when_the_worker_finished_every_choice():
    c = core()
    c.admit(request(text="Hi", n=2, stop=("STOP",)))
    out = feed(c, tokens("r1", 0, ids_of(" a STOP")))
    assert out.aborts == []
    out = feed(c, tokens("r1", 0, [2], finish="stop"), tokens("r1", 1, ids_of(" b"), finish="length"))
    assert [d.index for d in out.batches[GATEWAY_A].deltas] == [1]
    assert out.aborts == [] and len(c) == 0


def test_one_batch_per_gateway_and_unknown_deltas_go_to_no_gateway():
    c = core()
    c.admit(request("a", reply_to=GATEWAY_A))
    c.admit(request("b", reply_to=GATEWAY_B))
    c.admit(request("c", reply_to=GATEWAY_A))
    x = ids_of(" x")
    out = feed(
        c,
        tokens("a", 0, x),
        tokens("ghost", 0, x),
        tokens("b", 0, x),
        tokens("c", 0, x),
        tokens("a", 5, x),
        tokens("b", 0, x),
    )
    assert {gw: [(d.request_id, d.completion_tokens) for d in batch.deltas] for gw, batch in out.batches.items()} == {
        GATEWAY_A: [("a", 1), ("c", 1)],
        GATEWAY_B: [("b", 1), ("b", 2)],
    }
    assert out.aborts == [AbortRequest(request_id="ghost", reason="unknown to the tokenizer", worker_id="w0")]


def test_a_worker_generating_an_unknown_request_is_told_to_stop_it_once_a_second():
    c = core()
    x = ids_of(" x")
    orphan = lambda now: c.on_tokens(TokenDeltaBatch(worker_id="d1", deltas=[tokens("lost", 0, x)]), now).aborts  # noqa: E731
    assert orphan(100.0) == [AbortRequest(request_id="lost", reason="unknown to the tokenizer", worker_id="d1")]
    assert orphan(100.5) == []  # its next tokens, before the abort can have reached the worker
    assert orphan(101.2) == [
        AbortRequest(request_id="lost", reason="unknown to the tokenizer", worker_id="d1")
    ]  # that abort was lost
    finished = c.on_tokens(TokenDeltaBatch(worker_id="d1", deltas=[tokens("done", 0, x, finish="abort")]), 200.0)
    assert finished.aborts == [] and finished.batches == {}  # the worker has already stopped it
    started = c.on_tokens(
        TokenDeltaBatch(worker_id="d1", deltas=[], started=[RequestStarted(request_id="new", num_prompt_tokens=3)]),
        300.0,
    )
    assert started.aborts == [AbortRequest(request_id="new", reason="unknown to the tokenizer", worker_id="d1")]


def test_after_a_scheduler_restart_the_requests_no_worker_holds_are_sent_again():
    c = core()
    scheduled = {rid: c.admit(request(rid, reply_to=GATEWAY_B)) for rid in ("streaming", "silent", "queued")}
    feed(c, tokens("streaming", 0, ids_of(" x")))
    started = RequestStarted(request_id="silent", num_prompt_tokens=4)  # a worker took it (best_of: no output yet)
    marker = c.on_tokens(TokenDeltaBatch(worker_id="w0", deltas=[], started=[started]))
    assert marker.batches == {} and marker.aborts == []
    assert c.unstarted() == [scheduled["queued"]]
    assert "queued" in c and "streaming" in c and "silent" in c  # nothing is failed


def test_prompt_logprobs_pass_through_with_the_prompt_ids_once():
    c = core()
    c.admit(request(ids=[1, 2, 3], logprobs=0, prompt_logprobs=0))
    lps = [
        TokenLogprob(token_id=2, logprob=-1.0, top_ids=[], top_logprobs=[]),
        TokenLogprob(token_id=3, logprob=-2.0, top_ids=[], top_logprobs=[]),
    ]
    first = TokenDelta(
        request_id="r1",
        index=0,
        token_ids=[5],
        logprobs=None,
        finish_reason=None,
        num_prompt_tokens=3,
        queue_time_s=None,
        prompt_logprobs=lps,
    )
    delta = c.on_tokens(TokenDeltaBatch(worker_id="w0", deltas=[first])).batches[GATEWAY_A].deltas[0]
    assert (delta.prompt_token_ids, delta.prompt_logprobs) == ([1, 2, 3], lps)
    later = feed(c, tokens("r1", 0, [6])).batches[GATEWAY_A].deltas[0]
    assert (later.prompt_token_ids, later.prompt_logprobs) == (None, None)


def test_logprobs_and_counts_pass_through():
    c = core()
    c.admit(request(ids=[1, 2, 3], logprobs=1))
    lp = [
        TokenLogprob(token_id=5, logprob=-0.5, top_ids=[5], top_logprobs=[-0.5]),
        TokenLogprob(token_id=6, logprob=-1.5, top_ids=[7], top_logprobs=[-0.25]),
    ]
    delta = feed(c, tokens("r1", 0, [5, 6], logprobs=lp)).batches[GATEWAY_A].deltas[0]
    assert (delta.logprobs, delta.prompt_tokens, delta.completion_tokens, delta.token_ids) == (lp, 3, 2, [5, 6])


def test_failure_and_abort_drop_the_state():
    c = core()
    c.admit(request("a", reply_to=GATEWAY_B))
    c.admit(request("b"))
    failed = RequestFailed(
        request_id="a",
        status=503,
        error_type="service_unavailable",
        message="no capacity",
        param=None,
        code="no_capacity",
    )
    assert c.on_failed(failed) == GATEWAY_B and c.on_failed(failed) is None
    assert c.on_abort("b") is True and c.on_abort("b") is False
    assert len(c) == 0


def test_sampling_is_forwarded_unchanged():
    sampling = dict(
        n=3, temperature=0.5, top_p=0.9, top_k=4, seed=7, max_tokens=9, stop_token_ids=(4,), ignore_eos=True, logprobs=2
    )
    out = core().admit(request(ids=[1], **sampling))
    assert out.sampling == dataclasses.replace(SamplingParams(), **sampling)
