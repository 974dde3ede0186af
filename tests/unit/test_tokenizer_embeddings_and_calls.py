"""The tokenizer core's embedding requests (admit_embedding, on_embeddings) and its calls
(tokenize, detokenize), with the default model's real tokenizer."""

from __future__ import annotations

import dataclasses

from pagemesh.common.messages import (
    DetokenizeRequest,
    DetokenizeResult,
    Embedding,
    EmbeddingBatch,
    EmbedRequest,
    MigrateRequest,
    Pooling,
    RequestFailed,
    RequestStarted,
    ResumeState,
    ScheduleRequest,
    TokenDeltaBatch,
    TokenizeRequest,
    TokenizeResult,
)
from pagemesh.common.sampling import SamplingParams
from pagemesh.services.tokenizer.core import TokenizerCore
from pagemesh.tests.default_model import tokenizer as default_tokenizer

TOKENIZER = default_tokenizer()
OUTPUT = "ipc:///tmp/tok-out"
GATEWAY_A, GATEWAY_B = "ipc:///tmp/gw-a", "ipc:///tmp/gw-b"
CHAT = [{"role": "user", "content": "Hello there"}]


def core(max_model_len: int = 64) -> TokenizerCore:
    return TokenizerCore(TOKENIZER, max_model_len, reply_to=OUTPUT)


def embed_request(rid="e1", *, text=None, ids=None, reply_to=GATEWAY_A, priority=0, special=True) -> EmbedRequest:
    if text is None and ids is None:
        text = "Hello world"
    return EmbedRequest(
        request_id=rid,
        prompt_text=text,
        prompt_token_ids=ids,
        add_special_tokens=special,
        pooling=Pooling.LAST,
        priority=priority,
        reply_to=reply_to,
        arrival_time=5.0,
    )


def vector(rid: str, tokens: int = 2) -> Embedding:
    return Embedding(request_id=rid, values=[0.6, 0.8], prompt_tokens=tokens)


def test_an_embedding_is_scheduled_with_its_pooling_and_priority_and_no_sampling_to_speak_of():
    c = core()
    out = c.admit_embedding(embed_request(priority=-2))
    assert out == ScheduleRequest(
        request_id="e1",
        prompt_token_ids=TOKENIZER.encode("Hello world"),
        sampling=SamplingParams(temperature=0.0, max_tokens=1, priority=-2),
        reply_to=OUTPUT,
        arrival_time=5.0,
        pooling=Pooling.LAST,
    )
    assert "e1" in c and c.unstarted() == [out]  # a scheduler restart sends it again, as any request


def test_its_vector_is_relayed_to_its_gateway_as_it_came_and_ends_it_there():
    c = core()
    for rid, gateway in (("e1", GATEWAY_A), ("e2", GATEWAY_B), ("e3", GATEWAY_A)):
        c.admit_embedding(embed_request(rid, reply_to=gateway))
    batch = EmbeddingBatch(worker_id="p0", embeddings=[vector("e1"), vector("e2"), vector("e3"), vector("gone")])
    assert c.on_embeddings(batch) == {
        GATEWAY_A: EmbeddingBatch(worker_id="p0", embeddings=[vector("e1"), vector("e3")]),
        GATEWAY_B: EmbeddingBatch(worker_id="p0", embeddings=[vector("e2")]),
    }
    assert len(c) == 0
    assert c.on_embeddings(batch) == {}  # late copies go nowhere


def test_a_started_embedding_is_not_sent_again_and_a_moved_one_is_sent_again_as_it_was():
    c = core()
    first = c.admit_embedding(embed_request())
    c.on_tokens(
        TokenDeltaBatch(worker_id="p0", deltas=[], started=[RequestStarted(request_id="e1", num_prompt_tokens=2)])
    )
    assert c.unstarted() == []
    again = c.on_migrate(MigrateRequest(request_id="e1", reason="worker p0 stopped responding", lost_worker_ids=["p0"]))
    assert again == dataclasses.replace(first, resume=ResumeState(output_token_ids=[], migrations=1))
    assert again.pooling is Pooling.LAST
    # the lost worker's late vector is not the answer; the new worker's is
    assert c.on_embeddings(EmbeddingBatch(worker_id="p0", embeddings=[vector("e1")])) == {}
    assert c.on_embeddings(EmbeddingBatch(worker_id="p1", embeddings=[vector("e1")])) == {
        GATEWAY_A: EmbeddingBatch(worker_id="p1", embeddings=[vector("e1")])
    }


