"""Checks of what a request asks for against this engine's model. A library caller's request
(`Engine.add_request`) gets them all: parameters, token ids inside the vocabulary, prompt and
output inside the context length. A mesh's request (`Engine.admit`) was checked at the gateway and
the tokenizer: only what the engine alone knows is checked for it (the KV pool, what is running).
Raises ValueError naming the field."""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from collections.abc import Sequence as Seq

from pagemesh.common.sampling import SamplingParams


class RequestValidator:
    """The limits of one model: `vocab_size`, `max_model_len`, and its tokenizer (None: token
    ids only)."""

    def __init__(
        self, vocab_size: int, max_model_len: int, tokenizer=None, num_pages: int | None = None, page_size: int = 1
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.num_pages = num_pages  # the KV pool (None: unbounded)
        self.page_size = page_size

    def new_request(
        self, request_id: str, prompt: str | Seq[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        """A library caller's request (`Engine.add_request`): its prompt's token ids and its
        parameters (max_tokens None resolved to what the context leaves), once everything about
        it is valid. A mesh's requests were checked by the gateway and the tokenizer instead."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")  # noqa: TRY004 (the field's error)
        params.validate()
        token_ids = self.prompt_ids(prompt)
        vocab = self.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [i for i, _ in params.logit_bias])):
            for t in ids:
                if t >= vocab:
                    raise ValueError(f"{name}: token id {t} outside vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room in the context length {self.max_model_len}"
            )
        if params.max_tokens is None:
            room = self.max_model_len - len(token_ids)
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        elif len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the context length {self.max_model_len}"
            )
        return token_ids, params

    def fit_pool(self, prompt_len: int, params: SamplingParams, prefill_only: bool = False) -> SamplingParams:
        """A request runs alone at worst, so it must fit the KV pool alone, or it would wait (or be
        preempted and recomputed) for ever. The pool is then the request's context: a prompt that
        cannot fit with one more token raises ValueError; a max_tokens beyond the pool is cut to what
        fits (the answer ends with "length", as at the context length). One sequence holds its
        prompt and output; a beam search's beams step side by side, sharing the prompt's whole pages;
        n > 1 sequences are preempted and recomputed one at a time, so each alone must fit. A
        prefill-only request holds its prompt and first token only."""
        if self.num_pages is None:
            return params
        ps, beams = self.page_size, params.num_sequences if params.use_beam_search and not prefill_only else 1
        shared = prompt_len // ps if beams > 1 else 0
        per_beam = (self.num_pages - shared) // beams  # pages each beam may hold beyond the shared ones
        room = (shared + per_beam) * ps - prompt_len  # output tokens that fit
        if room < 1:
            what = f"{beams} beams of " if beams > 1 else ""
            raise ValueError(
                f"prompt: {what}{prompt_len} tokens and one more do not fit this worker's KV pool "
                f"({self.num_pages} pages of {ps} tokens)"
            )
        if prefill_only or params.max_tokens <= room:
            return params
        return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))

    @staticmethod
    def resumable(
        output_token_ids: Seq[int], resumed_choices: Seq[tuple[int, Seq[int]]], params: SamplingParams
    ) -> list[tuple[int, list[int]]]:
        """The sequences a request starts with, as (choice index, tokens generated before, on a
        lost worker; see `Engine.admit`): [(0, output_token_ids)] for a new request or one
        resumed of one choice; a resumed request of several choices (n > 1, streamed: not
        best_of or beams, which start over) gives each unfinished choice's, indices below n."""
        ids = list(output_token_ids)
        if ids and (params.num_sequences != 1 or params.use_beam_search):
            raise ValueError("output_token_ids: a request of several choices resumes by resumed_choices")
        if not resumed_choices:
            return [(0, ids)]
        if ids or not params.streams or params.num_sequences == 1:
            raise ValueError("resumed_choices: only a streamed request of several choices (n > 1) resumes by choice")
        indices = [i for i, _ in resumed_choices]
        if indices != sorted(set(indices)) or not all(0 <= i < params.n for i in indices):
            raise ValueError(f"resumed_choices: distinct choice indices in order, below n ({params.n})")
        for _, tokens in resumed_choices:
            if len(tokens) >= params.max_tokens:
                raise ValueError(f"resumed_choices: {len(tokens)} tokens leave none of max_tokens {params.max_tokens}")
        return [(i, list(tokens)) for i, tokens in resumed_choices]

    def check_output_ids(self, output_token_ids: Seq[int], params: SamplingParams) -> None:
        """A library caller's resumed tokens: inside the vocabulary, and fewer than max_tokens (a
        request with all of them had ended)."""
        ids = list(output_token_ids)
        if ids and len(ids) >= params.max_tokens:
            raise ValueError(f"output_token_ids: {len(ids)} tokens leave none of max_tokens ({params.max_tokens})")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"output_token_ids: token id {t!r} outside vocabulary [0, {self.vocab_size})")

    @staticmethod
    def not_running(request_id: str, running: Container[str]) -> None:
        if request_id in running:
            raise ValueError(f"request_id: {request_id!r} is already running")

    def prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        """The prompt's token ids (text goes through the tokenizer), each inside the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt: token id {t!r} outside vocabulary [0, {vocab})")
        return ids
