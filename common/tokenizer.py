"""Text <-> token ids for a model, its chat template, and streaming detokenization.

A `Tokenizer` is built from either
  * a GGUF file: the vocabulary, merges and token types in its `tokenizer.ggml.*` metadata are
    turned into a `tokenizers` BPE model with the pre-tokenizer named by `tokenizer.ggml.pre`
    (byte-level BPE for `gpt2`, byte-fallback BPE for SentencePiece-style `llama`), or
  * a Hugging Face folder: `tokenizer.json`, plus `tokenizer_config.json` for the special tokens,
    `add_bos_token` and the chat template (`chat_template.jinja` wins when present).
transformers is not needed at runtime; the unit tests use it as the oracle.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from pagemesh.common.chat_template import ChatTemplate, validate_messages
from pagemesh.common.model_files import text_weights_path

# llama.cpp token types (gguf.TokenType).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Special tokens that end an assistant turn in common chat formats; the model stops on any of them.
_END_OF_TURN_TEXTS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(split: str | None = None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    """GPT-2's regex and byte mapping, optionally preceded by a custom split or one-digit split."""
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if digits:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


# GGUF `tokenizer.ggml.pre` -> (pre-tokenizer, ignore_merges), following llama.cpp's grouping.
_BYTE_LEVEL_PRE = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), (_byte_level, False)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (lambda: _byte_level(digits=True), False),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"),
        (lambda: _byte_level(_LLAMA3_SPLIT), True),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (lambda: _byte_level(_QWEN2_SPLIT), False)),
}

# SentencePiece vocabularies that need per-architecture fixes we do not implement.
_UNSUPPORTED_SPM_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "phi3")


