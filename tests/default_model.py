"""The default model's tokenizers, loaded once per test session and only when a test first needs
one: each load parses the GGUF's 49,152-token vocabulary (seconds; more on a loaded machine), and
every test module that used one loaded its own at collection."""

from __future__ import annotations

import functools

from pagemesh.common.model_files import default_model_path
from pagemesh.common.tokenizer import Tokenizer


@functools.cache
def tokenizer() -> Tokenizer:
    """Ours (common/tokenizer.py). Shared: it keeps no state between calls."""
    return Tokenizer.from_path(default_model_path())


@functools.cache
def hf_tokenizer():
    """Hugging Face transformers' tokenizer of the same GGUF file, the reference."""
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
