"""A transcript's text from Whisper's tokens (workers/audio/transcript.py) against transformers'
`WhisperTokenizer.decode(ids, skip_special_tokens=True)`, on a small byte-level BPE tokenizer laid
out as a Whisper checkpoint's: the special tokens (<|endoftext|>, <|startoftranscript|>, languages,
tasks, <|notimestamps|>) as special added tokens, the timestamps (<|0.00|> ...) as plain ones."""

from __future__ import annotations

import pytest

from pagemesh.workers.audio.transcript import TranscriptDecoder

SPECIALS = ["<|startoftranscript|>", "<|en|>", "<|fr|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>"]
WORDS = ["Ġhello", "Ġworld", "Ġthe", "Ġcat", "Ġsat", "'s", "Ġit", "Ġ,", "Ġ."]


@pytest.fixture(scope="module")
def whisper_tokenizer(tmp_path_factory):
    """(HF's WhisperTokenizer, the folder it was saved to)."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import WhisperTokenizer

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    for word in WORDS:  # each word merged left to right: one token
        left = word[0]
        for char in word[1:]:
            merges.append((left, char))
            vocab.setdefault(left + char, len(vocab))
            left += char
    hf = WhisperTokenizer(vocab=vocab, merges=merges)
    hf.add_special_tokens({"additional_special_tokens": SPECIALS})
    timestamps = [AddedToken(f"<|{i * 0.02:.2f}|>", normalized=False, special=False) for i in range(4)]
    hf.add_tokens(timestamps)
    folder = tmp_path_factory.mktemp("whisper_tokenizer")
    hf.save_pretrained(folder)
    return hf, folder


def test_text_is_hf_whisper_decode_with_specials_and_timestamps_dropped(whisper_tokenizer):
    hf, folder = whisper_tokenizer
    decoder = TranscriptDecoder.from_folder(folder)
    ids = hf.convert_tokens_to_ids
    words = hf.encode(" hello world, the cat's sat.", add_special_tokens=False)
    assert hf.convert_ids_to_tokens(words)[:2] == ["Ġhello", "Ġworld"]  # whole words: the merges apply
    cases = [
        words,
        [*words, ids("<|endoftext|>")],  # the end token, as the engine returns it
        [ids("<|0.00|>"), *words[:3], ids("<|0.02|>"), ids("<|0.04|>"), *words[3:], ids("<|endoftext|>")],
        [ids("<|en|>"), ids("<|transcribe|>"), *words[:2], ids("<|notimestamps|>")],
        [ids("<|endoftext|>")],
        [],
    ]
    for case in cases:
        assert decoder.text(case) == hf.decode(case, skip_special_tokens=True).strip()
    assert decoder.text(cases[2]) == "hello world, the cat's sat."
    assert decoder.text(cases[4]) == ""


def test_an_id_outside_the_vocabulary_is_a_value_error_naming_it(whisper_tokenizer):
    hf, folder = whisper_tokenizer
    decoder = TranscriptDecoder.from_folder(folder)
    with pytest.raises(ValueError, match=f"token id {len(hf)} outside vocabulary"):
        decoder.text([len(hf)])
