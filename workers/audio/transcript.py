"""Whisper's generated token ids -> the transcript's text (no torch: the tokenizer's `tokenizers`
model only).

    ids ──decode, special tokens skipped──▶ text ──timestamp tokens' text removed──▶ stripped

What transformers' `WhisperTokenizer.decode(ids, skip_special_tokens=True)` gives: the special
tokens (<|startoftranscript|>, <|en|>, <|notimestamps|>, <|endoftext|>, ...) drop out in the
decode; the timestamp tokens (<|0.00|> .. <|30.00|>), which a Whisper tokenizer.json holds as
plain added tokens, are removed from the text after it (HF's `_filter_timestamp_ids`). Then the
leading and trailing whitespace goes (Whisper's text begins with a space), as OpenAI's API answers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from pagemesh.common.tokenizer import Tokenizer

_TIMESTAMP = re.compile(r"<\|(\d+\.\d+)\|>")  # transformers' WhisperTokenizer.timestamp_pat


class TranscriptDecoder:
    """The text of a request's generated ids (its end token included or not). Contract: ids in
    the tokenizer's vocabulary; a ValueError names one that is not."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_folder(cls, folder: Path) -> TranscriptDecoder:
        """The tokenizer of a Whisper folder (tokenizer.json, tokenizer_config.json)."""
        return cls(Tokenizer.from_path(folder))

    def text(self, ids: Sequence[int]) -> str:
        return _TIMESTAMP.sub("", self.tokenizer.decode(ids, skip_special_tokens=True)).strip()
