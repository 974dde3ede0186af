"""`pagemesh tokenizer-export`: the folder transformers loads offline gives our ids and chat text."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as Backend

from pagemesh.common.model_config import default_max_model_len
from pagemesh.common.model_files import default_model_path
from pagemesh.common.tokenizer import Tokenizer
from pagemesh.services.tokenizer_export import FILES, hf_tokenizer_files
from pagemesh.tests.default_model import tokenizer

TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "Numbers: 1234567890, 3.14159, -42 and 1e-9",
    "Unicode: héllo wörld, naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "Emoji 🙂👍🏽 and symbols ©®™ ∑∫√",
    "def f(x):\n\treturn x ** 2  # code\n\n\nif __name__ == '__main__':\n    print(f(3))",
    "Special tokens as text: <|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "tabs\tand\r\nwindows\r\nnewlines",
    "",
    "a" * 300,
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer with a digit."},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3 — in words, s'il vous plaît?"},
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Our tokenizer, and transformers' from the exported folder (no network: offline mode)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tokenizer")
    # what export() writes, from the session's tokenizer (parsing the GGUF again costs seconds)
    files = hf_tokenizer_files(tokenizer(), default_max_model_len(default_model_path()))
    assert sorted(files) == sorted(FILES)
    for name, text in files.items():
        (folder / name).write_text(text)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    return tokenizer(), hf, folder


def test_ids_equal_ours_over_varied_text(exported):
    ours, hf, _ = exported
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text), text
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False), text


def test_chat_template_renders_and_tokenizes_as_ours(exported):
    ours, hf, _ = exported
    for generation_prompt in (True, False):
        text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
        assert text == ours.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt)
        assert hf.encode(text, add_special_tokens=False) == ours.encode_chat(MESSAGES, generation_prompt)


def test_config_names_the_special_tokens_and_the_context_length(exported):
    ours, hf, folder = exported
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 8192
    assert hf.eos_token_id == ours.eos_token_id
    assert hf.convert_tokens_to_ids(hf.bos_token) == ours.bos_token_id
    assert json.loads((folder / "special_tokens_map.json").read_text()) == ours.special_texts
    # decoding round-trips too
    ids = ours.encode(TEXTS[3])
    assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)


def test_a_model_that_adds_bos_gets_it_from_the_post_processor(exported, tmp_path):
    """SmolLM2 adds no BOS; a Llama-style vocabulary does. Same vocabulary, add_bos on."""
    transformers = pytest.importorskip("transformers")
    ours = exported[0]
    with_bos = Tokenizer(
        Backend.from_str(ours.backend_json()),
        bos_token_id=ours.bos_token_id,
        eos_token_id=ours.eos_token_id,
        add_bos=True,
        special_texts=ours.special_texts,
    )
    for name, text in hf_tokenizer_files(with_bos, 4096).items():
        (tmp_path / name).write_text(text)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS[:4]:
        assert hf(text)["input_ids"] == with_bos.encode(text)
        assert hf(text)["input_ids"][0] == ours.bos_token_id
