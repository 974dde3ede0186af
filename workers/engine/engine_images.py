"""An engine's images (issue 32): what it checks of an image prompt, the encoder step's part of
each step's input, and the rows an encoder worker sends.

    admit ──check──▶ the model takes images? (an M-RoPE model: the prompt's positions)
          ──wait_for──▶ `--encoder N`: the prompt waits for rows not held yet
    rows from an encoder worker ──receive──▶ held by the encoder cache like rows encoded here
    each step ──model_input──▶ of the images its rows need, those not held are encoded first
    every step ──stop_waiting──▶ rows late past REMOTE_IMAGES_WAIT_S: encoded here
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from pagemesh.common.messages import ImageInput
from pagemesh.common.model_config import ModelConfig
from pagemesh.common.multimodal import MRopePositions
from pagemesh.workers.engine.encoder_cache import EncoderCache
from pagemesh.workers.engine.model_input import ModelInput, build_model_input
from pagemesh.workers.engine.sequence import Sequence

REMOTE_IMAGES_WAIT_S = 10.0  # a prompt waits this long for an encoder worker's rows, then encodes here

log = logging.getLogger(__name__)


class EngineImages:
    """The runner's image rows and the encoder cache that decides them (`cache`)."""

    def __init__(self, runner, model_config: ModelConfig):
        self.runner = runner
        self.model_config = model_config
        self.cache = EncoderCache()

    def check(self, prompt_token_ids: Seq[int], images: Seq[ImageInput]) -> MRopePositions | None:
        """ValueError unless this model takes the images; an M-RoPE model's prompt positions."""
        encoder = self.runner.image_encoder
        if images and encoder is None:
            raise ValueError("messages: this model does not take images")
        if self.model_config.mrope_section is None or not images:
            return None
        return MRopePositions.of(prompt_token_ids, encoder.spec.image_token_id, images, encoder.spec.merge_size)

    def wait_for(self, seq: Sequence) -> None:
        """An encoder worker sends `seq`'s images' rows: it waits for those not held yet."""
        seq.images_pending = {i.digest for i in seq.images if i.digest not in self.cache}
        seq.images_wait_until = time.monotonic() + REMOTE_IMAGES_WAIT_S

    def receive(self, seqs: Iterable[Sequence], digest: str, rows: torch.Tensor) -> None:
        """An encoder worker's rows of one image, held like rows encoded here: the prompts
        (`seqs`) waiting for them may run, and one whose task comes after them (the encoder was
        faster than the scheduler's other message) finds them held when it is admitted."""
        if digest not in self.cache:
            self.runner.image_embeds[digest] = rows.to(self.runner.device, self.runner.dtype)
            self.runner.image_drop(self.cache.hold(digest, rows.shape[0]))
        for seq in seqs:
            seq.images_pending.discard(digest)

    def stop_waiting(self, waiting: Iterable[Sequence]) -> None:
        """Prompts whose encoder worker is late past the deadline: their images are encoded here."""
        now = time.monotonic()
        for seq in waiting:
            if seq.images_pending and now > seq.images_wait_until:
                log.warning("request %s: image rows late, encoding them here", seq.request_id)
                seq.images_pending.clear()

    def model_input(self, plan) -> ModelInput:
        """The plan as the runner's input, with the encoder step's part: of the images its rows
        need, those the encoder cache does not hold are encoded first (encoder_cache.py)."""
        step = build_model_input(plan)
        if not step.image_encode:
            return step
        encode, drop = self.cache.plan(step.image_encode)
        return dataclasses.replace(step, image_encode=[(i.digest, i.data, i.grid) for i in encode], image_drop=drop)
