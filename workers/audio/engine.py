"""Speech to text for many requests at once: `AudioEngine` runs Whisper with continuous batching, one
decoder token per request per step, its KV in pages.

    admit ─▶ waiting ──a step starts up to max_batch──▶ the encoder, once, over every starting request
                                                       ─▶ each decoder layer's cross K/V, written once
             running ──every step──▶ one decoder pass over the rows of every running request:
                                     one token each, and whole prompts of the requests just started

A request holds two block tables of one pool (pages from one `BlockManager`, no prefix cache):

    cross  ceil(max_source_positions / page_size) pages: the encoder output's K/V, per decoder
           layer, written when the request starts and read by every step after
    self   its decoder tokens' K/V, grown page by page as it decodes

Both go back to the pool when it finishes or is aborted. A request starts only when the pool can hold
both at their largest (its prompt plus its max tokens), so a started request never runs out of pages
and nothing is preempted. Decoding is greedy (`decoding_rules.py`: the default prompt, end and
suppressed tokens, language detection).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pagemesh.kernels.cpu.memory import zeroed_tensor
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.audio.audio_files import SAMPLE_RATE
from pagemesh.workers.audio.decoding_rules import DecoderPrompt, DecodingRules
from pagemesh.workers.audio.whisper import DecoderContext, load_whisper
from pagemesh.workers.engine.backend import select_backend
from pagemesh.workers.engine.block_manager import BlockManager


@dataclass(frozen=True)
class AudioOutput:
    """What one request produced in a step. `language_token_id`: the language the engine detected
    for it (a multilingual checkpoint's default prompt), on its first output only."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (an end token, which is in new_token_ids) or "length"; None while running
    language_token_id: int | None = None


@dataclass
class AudioEngineStats:
    """Running totals: what ran how often."""

    encoder_batches: int = 0  # encoder forward calls
    encoded_requests: int = 0  # requests whose audio went through the encoder
    cross_kv_writes: int = 0  # requests whose cross-attention K/V were computed and written to pages
    decoder_steps: int = 0  # decoder forward passes
    decoder_rows: int = 0  # token rows they ran


@dataclass(eq=False)  # compared by identity (abort finds it in the queue)
class _Request:
    request_id: str
    features: np.ndarray | None  # [mels, frames] log-mel, until encoded
    pending: list[int]  # what the next step feeds: the prompt (or its part), then the last token
    prompt: DecoderPrompt | None  # set while the language is still to be detected
    max_new_tokens: int
    max_pages: int
    num_computed: int = 0  # tokens whose self K/V are in pages
    num_output: int = 0
    language_token_id: int | None = None
    self_table: list[int] = field(default_factory=list)
    cross_table: list[int] = field(default_factory=list)


class AudioEngine:
    """Whisper from the Hugging Face folder `folder` (weights, config, generation config, the
    `WhisperFeatureExtractor`'s preprocessor_config.json) in `dtype` on `device`, with a KV pool of
    `num_pages` pages of `page_size` tokens (default: room for `max_batch` requests at the longest).

    `admit` queues a request (16 kHz float32 samples, at most 30 s), `step` runs one iteration and
    returns each running request's new token, `abort` drops one. At most `max_batch` requests run;
    the rest wait in admission order. A request ends at an end token ("stop"), after `max_tokens`
    tokens, or when its sequence fills the decoder's max_target_positions ("length"); its pages are
    free by the time `step` returns its last output. Greedy decoding only."""

    def __init__(
        self,
        folder: Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        num_pages: int | None = None,
        page_size: int = 16,
        max_batch: int = 16,
    ):
        from transformers import WhisperFeatureExtractor  # numpy log-mel, exactly as HF computes it

        folder = Path(folder)
        self.device = torch.device(device)
        self.model = load_whisper(folder, dtype, self.device)
        self.rules = DecodingRules.from_folder(folder)
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(folder)
        cfg = self.model.config
        frames = self.feature_extractor.nb_max_frames
        if frames != cfg.num_frames:
            raise ValueError(f"whisper: the feature extractor makes {frames} frames, the model takes {cfg.num_frames}")
        self.page_size, self.max_batch = page_size, max_batch
        self.cross_pages = -(-cfg.max_source_positions // page_size)
        if num_pages is None:
            num_pages = 1 + max_batch * (self.cross_pages + -(-cfg.max_target_positions // page_size))
        self.blocks = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        shape = (cfg.decoder_layers, num_pages, 2, page_size, cfg.decoder_heads, cfg.decoder_head_dim)
        on_cpu = self.device.type == "cpu"  # there, pages cost memory only once written (as the LLM's pool)
        self.kv_cache = zeroed_tensor(shape, dtype) if on_cpu else torch.zeros(shape, dtype=dtype, device=self.device)
        self.attention = select_backend(self.device, dtype).attention
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self.reserved_pages = 0  # the running requests' pages at their largest
        self.stats = AudioEngineStats()
        self._suppress = torch.tensor(self.rules.suppress_tokens, dtype=torch.int64, device=self.device)
        self._begin_suppress = torch.tensor(self.rules.begin_suppress_tokens, dtype=torch.int64, device=self.device)

    # ---- requests -------------------------------------------------------------------------
    def admit(self, request_id: str, samples: np.ndarray, max_tokens: int, prompt_ids: list[int] | None = None) -> None:
        """Queue a request: `samples` float32 mono at 16 kHz; `prompt_ids` the decoder prompt
        (default: the checkpoint's, `DecodingRules.default_prompt`). ValueError for a duplicate id,
        empty or over-long audio, max_tokens < 1, a prompt id outside the vocabulary, a prompt that
        leaves no room in max_target_positions, or a request larger than the whole pool."""
        cfg = self.model.config
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0:
            raise ValueError(f"audio: expected non-empty mono samples, got shape {samples.shape}")
        if samples.size > self.feature_extractor.n_samples:
            raise ValueError(f"audio: {samples.size / SAMPLE_RATE:.2f} s is longer than Whisper's 30 s window")
        if max_tokens < 1:
            raise ValueError("max_tokens: must be at least 1")
        if prompt_ids is None:
            prompt = self.rules.default_prompt
        elif not prompt_ids or any(not 0 <= t < cfg.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt_ids: need at least one id, each in [0, {cfg.vocab_size})")
        else:
            prompt = DecoderPrompt(head=tuple(prompt_ids))
        room = cfg.max_target_positions - prompt.length  # the last token needs no position
        if room < 1:
            raise ValueError(f"prompt: {prompt.length} tokens leave no room in {cfg.max_target_positions} positions")
        max_new = min(max_tokens, room)
        max_pages = self.cross_pages + -(-(prompt.length + max_new - 1) // self.page_size)
        if max_pages > self.blocks.num_usable_pages:
            raise ValueError(f"request needs {max_pages} KV pages, the pool has {self.blocks.num_usable_pages}")
        features = self.feature_extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
        request = _Request(
            request_id,
            features,
            pending=list(prompt.head),
            prompt=prompt if prompt.language_ids is not None else None,
            max_new_tokens=max_new,
            max_pages=max_pages,
        )
        self.requests[request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Drop a request, waiting or running, and free its pages (an unknown or finished id: nothing)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request in self.waiting:
            self.waiting.remove(request)
            del self.requests[request_id]
        else:
            self._finish(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_invariants(self) -> None:
        """The block manager's checks, with the live requests' tables (AssertionError if broken)."""
        tables = [t for r in self.running for t in (r.self_table, r.cross_table)]
        self.blocks.check_invariants(tables)

    @property
    def num_free_pages(self) -> int:
        return self.blocks.num_free_pages

    @property
    def num_usable_pages(self) -> int:
        return self.blocks.num_usable_pages

    # ---- one iteration --------------------------------------------------------------------
    def step(self) -> list[AudioOutput]:
        """Start what fits (encoding it), then one decoder pass over every running request."""
        started = self._start_waiting()
        with torch.inference_mode():
            if started:
                self._encode(started)
            if not self.running:
                return []
            batch = sorted(self.running, key=lambda r: len(r.pending) > 1)  # one-token rows first
            logits = self._decode(batch)
            return self._advance(batch, logits)

    def _start_waiting(self) -> list[_Request]:
        started = []
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            if self.reserved_pages + request.max_pages > self.blocks.num_usable_pages:
                break
            self.waiting.popleft()
            self.reserved_pages += request.max_pages
            self.blocks.grow(request.cross_table, self.model.config.max_source_positions)
            self.running.append(request)
            started.append(request)
        return started

    def _encode(self, started: list[_Request]) -> None:
        """The encoder over every starting request in one call, then each decoder layer's cross K/V
        of them into their cross pages: the only time either is computed for a request."""
        features = torch.from_numpy(np.stack([r.features for r in started])).to(self.device)
        encoded = self.model.encode(features).flatten(0, 1)  # [B * N, d]
        length = self.model.config.max_source_positions
        md = self._metadata([length] * len(started), [length] * len(started), [r.cross_table for r in started])
        for kv_layer, (k, v) in zip(self.kv_cache, self.model.cross_keys_values(encoded), strict=True):
            self.attention.write_kv(k, v, kv_layer, md)
        for r in started:
            r.features = None
        self.stats.encoder_batches += 1
        self.stats.encoded_requests += len(started)
        self.stats.cross_kv_writes += len(started)

    def _decode(self, batch: list[_Request]) -> torch.Tensor:
        """One decoder pass over every request's pending tokens; logits of each one's last row."""
        query_lens = [len(r.pending) for r in batch]
        for r in batch:
            self.blocks.grow(r.self_table, r.num_computed + len(r.pending))
        seq_lens = [r.num_computed + len(r.pending) for r in batch]
        self_md = self._metadata(query_lens, seq_lens, [r.self_table for r in batch])
        token_ids = [t for r in batch for t in r.pending]
        rows, length = len(token_ids), self.model.config.max_source_positions
        cross_md = self._metadata([1] * rows, [length] * rows, [r.cross_table for r in batch for _ in r.pending])
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        last_rows = torch.tensor(np.cumsum(query_lens) - 1, dtype=torch.int64, device=self.device)
        logits = self.model.decode(ids, DecoderContext(self.kv_cache, self_md, cross_md, self.attention), last_rows)
        for r in batch:
            r.num_computed += len(r.pending)
        self.stats.decoder_steps += 1
        self.stats.decoder_rows += len(ids)
        return logits

    def _metadata(self, query_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_lens,
            seq_lens,
            tables,
            self.page_size,
            self.device,
            for_cpu=self.attention.builds_cpu_indices,
            decode_gather=self.attention.decode_gather,
        )

    def _advance(self, batch: list[_Request], logits: torch.Tensor) -> list[AudioOutput]:
        """Each request's next token (or detected language), its output, its end."""
        languages = {}
        for i, r in enumerate(batch):  # detection reads the raw logits, language tokens only (as HF)
            if r.prompt is not None:
                ids = r.prompt.language_ids
                languages[i] = ids[int(logits[i, list(ids)].argmax())]
        if len(self._suppress):
            logits[:, self._suppress] = float("-inf")
        first = [i for i, r in enumerate(batch) if r.num_output == 0]
        if first and len(self._begin_suppress):
            logits[torch.tensor(first, device=self.device)[:, None], self._begin_suppress] = float("-inf")
        tokens = logits.argmax(dim=-1).tolist()
        outputs = []
        for i, r in enumerate(batch):
            if i in languages:
                r.language_token_id = languages[i]
                r.pending = [languages[i], *r.prompt.after_language]
                r.prompt = None
                continue
            token = tokens[i]
            r.pending = [token]
            r.num_output += 1
            reason = None
            if token in self.rules.eos_token_ids:
                reason = "stop"
            elif r.num_output >= r.max_new_tokens:
                reason = "length"
            if reason is not None:
                self._finish(r)
            language = r.language_token_id if r.num_output == 1 else None
            outputs.append(AudioOutput(r.request_id, [token], reason is not None, reason, language))
        return outputs

    def _finish(self, request: _Request) -> None:
        self.blocks.free_table(request.self_table)
        self.blocks.free_table(request.cross_table)
        self.running.remove(request)
        self.reserved_pages -= request.max_pages
        del self.requests[request.request_id]