class Tokenizer:
    """Encodes and decodes text for one model and renders its chat template.

    Contract: `encode` adds BOS iff `add_bos` and `add_special_tokens`; `decode` of ids outside
    `[0, vocab_size)` raises ValueError; `apply_chat_template` returns the exact string
    transformers' `apply_chat_template(tokenize=False)` would; `eos_token_ids` holds every token
    that ends generation (EOS and the end-of-turn token of the chat format).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int,
        add_bos: bool,
        special_texts: dict[str, str | None],
        stop_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ):
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = bool(add_bos and bos_token_id is not None)
        special = {token.content: index for index, token in backend.get_added_tokens_decoder().items() if token.special}
        self.special_token_ids: frozenset[int] = frozenset(special.values())
        turn_ends = {special[text] for text in _END_OF_TURN_TEXTS if text in special}
        self.eos_token_ids: frozenset[int] = frozenset({eos_token_id, *stop_token_ids, *turn_ends})
        self.chat_template = ChatTemplate(chat_template, special_texts) if chat_template else None
        self.special_texts = {name: text for name, text in special_texts.items() if text is not None}
        # Decoding `anchor + [id]` keeps the leading space SentencePiece decoders strip at the start.
        self._anchor = backend.encode("a", add_special_tokens=False).ids
        self._anchor_text = backend.decode(self._anchor, skip_special_tokens=False)
        self._token_texts: dict[int, str] = {}

    @classmethod
    def from_path(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load from a `.gguf` file or a Hugging Face model folder; `chat_template` (a template's
        text) replaces the model's own."""
        path = text_weights_path(Path(path))  # a multimodal folder over the embedded GGUF: the GGUF's
        if path.is_dir():
            parts = _hf_folder_parts(path)
        elif path.suffix == ".gguf" and path.is_file():
            parts = _gguf_parts(path)
        else:
            raise ValueError(f"model path: {path} is neither a .gguf file nor a model folder")
        return cls(**{**parts, "chat_template": chat_template or parts["chat_template"]})

    def backend_json(self) -> str:
        """The `tokenizers` model as Hugging Face's tokenizer.json text (BOS not included: `encode`
        adds it)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: must be a string, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def check_ids(self, ids: Sequence[int], field: str = "token_ids") -> None:
        """Raise ValueError naming `field` unless every id is an integer in `[0, vocab_size)`."""
        for token_id in ids:
            try:
                value = operator.index(token_id)
            except TypeError:
                raise ValueError(f"{field}: token ids must be integers, got {token_id!r}") from None
            if isinstance(token_id, bool) or not 0 <= value < self.vocab_size:
                raise ValueError(f"{field}: token id {token_id!r} outside vocabulary [0, {self.vocab_size})")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        self.check_ids(ids, "ids")
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text one token contributes (with its leading space; specials spelled out)."""
        text = self._token_texts.get(token_id)
        if text is None:
            self.check_ids([token_id], "token_id")
            joined = self._backend.decode(self._anchor + [token_id], skip_special_tokens=False)
            text = joined[len(self._anchor_text) :]
            self._token_texts[token_id] = text
        return text

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's entry in the vocabulary, as stored (byte-level BPE's `Ġ` for a space, as
        transformers' `convert_ids_to_tokens` gives it); `token_text` is the text it adds."""
        self.check_ids(ids, "ids")
        return [self._backend.id_to_token(int(i)) for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """`tools` and `template_kwargs` reach the template as transformers passes them."""
        if self.chat_template is None:
            validate_messages(messages)
            raise ValueError("messages: this model has no chat template; use a plain prompt")
        return self.chat_template.render(messages, add_generation_prompt, tools, template_kwargs)

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; like transformers, the template writes any BOS itself."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Per-request streaming detokenizer with stop strings.

    Each `add` decodes only a small window of ids: `[prefix_offset, len)` against
    `[prefix_offset, read_offset)`; the difference is the new text. The window moves on once its
    text ends in a complete character, so a half-decoded UTF-8 sequence ("\\ufffd") is never
    emitted while later tokens may complete it.

        ids:  ... | prefix_offset ........ read_offset ......... len(ids)
                    (already emitted, context)   (new, not yet emitted)

    Text that could be the start of a stop string is held back until it can no longer be one.
    """

    # Prompt tokens kept as left context, so the first generated token decodes as it would mid-text.
    _PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ):
        if isinstance(stop, str):
            stop = (stop,)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        self._backend = tokenizer._backend
        self._skip_special = skip_special_tokens
        self._stops = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._window = list(prompt_ids[-self._PROMPT_CONTEXT :]) if len(prompt_ids) else []
        self._read = len(self._window)  # window[:_read] has been emitted (or is prompt)
        self._read_text = self._decode(self._window)
        self._held = ""  # decoded text withheld because it may begin a stop string
        self.text = ""
        self.matched_stop: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, new_ids: Sequence[int]) -> tuple[str, str | None]:
        if self.matched_stop is not None:
            return "", self.matched_stop
        self._window.extend(new_ids)
        full = self._decode(self._window)
        if len(full) <= len(self._read_text) or full.endswith("\ufffd"):
            return "", None  # nothing new yet, or an incomplete character at the end
        delta = full[len(self._read_text) :]
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        return self._release(delta, final=False), self.matched_stop

    def flush(self) -> str:
        """End of stream: emit what was held back, including an incomplete last character."""
        if self.matched_stop is not None:
            return ""
        delta = ""
        if self._read < len(self._window):
            delta = self._decode(self._window)[len(self._read_text) :]
            self._window, self._read, self._read_text = [], 0, ""
        return self._release(delta, final=True)

    def _release(self, delta: str, final: bool) -> str:
        pending = self._held + delta
        self._held = ""
        hit = min(((pending.find(s), -len(s), s) for s in self._stops if s in pending), default=None)
        if hit is not None:
            position, _, stop = hit
            out = pending[: position + len(stop) if self._include_stop else position]
            self.matched_stop = stop
        elif final:
            out = pending
        else:
            keep = self._stop_prefix_length(pending)
            out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


# ---- loading ----------------------------------------------------------------------------------


def _gguf_parts(path: Path) -> dict[str, Any]:
    from pagemesh.common.gguf_file import read_gguf

    meta = read_gguf(path).metadata.get

    kind = meta("tokenizer.ggml.model")
    tokens: list[str] = meta("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path.name}: no tokenizer.ggml.tokens in the GGUF metadata")
    token_types = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges", [])]
    unk_id = meta("tokenizer.ggml.unknown_token_id")
    if kind == "gpt2":
        pre = meta("tokenizer.ggml.pre", "default")
        if pre not in _BYTE_LEVEL_PRE:
            raise ValueError(
                f"{path.name}: tokenizer.ggml.pre {pre!r} is not supported "
                f"(supported: {', '.join(sorted(_BYTE_LEVEL_PRE))}); use an HF folder"
            )
        make_pre, ignore_merges = _BYTE_LEVEL_PRE[pre]
        backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges))
        backend.pre_tokenizer = make_pre()
        backend.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        architecture = meta("general.architecture")
        if architecture in _UNSUPPORTED_SPM_ARCHITECTURES:
            raise ValueError(
                f"{path.name}: the {architecture} SentencePiece vocabulary is not "
                "supported from GGUF; use the model's HF folder"
            )
        if not merges:
            merges = _merges_from_scores(tokens, meta("tokenizer.ggml.scores"))
        backend = Backend(
            models.BPE(
                {t: i for i, t in enumerate(tokens)},
                merges,
                fuse_unk=True,
                byte_fallback=True,
                unk_token=tokens[unk_id] if unk_id is not None else None,
            )
        )
        space_prefix = meta("tokenizer.ggml.add_space_prefix", True)
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if space_prefix else "never", split=False
        )
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
        add_bos_default = True
    else:
        raise ValueError(
            f"{path.name}: tokenizer.ggml.model {kind!r} is not supported "
            "(supported: gpt2, llama); use the model's HF folder"
        )

    typed = list(zip(tokens, token_types))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, token_type in typed if token_type in (_UNKNOWN, _CONTROL)]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, token_type in typed if token_type == _USER_DEFINED]
    )

    def token_at(key: str) -> str | None:
        index = meta(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    eos_id = meta("tokenizer.ggml.eos_token_id")
    if eos_id is None:
        raise ValueError(f"{path.name}: no tokenizer.ggml.eos_token_id in the GGUF metadata")
    return dict(
        backend=backend,
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos_id,
        add_bos=meta("tokenizer.ggml.add_bos_token", add_bos_default),
        special_texts={
            "bos_token": token_at("tokenizer.ggml.bos_token_id"),
            "eos_token": token_at("tokenizer.ggml.eos_token_id"),
            "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
            "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        },
        stop_token_ids=[
            i for i in (meta("tokenizer.ggml.eot_token_id"), meta("tokenizer.ggml.eom_token_id")) if i is not None
        ],
        chat_template=meta("tokenizer.chat_template"),
    )


def _merges_from_scores(tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best-scoring result first (shorter left pieces last among equals)."""
    if scores is None:
        raise ValueError("GGUF: a SentencePiece vocabulary needs tokenizer.ggml.merges or .scores")
    ids = {token: index for index, token in enumerate(tokens)}
    candidates = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        pairs.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates += [(score, left, right) for left, right in pairs]
    candidates.sort(key=lambda c: (c[0], len(c[1]), len(c[2])), reverse=True)
    return [(left, right) for _, left, right in candidates]


def _hf_folder_parts(folder: Path) -> dict[str, Any]:
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"model path: {folder} has no tokenizer.json")
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    config = _read_json(folder / "tokenizer_config.json")
    texts = {name: _token_content(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    ids = {name: backend.token_to_id(text) if text is not None else None for name, text in texts.items()}
    generation = _read_json(folder / "generation_config.json").get("eos_token_id")
    generation_eos = [generation] if isinstance(generation, int) else list(generation or [])
    eos_id = ids["eos_token"] if ids["eos_token"] is not None else (generation_eos or [None])[0]
    if eos_id is None:
        raise ValueError(f"model path: {folder} defines no eos_token")
    bos_id = ids["bos_token"]
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # the post-processor decides in tokenizer.json; see whether it adds BOS
        add_bos = bos_id is not None and backend.encode("a").ids[:1] == [bos_id]
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return dict(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        add_bos=add_bos,
        special_texts=texts,
        stop_token_ids=generation_eos,
        chat_template=template,
    )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config spells a special token as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value
