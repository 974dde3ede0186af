"""Speech to text: a Whisper-style encoder-decoder served with continuous batching over paged KV.
Audio file bytes become 16 kHz samples (`audio_files.py`); `AudioEngine` (`engine.py`) encodes each
new request once, keeps its cross-attention K/V in pages for the request's life, and decodes every
running request in one batched step of the decoder (`whisper.py`, our own torch model, loaded from a
Hugging Face `WhisperForConditionalGeneration` folder), greedily, by the checkpoint's generation
config (`decoding_rules.py`: the default prompt, language detection, end and suppressed tokens).
`worker.py` serves it in the mesh (`pagemesh audio`, `main.py`); `transcript.py` makes the text."""
