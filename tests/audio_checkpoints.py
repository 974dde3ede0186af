"""The tiny random Whisper checkpoint of the audio tests, and Hugging Face's greedy tokens on it:
the oracle of tests/integration/test_audio_engine.py and test_mesh_audio.py.

A tiny random Whisper (d_model 64, 2 + 2 layers, 4 heads, 80 mel bins, 1500 encoder positions, a
300-token vocabulary whose last ids are the special tokens) is saved with `save_pretrained` beside
a `WhisperFeatureExtractor`; HF's `generate` on the same features is the oracle, token for token.
Its weights are drawn wide (init_std 0.2, an untied output head of std 0.4) so that the audio steers
the tokens (clips decode differently) and no greedy step is a near-tie (`assert_clear_argmax`).
`write_tokenizer` adds a word-level tokenizer.json (token i is the word `w{i}`, so a transcript's
text gives its ids back; Whisper's special tokens are special tokens).
"""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path

import numpy as np
import torch

START, EOS, EN, DE, FR, TRANSCRIBE, TRANSLATE, NO_TIMESTAMPS = 290, 291, 292, 293, 294, 295, 296, 297
SPECIAL_TOKENS = {
    "<|startoftranscript|>": START,
    "<|endoftext|>": EOS,
    "<|en|>": EN,
    "<|de|>": DE,
    "<|fr|>": FR,
    "<|transcribe|>": TRANSCRIBE,
    "<|translate|>": TRANSLATE,
    "<|notimestamps|>": NO_TIMESTAMPS,
}
VOCAB = 300
PROMPT_LEN = 4  # <|startoftranscript|> <|lang|> <|transcribe|> <|notimestamps|>
MAX_TARGET = 64
RATE = 16_000


def save_tiny_whisper(folder, *, tied: bool) -> None:
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=MAX_TARGET,
        decoder_start_token_id=START,
        bos_token_id=START,
        eos_token_id=EOS,
        pad_token_id=EOS,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        tie_word_embeddings=tied,
        init_std=0.2,
    )
    model = WhisperForConditionalGeneration(config).eval()
    if not tied:
        with torch.no_grad():
            model.proj_out.weight.normal_(0, 0.4)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=START,
        bos_token_id=START,
        eos_token_id=EOS,
        pad_token_id=EOS,
        lang_to_id={"<|en|>": EN, "<|de|>": DE, "<|fr|>": FR},
        task_to_id={"transcribe": TRANSCRIBE, "translate": TRANSLATE},
        no_timestamps_token_id=NO_TIMESTAMPS,
        forced_decoder_ids=[[1, None], [2, TRANSCRIBE]],
        is_multilingual=True,
        suppress_tokens=[1, 2, 3],
        begin_suppress_tokens=[EOS, 4],
        max_length=MAX_TARGET,
    )
    model.save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json (word level: `w{i}`, the special tokens by name) and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = {i: name for name, i in SPECIAL_TOKENS.items()}
    vocab = {specials.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in SPECIAL_TOKENS])
    tok.save(str(Path(folder) / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))


def transcript_of(folder: Path, ids: list[int]) -> str:
    """The text of `ids` by the folder's tokenizer.json alone (`tokenizers`, special tokens skipped)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json")).decode(ids, skip_special_tokens=True)


def hf_greedy(hf_whisper, clips, max_new_tokens, prompt_ids=None):
    """HF generate's greedy tokens per clip, through the first end token. `hf_whisper`: (model,
    feature extractor)."""
    model, extractor = hf_whisper
    features = torch.from_numpy(extractor(clips, sampling_rate=RATE, return_tensors="np").input_features)
    kwargs = {} if prompt_ids is None else {"decoder_input_ids": torch.tensor([prompt_ids] * len(clips))}
    with torch.no_grad():
        out = model.generate(features, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
        assert_clear_argmax(model, features, out, prompt_ids)
    rows = [row.tolist() for row in out]
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in rows]


def assert_clear_argmax(model, features, generated, prompt_ids) -> None:
    """Teacher-forced over HF's own tokens: every greedy pick wins by a clear margin, so equality
    with the engine is not luck of rounding."""
    prompts = (
        torch.tensor([prompt_ids] * len(features))
        if prompt_ids is not None
        else torch.cat([torch.full((len(features), 1), START), model.detect_language(features)[:, None],
                        torch.tensor([[TRANSCRIBE, NO_TIMESTAMPS]] * len(features))], dim=1)
    )  # fmt: skip
    logits = model(features, decoder_input_ids=torch.cat([prompts, generated], dim=1)).logits
    logits = logits[:, prompts.shape[1] - 1 : -1].clone()
    logits[..., [1, 2, 3]] = float("-inf")
    logits[:, 0, [EOS, 4]] = float("-inf")
    top2 = logits.topk(2, dim=-1).values
    assert (logits.argmax(-1) == generated).all()
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-3


def wav_16bit(samples: np.ndarray, rate: int = RATE) -> bytes:
    """Mono float samples in [-1, 1) as a 16-bit PCM WAV file (stdlib `wave`)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.clip(np.round(samples * 32768), -32768, 32767).astype("<i2").tobytes())
    return buffer.getvalue()
