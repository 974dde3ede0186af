"""pagemesh.common.tokenizer against transformers as the oracle (transformers is a test-only dependency)."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import jinja2
import pytest

from pagemesh.common.chat_template import ChatTemplate
from pagemesh.common.model_files import default_model_path
from pagemesh.common.tokenizer import IncrementalDetokenizer, Tokenizer
from pagemesh.tests.default_model import hf_tokenizer as reference
from pagemesh.tests.default_model import tokenizer as ours

MODEL = default_model_path()

TEXTS = [
    "Hello, world!",
    "hello world",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n\nmore",
    "    indented code",
    "def f(x):\n    return x ** 2  # square\n",
    "numbers 12345 and 3.14159, year 2024",
    "don't can't I'm we'll they've DON'T",
    "Ünïcödé àccents: café, naïve, façade",
    "中文字符和日本語のテキスト",
    "emoji 🙂🚀👩‍👩‍👧 mixed",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>text<repo_name>x",
    "<|im_start|><|im_start|>",
    "<|im_start",
    "",
    " ",
    "\n",
    "  \n  \t ",
    "a\r\nb",
    "https://example.com/path?q=1&r=2",
    'JSON: {"a": [1, 2, {"b": null}]}',
    "\u00a0nbsp and \u200bzero width",
    "ℝ∑∫ math ≠ ≤",
]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another, in 中文 please 🙂"},
    ],
    [
        {"role": "system", "content": "Multi\nline\n\nsystem"},
        {"role": "user", "content": "  spaces  "},
        {"role": "assistant", "content": "ok", "tool_calls": None},
        {"role": "user", "content": "<|im_start|> inside content"},
    ],
]


# ---- encode / decode -----------------------------------------------------------------------------


def test_model_facts():
    assert (ours().vocab_size, ours().bos_token_id, ours().eos_token_id, ours().add_bos) == (49152, 1, 2, False)
    assert ours().eos_token_ids == frozenset({2, 0})  # <|im_end|> and <|endoftext|>


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(text):
    assert ours().encode(text) == reference().encode(text)
    assert ours().encode(text, add_special_tokens=False) == reference().encode(text, add_special_tokens=False)


def test_whitespace_before_digits_splits_digits_first_like_llama_cpp():
    # SmolLM's own tokenizer (and llama.cpp's `smollm` pre-type) splits digits off before the GPT-2
    # regex; transformers' GGUF loader skips that step, so it differs from the model exactly here.
    assert ours().encode("Total:   100 items") == [17647, 42, 333, 33, 32, 32, 3723]
    assert reference().encode("Total:   100 items") == [17647, 42, 256, 216, 33, 32, 32, 3723]
    assert ours().encode("  1") == [256, 33]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(skip):
    for text in TEXTS:
        ids = reference().encode(text)
        assert ours().decode(ids, skip_special_tokens=skip) == reference().decode(ids, skip_special_tokens=skip)
    rng = random.Random(7)  # random ids include lone UTF-8 bytes and special tokens
    for _ in range(100):
        ids = [rng.randrange(ours().vocab_size) for _ in range(rng.randrange(1, 16))]
        assert ours().decode(ids, skip_special_tokens=skip) == reference().decode(ids, skip_special_tokens=skip)


def test_token_text_keeps_leading_space_and_spells_specials():
    ids = ours().encode("hello world<|im_end|>")
    assert [ours().token_text(i) for i in ids] == ["hello", " world", "<|im_end|>"]


def test_ids_outside_vocabulary_are_rejected_with_the_field_name():
    with pytest.raises(ValueError, match=r"^ids: token id 49152 outside vocabulary \[0, 49152\)$"):
        ours().decode([5, 49152])
    with pytest.raises(ValueError, match=r"^prompt: token id -1 outside vocabulary \[0, 49152\)$"):
        ours().check_ids([1, -1], "prompt")
    with pytest.raises(ValueError, match=r"^prompt: token ids must be integers, got 'x'$"):
        ours().check_ids([1, "x"], "prompt")
    with pytest.raises(ValueError, match=r"^text: must be a string, got list$"):
        ours().encode([1, 2])


# ---- chat template -------------------------------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(conversation, add_generation_prompt):
    expected = reference().apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours().apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = reference().apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    ours_ids = ours().encode_chat(conversation, add_generation_prompt=add_generation_prompt)
    assert ours_ids == expected_ids["input_ids"]


def test_chat_template_exact_string():
    assert ours().apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


TEMPLATE_FEATURES = (
    "{%- set ns = namespace(n=0) -%}\n"
    "{% for m in messages %}\n"
    "    {% if m.role == 'stop' %}{% break %}{% endif %}\n"
    "    {% set ns.n = ns.n + 1 %}\n"
    "    {{ bos_token }}{{ m | tojson }}{% if not loop.last %}, {% endif %}\n"
    "{% endfor %}\n"
    "{% generation %}count={{ ns.n }}{% endgeneration %}{{ eos_token }}"
    "{% if add_generation_prompt %}>>{% endif %}"
)


def test_template_environment_matches_transformers():
    # trim_blocks/lstrip_blocks, namespace, loop controls, {% generation %}, and a tojson that keeps
    # non-ASCII and HTML characters as they are.
    messages = [
        {"role": "user", "content": '<b>é & "q"</b>'},
        {"role": "x", "content": "2"},
        {"role": "stop", "content": ""},
        {"role": "never", "content": ""},
    ]
    ours = ChatTemplate(TEMPLATE_FEATURES, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    for add in (True, False):
        expected = reference().apply_chat_template(
            messages, chat_template=TEMPLATE_FEATURES, tokenize=False, add_generation_prompt=add
        )
        assert ours.render(messages, add_generation_prompt=add) == expected


def test_template_raise_exception_and_message_validation():
    template = ChatTemplate("{{ raise_exception('only user turns') }}", {})
    with pytest.raises(jinja2.TemplateError, match="only user turns"):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match=r"^messages\[1\]\.role: required"):
        ours().apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content: required$"):
        ours().apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match=r"^messages: must be a non-empty list"):
        ours().encode_chat([])


# ---- incremental detokenizer ---------------------------------------------------------------------


def stream(tokenizer, ids, chunk=1, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, deltas, detok.flush()


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip", [True, False])
def test_streaming_equals_full_decode(chunk, skip):
    for text in TEXTS + ["Café 中文 🚀 done", "I like 🦙 llamas<|im_end|>"]:
        ids = ours().encode(text)
        detok, deltas, tail = stream(ours(), ids, chunk, skip_special_tokens=skip)
        full = ours().decode(ids, skip_special_tokens=skip)
        assert "".join(d for d, _ in deltas) + tail == detok.text == full
        assert all("\ufffd" not in d for d, _ in deltas)


def test_streaming_holds_partial_characters_and_uses_prompt_context():
    ids = ours().encode("I like 🦙 llamas")  # the emoji is three byte tokens: ' \xf0\x9f', '\xa6', '\x99'
    _, deltas, tail = stream(ours(), ids)
    assert [d for d, _ in deltas] == ["I", " like", "", "", " 🦙", " l", "lam", "as"]
    prompt = ours().encode("<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(ours(), prompt_ids=prompt)
    assert [detok.add([i])[0] for i in ids] == ["I", " like", "", "", " 🦙", " l", "lam", "as"]


def test_streaming_window_stays_small():
    ids = ours().encode("word " * 2000)
    detok, _, _ = stream(ours(), ids)
    assert detok.text == "word " * 2000
    assert len(detok._window) <= 2  # only the last token is kept as context


def test_stop_string_cuts_output_before_it():
    ids = ours().encode("Hello world. The end is near.")
    detok, deltas, tail = stream(ours(), ids, stop=["end"])
    assert deltas == [
        ("Hello", None),
        (" world", None),
        (".", None),
        (" Th", None),
        ("e ", "end"),
        ("", "end"),
        ("", "end"),
        ("", "end"),
    ]
    assert (tail, detok.text, detok.matched_stop) == ("", "Hello world. The ", "end")


def test_stop_string_spanning_tokens_included_in_output():
    ids = ours().encode("Hello world. The end is near.")
    detok, deltas, tail = stream(ours(), ids, stop=["nothing", "d. T"], include_stop_str_in_output=True)
    assert [d for d, _ in deltas] == ["Hello", " worl", "", "d. T", "", "", "", ""]
    assert detok.text == "Hello world. T"


def test_possible_stop_prefix_is_held_then_released():
    ids = ours().encode("hello world?")
    detok, deltas, tail = stream(ours(), ids, stop=["world!"])
    assert deltas == [("hello", None), (" ", None), ("world?", None)]
    detok = IncrementalDetokenizer(ours(), stop=["world!"])
    assert [detok.add([i])[0] for i in ours().encode("hello world")] == ["hello", " "]
    assert detok.flush() == "world" and detok.text == "hello world" and detok.matched_stop is None


def test_earliest_stop_wins():
    ids = ours().encode("one two three")
    detok, _, _ = stream(ours(), ids, chunk=len(ids), stop=["three", "two"])
    assert (detok.text, detok.matched_stop) == ("one ", "two")


# ---- other sources: HF folder, SentencePiece GGUF, llama-3 pre-tokenizer ------------------------


def test_hf_folder_matches_transformers(tmp_path):
    reference().save_pretrained(tmp_path)
    folder = Tokenizer.from_path(tmp_path)
    facts = (folder.vocab_size, folder.bos_token_id, folder.eos_token_id, folder.add_bos)
    assert facts == (49152, 1, 2, False)
    assert folder.eos_token_ids == ours().eos_token_ids
    for text in TEXTS + ["Total:   100 items"]:  # the saved tokenizer.json is transformers' own
        assert folder.encode(text) == reference().encode(text)
    for conversation in CONVERSATIONS:
        assert folder.apply_chat_template(conversation) == ours().apply_chat_template(conversation)
        assert folder.encode_chat(conversation, False) == ours().encode_chat(conversation, False)


def _write_gguf(
    path: Path, tokens, token_types, *, model, pre=None, merges=None, scores=None, add_bos=True, template=None
) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if merges:
        writer.add_token_merges(merges)
    if scores:
        writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    if template:
        writer.add_chat_template(template)
    # transformers also reads a model config from the file
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    words = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "a",
        "t",
        "▁h",
        "▁w",
        "ll",
        "he",
        "▁he",
        "llo",
        "▁hello",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "▁a",
        "at",
        "▁t",
        "th",
        "▁the",
        "▁that",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]  # merges come from the scores
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    path = _write_gguf(tmp_path / "spm.gguf", tokens, types, model="llama", scores=scores, template=template)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    mine = Tokenizer.from_path(path)
    assert (mine.add_bos, mine.bos_token_id) == (True, 1)
    for text in ["hello world", " hello  world", "hello\nthat é 世", "<s>hello</s>the", "", "wat"]:
        ids = hf.encode(text)
        assert mine.encode(text) == ids
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip)
            assert mine.decode(ids, skip_special_tokens=skip) == expected
        detok, deltas, tail = stream(mine, ids)
        assert detok.text == mine.decode(ids)
    chat = [{"role": "user", "content": "hello"}]
    assert mine.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False)
    expected_ids = [1, 94, 120, 118, 261, 265, 96, 275, 2]  # "<s>[user] hello</s>"
    assert mine.encode_chat(chat) == hf.apply_chat_template(chat)["input_ids"] == expected_ids
    assert [mine.token_text(i) for i in mine.encode("hello what", add_special_tokens=False)] == [
        " hello",
        " w",
        "h",
        "at",
    ]


def test_llama3_pre_tokenizer_gguf_matches_transformers(tmp_path):
    # The SmolLM vocabulary under llama-3's split regex: checks the `llama-bpe` pre-type and BOS.
    fields = gguf.GGUFReader(MODEL).fields
    path = _write_gguf(
        tmp_path / "l3.gguf",
        fields["tokenizer.ggml.tokens"].contents(),
        fields["tokenizer.ggml.token_type"].contents(),
        model="gpt2",
        pre="llama-bpe",
        merges=fields["tokenizer.ggml.merges"].contents(),
    )
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    mine = Tokenizer.from_path(path)
    assert mine.add_bos
    for text in TEXTS + ["Total:   100 items", "  1"]:
        assert mine.encode(text) == hf.encode(text)


def test_unsupported_gguf_tokenizer_is_a_clear_error(tmp_path):
    path = _write_gguf(tmp_path / "bert.gguf", ["[UNK]", "[CLS]", "[SEP]"], [2, 3, 3], model="bert")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model 'bert' is not supported"):
        Tokenizer.from_path(path)
    with pytest.raises(ValueError, match="neither a .gguf file nor a model folder"):
        Tokenizer.from_path(tmp_path / "missing.gguf")
