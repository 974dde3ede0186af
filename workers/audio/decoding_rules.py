"""What a Whisper checkpoint's generation config says about decoding, as plain data (no torch):
the default decoder prompt, the end tokens, and the tokens greedy decoding never picks.

The default prompt is the one transformers' `WhisperForConditionalGeneration.generate` builds for a
short clip with no `language`, `task` or timestamps asked for:

    [decoder_start_token_id] + forced_decoder_ids (positions 1, 2, ...) + [no_timestamps_token_id]

    whisper-small (multilingual):  <|startoftranscript|> <|LANG|> <|transcribe|> <|notimestamps|>
    whisper-tiny.en:               <|startoftranscript|> <|notimestamps|>

A multilingual checkpoint (`lang_to_id` in its generation config) leaves position 1 open (None in
forced_decoder_ids, or no entry): the language is detected as HF does it, from the logits after
<|startoftranscript|> alone, restricted to the language tokens; the rest of the prompt follows it.
Each key comes from generation_config.json, or from config.json where that file lacks it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DecoderPrompt:
    """The tokens to feed first; with `language_ids`, the language token is chosen (the argmax of
    the logits after `head`, among `language_ids`) and fed with `after_language` next."""

    head: tuple[int, ...]
    language_ids: tuple[int, ...] | None = None
    after_language: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        """Tokens of the whole prompt (the detected language included)."""
        return len(self.head) + (0 if self.language_ids is None else 1 + len(self.after_language))


@dataclass(frozen=True)
class DecodingRules:
    """A checkpoint's decoding rules. Greedy decoding never picks a `suppress_tokens` id, nor, for
    a request's first generated token, a `begin_suppress_tokens` id (HF's two logits processors);
    it stops at any of `eos_token_ids`."""

    decoder_start_token_id: int
    eos_token_ids: frozenset[int]
    default_prompt: DecoderPrompt
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()

    @classmethod
    def from_folder(cls, folder: Path) -> DecodingRules:
        config = json.loads((folder / "config.json").read_text())
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}

        def key(name: str):
            return gen[name] if gen.get(name) is not None else config.get(name)

        start = key("decoder_start_token_id")
        eos = key("eos_token_id")
        if start is None or eos is None:
            raise ValueError(f"whisper: {folder} names no decoder_start_token_id or eos_token_id")
        return cls(
            decoder_start_token_id=start,
            eos_token_ids=frozenset(eos if isinstance(eos, list) else [eos]),
            default_prompt=default_prompt(
                start, key("forced_decoder_ids"), gen.get("lang_to_id"), gen.get("no_timestamps_token_id")
            ),
            suppress_tokens=tuple(key("suppress_tokens") or ()),
            begin_suppress_tokens=tuple(key("begin_suppress_tokens") or ()),
        )


def default_prompt(
    start: int,
    forced_decoder_ids: list[list[int | None]] | None,
    lang_to_id: dict[str, int] | None,
    no_timestamps_token_id: int | None,
) -> DecoderPrompt:
    """The prompt of the module docstring. forced_decoder_ids: [[position, id or None], ...] from
    position 1 on, consecutive (HF's requirement too); others are a ValueError."""
    tokens: list[int | None] = [start]
    for position, token in forced_decoder_ids or []:
        if position != len(tokens):
            raise ValueError(f"whisper: forced_decoder_ids {forced_decoder_ids} skip position {len(tokens)}")
        tokens.append(token)
    detect = bool(lang_to_id) and (len(tokens) == 1 or tokens[1] is None)
    if detect and len(tokens) == 1:
        tokens.append(None)  # the language's position
    if no_timestamps_token_id is not None and tokens[-1] != no_timestamps_token_id:
        tokens.append(no_timestamps_token_id)
    if not detect:
        return DecoderPrompt(head=tuple(t for t in tokens if t is not None))
    return DecoderPrompt(
        head=(start,),
        language_ids=tuple(sorted(lang_to_id.values())),
        after_language=tuple(t for t in tokens[2:] if t is not None),
    )
