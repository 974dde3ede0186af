"""No field is silently ignored: every key of a request body is either honoured by the parser of
its route or refused with a 400 that names it.

- A field OpenAI or vLLM defines for the route that pagemesh does not honour: 400
  "`name`: not supported by this server".
- A field nobody defines: 400 "Unrecognized request argument supplied: `name`", as OpenAI answers
  (vLLM logs and ignores it; a typo such as `max_token` would then change nothing without a word).
- A field sent as null means "the default" and is never refused.

Each route lists what it honours; a parser that learns a field adds it to its route's set.
"""

from __future__ import annotations

from pagemesh.gateway.errors import invalid

# OpenAI's fields (chat completions and completions) and vLLM's extras, the ones a client may send
# to these routes. Source: OpenAI's API reference; vLLM's protocol.py (ChatCompletionRequest,
# CompletionRequest), read for their names only.
OPENAI_CHAT = {
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model", "n",
    "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options",
}  # fmt: skip
OPENAI_COMPLETION = {
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n",
    "presence_penalty", "prompt", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user",
}  # fmt: skip
VLLM_EXTRAS = {
    "add_generation_prompt", "add_special_tokens", "allowed_token_ids", "bad_words", "best_of",
    "cache_salt", "chat_template", "chat_template_kwargs", "continue_final_message", "documents",
    "echo", "guided_choice", "guided_decoding_backend", "guided_grammar", "guided_json",
    "guided_regex", "guided_whitespace_pattern", "ignore_eos", "include_stop_str_in_output",
    "kv_transfer_params", "length_penalty", "logits_processors", "min_p", "min_tokens",
    "mm_processor_kwargs", "priority", "prompt_embeds", "prompt_logprobs", "repetition_penalty",
    "request_id", "response_format", "return_token_ids", "return_tokens_as_token_ids",
    "skip_special_tokens", "spaces_between_special_tokens", "stop_token_ids", "structural_tag",
    "structured_outputs", "top_k", "truncate_prompt_tokens", "use_beam_search", "vllm_xargs",
}  # fmt: skip

# What pagemesh's parsers read (gateway/parsing.py). `speculative` is pagemesh's own extra.
_SAMPLING = {
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "min_tokens", "stop_token_ids", "stop", "ignore_eos", "best_of",
    "use_beam_search", "length_penalty", "priority", "logit_bias", "speculative", "max_tokens",
    "model", "stream", "stream_options", "include_stop_str_in_output",
    "user",  # an end user's id, for the client's own bookkeeping: it changes no output
}  # fmt: skip
# structured outputs, on both routes as vLLM takes them (gateway/structured_outputs.py)
_STRUCTURED = {
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend",
}  # fmt: skip
HONOURED_COMPLETION = _SAMPLING | _STRUCTURED | {"prompt", "logprobs", "echo", "suffix"}
HONOURED_CHAT = _SAMPLING | _STRUCTURED | {
    "messages", "logprobs", "top_logprobs", "max_completion_tokens",
    "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",  # gateway/chat_options.py
}  # fmt: skip


def check_fields(body: dict, honoured: set[str], defined: set[str]) -> None:
    """Refuse the first non-null field of `body` outside `honoured` (400, `param` = its name)."""
    for name, value in body.items():
        if value is None or name in honoured:
            continue
        if name in defined:
            raise invalid(f"{name}: not supported by this server", name)
        raise invalid(f"Unrecognized request argument supplied: {name}", name)


def check_completion_fields(body: dict) -> None:
    check_fields(body, HONOURED_COMPLETION, OPENAI_COMPLETION | VLLM_EXTRAS)


def check_chat_fields(body: dict) -> None:
    check_fields(body, HONOURED_CHAT, OPENAI_CHAT | VLLM_EXTRAS)


# /v1/embeddings: OpenAI's fields, and vLLM's extras (EmbeddingCompletionRequest and
# EmbeddingChatRequest); `pooling` is pagemesh's own (gateway/embeddings.py).
OPENAI_EMBEDDING = {"input", "model", "encoding_format", "dimensions", "user"}
VLLM_EMBEDDING_EXTRAS = {
    "add_special_tokens", "additional_data", "add_generation_prompt", "cache_salt", "chat_template",
    "chat_template_kwargs", "continue_final_message", "embed_dtype", "endianness", "messages",
    "mm_processor_kwargs", "normalize", "priority", "request_id", "truncate_prompt_tokens",
}  # fmt: skip
HONOURED_EMBEDDING = OPENAI_EMBEDDING | {"add_special_tokens", "priority", "pooling"}
# /tokenize and /detokenize: vLLM's TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest.
VLLM_TOKENIZE = {
    "model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
    "return_token_strs", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "tools",
}  # fmt: skip
HONOURED_TOKENIZE = {
    "model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs",
    "continue_final_message",  # false only (gateway/tokens.py)
}  # fmt: skip
VLLM_DETOKENIZE = {"model", "tokens"}


def check_embedding_fields(body: dict) -> None:
    check_fields(body, HONOURED_EMBEDDING, OPENAI_EMBEDDING | VLLM_EMBEDDING_EXTRAS)


def check_tokenize_fields(body: dict) -> None:
    check_fields(body, HONOURED_TOKENIZE, VLLM_TOKENIZE)


def check_detokenize_fields(body: dict) -> None:
    check_fields(body, VLLM_DETOKENIZE, VLLM_DETOKENIZE)
