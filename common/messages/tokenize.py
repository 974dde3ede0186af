"""The tokenize channel: calls from a gateway that the tokenizer answers at once, with no worker.

    gateway ──TokenizeRequest──▶ tokenizer ──TokenizeResult / RequestFailed──▶ gateway (reply_to)
    gateway ──DetokenizeRequest─▶ tokenizer ──DetokenizeResult / RequestFailed─▶ gateway (reply_to)

They travel on the gateway's request socket to the tokenizer and come back on its reply stream,
as a generation's text does, so a restarted tokenizer fails them as it fails the rest. A
TokenizeRequest is a small general call, messages or a prompt to token ids: /tokenize answers it,
and any route that needs to count a prompt's tokens may send one.
"""

from __future__ import annotations

from pagemesh.common.messages.base import ProtocolError, check_json_text, message


@message
class TokenizeRequest:
    """Gateway -> tokenizer: the token ids of a prompt, or of chat messages rendered by the
    model's chat template (exactly one of `prompt_text` / `messages` is set).
    `add_special_tokens`: the tokenizer's own BOS in front (on top of what a chat template
    writes itself); `add_generation_prompt`: messages only, the template's assistant header
    at the end; `return_token_strs`: each token's text as well; `tools` and
    `chat_template_kwargs`: rendered as a chat request's are."""

    request_id: str
    reply_to: str
    prompt_text: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: str | None = None  # JSON text: the tools the chat template sees, as a chat request's
    chat_template_kwargs: str | None = None  # JSON text

    def _check(self) -> None:
        if (self.prompt_text is None) == (self.messages is None):
            raise ProtocolError("TokenizeRequest: exactly one of prompt_text, messages must be set")
        if self.messages is None and (self.tools is not None or self.chat_template_kwargs is not None):
            raise ProtocolError("TokenizeRequest: tools and chat_template_kwargs go with messages only")
        check_json_text(self.tools, list, "TokenizeRequest.tools")
        check_json_text(self.chat_template_kwargs, dict, "TokenizeRequest.chat_template_kwargs")


@message
class TokenizeResult:
    """Tokenizer -> gateway: the ids, and the context length they must fit."""

    request_id: str
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs: one per id

    def _check(self) -> None:
        if self.token_strs is not None and len(self.token_strs) != len(self.token_ids):
            raise ProtocolError("TokenizeResult.token_strs: one per token id")


@message
class DetokenizeRequest:
    """Gateway -> tokenizer: the text of token ids (special tokens spelled out, as vLLM does)."""

    request_id: str
    reply_to: str
    token_ids: list[int]


@message
class DetokenizeResult:
    """Tokenizer -> gateway."""

    request_id: str
    text: str
