"""Pipeline stages inside an LLM worker: each stage holds a contiguous range of the layers.

    rank = stage × tp + tp_rank          (tp×pp rank processes; rank 0 = stage 0, tp rank 0)

    stage 0 (embedding, layers [0, L/M))        every rank of every stage gets each step's
      │  [2, T, hidden]: the layers' output     ModelInput down its stdin pipe from rank 0
      │  and the residual stream, tp rank t     (tensor_parallel.FollowerRanks), makes the same
      ▼  → tp rank t of the next stage          page moves in its own KV pool (its layers only)
    stage 1 … stage M-1 (final norm, LM head)
      │  fp32 logits of the step's logit rows, from the last stage's tp rank 0
      └──────────────────────────────▶ rank 0, which samples (the engine is unchanged)

Activations travel by torch.distributed point-to-point (gloo on a CPU, NCCL on CUDA) over the
worker's process group: the receiver knows the shape from the step (tokens × hidden size), so
nothing but the tensor crosses. bench/pp_step.py measured the alternatives (see
docs/perf/pipeline_parallel.md). Every wait is bounded by COLLECTIVE_TIMEOUT_S: a stage gone
mid-step makes its neighbours raise, and rank 0's watcher takes the worker down.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.model.layers import StageGroup

HIDDEN_TAG, LOGITS_TAG = 1, 2


def check_pipeline_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError, naming the sizes, unless the model's layers can make `size` stages."""
    if size < 1:
        raise ValueError(f"pipeline-parallel size must be >= 1, got {size}")
    if size > cfg.num_layers:
        raise ValueError(f"pipeline-parallel size {size} is more stages than the model's {cfg.num_layers} layers")


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The layers of `stage`: contiguous, as even as can be, the first stages one more where
    the count does not divide (30 layers in 4 stages: 8, 8, 7, 7)."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_group(stage: int, tp_size: int) -> StageGroup:
    """The (not yet joined) group of `stage`'s tensor-parallel ranks."""
    return StageGroup(tuple(stage * tp_size + t for t in range(tp_size)))


def join_stage_groups(rank: int, tp_size: int, pp_size: int, own: StageGroup | None) -> None:
    """Every rank, right after the worker's process group is up: make each stage's group (a
    collective call: all ranks make all groups, in the same order) and fill in this rank's."""
    if pp_size == 1 or tp_size == 1:
        return  # one stage: the default group; one rank a stage: no all-reduce
    import torch.distributed as dist

    for stage in range(pp_size):
        ranks = stage_group(stage, tp_size).ranks
        group = dist.new_group(list(ranks))
        if own is not None and rank in ranks:
            own.group = group


class InFlightStep:
    """A launched step's logits: `result()` waits for them (at once where they are here).
    `pooled`: its embedding requests' pooled rows, where the step ran here whole (no stages)."""

    def __init__(
        self,
        logits: torch.Tensor | None = None,
        wait: Callable[[], torch.Tensor] | None = None,
        pooled: torch.Tensor | None = None,
    ):
        self._logits, self._wait, self.pooled = logits, wait, pooled

    def result(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self._wait()
        return self._logits


class StagePipe:
    """One rank's links to its neighbours in the pipeline: tp rank t of stage s receives from
    tp rank t of stage s-1 and sends to tp rank t of stage s+1; the last stage's tp rank 0
    sends the logits to rank 0."""

    def __init__(
        self,
        rank: int,
        tp_size: int,
        pp_size: int,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        timeout_s: float,
    ):
        self.rank, self.tp_size, self.pp_size = rank, tp_size, pp_size
        self.stage, self.tp_rank = divmod(rank, tp_size)
        self.first, self.last = self.stage == 0, self.stage == pp_size - 1
        self.hidden_size, self.vocab_size = cfg.hidden_size, cfg.vocab_size
        self.dtype, self.device = dtype, device
        self.timeout = timedelta(seconds=timeout_s)
        self._sending: list = []  # (work, tensor) of this stage's last send: kept alive until done

    @property
    def sends_logits(self) -> bool:
        """This rank computes the logits of each step and ships them to rank 0."""
        return self.last and self.tp_rank == 0 and self.rank != 0

    def receive_hidden(self, tokens: int) -> torch.Tensor:
        import torch.distributed as dist

        hidden = torch.empty(2, tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.irecv(hidden, src=self.rank - self.tp_size, tag=HIDDEN_TAG).wait(self.timeout)
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """Send without waiting for the next stage to take it (it may still run the previous
        step); the previous send is waited for first, so at most one is outstanding."""
        self._finish_send()
        work = torch.distributed.isend(hidden.contiguous(), dst=self.rank + self.tp_size, tag=HIDDEN_TAG)
        self._sending = [work, hidden]

    def send_logits(self, logits: torch.Tensor) -> None:
        self._finish_send()
        if logits.shape[0]:
            work = torch.distributed.isend(logits.contiguous(), dst=0, tag=LOGITS_TAG)
            self._sending = [work, logits]

    def expect_logits(self, rows: int) -> InFlightStep:
        """Rank 0: the logits of the step just launched, from the last stage (posted now, so
        that several steps' can be on their way, matched in order)."""
        logits = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=self.device)
        if not rows:
            return InFlightStep(logits)
        last = (self.pp_size - 1) * self.tp_size
        work = torch.distributed.irecv(logits, src=last, tag=LOGITS_TAG)

        def wait() -> torch.Tensor:
            work.wait(self.timeout)
            return logits

        return InFlightStep(wait=wait)

    def _finish_send(self) -> None:
        if self._sending:
            self._sending[0].wait(self.timeout)
            self._sending = []