def test_token_ids_are_taken_as_they_are_and_add_special_tokens_is_honoured():
    c = core()
    assert c.admit_embedding(embed_request("e1", ids=[5, 6, 7])).prompt_token_ids == [5, 6, 7]
    assert c.admit_embedding(embed_request("e2", special=False)).prompt_token_ids == TOKENIZER.encode(
        "Hello world", add_special_tokens=False
    )


def refusal(c: TokenizerCore, request: EmbedRequest) -> tuple[int, str | None, str | None, str]:
    out = c.admit_embedding(request)
    assert isinstance(out, RequestFailed) and request.request_id not in c
    return out.status, out.param, out.code, out.message


def test_bad_inputs_are_400s_naming_input():
    c = core(max_model_len=8)
    vocab = TOKENIZER.vocab_size
    status, param, code, message = refusal(c, embed_request(ids=[1, vocab]))
    assert (status, param, code) == (400, "input", None) and str(vocab) in message
    status, param, code, message = refusal(c, embed_request(text="one two three four five six seven eight nine"))
    assert (status, param, code) == (400, "input", "context_length_exceeded")
    assert message.startswith("This model's maximum context length is 8 tokens. However, your input resulted in")
    assert c.admit_embedding(embed_request(ids=list(range(8)))).prompt_token_ids == list(range(8))  # 8 fit


def test_tokenize_a_prompt_and_a_chat_with_vllm_s_defaults():
    c = core(max_model_len=64)
    asked = TokenizeRequest(
        request_id="t", reply_to=GATEWAY_A, prompt_text="Hello world", messages=None, add_special_tokens=True
    )
    ids = TOKENIZER.encode("Hello world")
    assert c.tokenize(asked) == TokenizeResult(request_id="t", token_ids=ids, max_model_len=64)
    chat = TokenizeRequest(
        request_id="t",
        reply_to=GATEWAY_A,
        prompt_text=None,
        messages=CHAT,
        add_special_tokens=False,
        return_token_strs=True,
    )
    result = c.tokenize(chat)
    assert result.token_ids == TOKENIZER.encode_chat(CHAT)
    assert result.token_strs == TOKENIZER.token_strings(result.token_ids) and result.token_strs[-1] == "Ċ"
    bare = TokenizeRequest(
        request_id="t",
        reply_to=GATEWAY_A,
        prompt_text=None,
        messages=CHAT,
        add_special_tokens=False,
        add_generation_prompt=False,
    )
    assert c.tokenize(bare).token_ids == TOKENIZER.encode_chat(CHAT, add_generation_prompt=False)
    assert len(c) == 0  # nothing kept


def test_a_chat_the_template_refuses_is_a_400_naming_the_field():
    bad = TokenizeRequest(
        request_id="t", reply_to=GATEWAY_A, prompt_text=None, messages=[{"role": "user"}], add_special_tokens=False
    )
    out = core().tokenize(bad)
    assert isinstance(out, RequestFailed) and (out.status, out.param) == (400, "messages[0].content")


def test_detokenize_spells_special_tokens_out_and_refuses_ids_outside_the_vocabulary():
    c = core()
    ids = TOKENIZER.encode_chat(CHAT)
    out = c.detokenize(DetokenizeRequest(request_id="d", reply_to=GATEWAY_A, token_ids=ids))
    assert out == DetokenizeResult(request_id="d", text=TOKENIZER.apply_chat_template(CHAT))
    bad = c.detokenize(DetokenizeRequest(request_id="d", reply_to=GATEWAY_A, token_ids=[1, TOKENIZER.vocab_size]))
    assert isinstance(bad, RequestFailed) and (bad.status, bad.param) == (400, "tokens")
    assert bad.message == f"tokens: token id {TOKENIZER.vocab_size} outside vocabulary [0, {TOKENIZER.vocab_size})"
