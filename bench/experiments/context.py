"""What every experiment shares: flags, the model (loaded once, reused by every engine it
builds), a warm-up, and a new Report with the run's header filled in."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagemesh.bench.experiments.report import Report, load_average
from pagemesh.common.model_files import resolve_model_path, served_model_name
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig

DEFAULT_NUM_PAGES = 1025  # 16,384 token slots at 16 per page: ample for every workload here


@dataclass
class Context:
    name: str
    out: Path
    command: str
    quick: bool = False
    seed: int = 0
    model_path: str | None = None  # None: the embedded default model
    threads: int = 1  # torch threads of in-process engines (see `default_threads`)
    started: float = field(default_factory=time.monotonic)
    load_at_start: str = field(default_factory=load_average)
    _model: object = field(default=None, repr=False)
    _dtype: str = ""

    @property
    def model_name(self) -> str:
        return served_model_name(resolve_model_path(self.model_path))

    def report(self, title: str) -> Report:
        return Report(
            self.name,
            title,
            self.command,
            model=self.model_label(),
            seed=self.seed,
            threads=self.threads,
            started=self.started,
            load_at_start=self.load_at_start,
        )

    def model_label(self) -> str:
        dtype = self._dtype or str(EngineConfig().resolve_dtype(EngineConfig().resolve_device())).removeprefix("torch.")
        return f"{self.model_name} ({dtype})"

    def model(self):
        """The model, loaded on first use; every engine of the run shares its weights."""
        if self._model is None:
            from pagemesh.workers.model.loader import load_model

            config = EngineConfig(model=self.model_path)
            device = config.resolve_device()
            dtype = config.resolve_dtype(device)
            self._model = load_model(resolve_model_path(self.model_path), dtype, device)
            self._dtype = str(dtype).removeprefix("torch.")
        return self._model

    def engine(self, **config):
        """A fresh Engine over the shared weights (token-id prompts only: no tokenizer), warmed up.
        The previous engine's KV pool is freed first when the caller dropped it."""
        from pagemesh.workers.engine.engine import Engine

        gc.collect()
        config.setdefault("num_pages", DEFAULT_NUM_PAGES)
        engine = Engine(EngineConfig(model=self.model_path, seed=self.seed, **config), model=self.model())
        warm_up(engine)
        return engine


def default_threads() -> int:
    """Every core on an idle machine; one when others are busy: with the cores oversubscribed,
    two OpenMP threads that wait for each other make a step many times slower than one thread
    (measured here: a batch-16 decode step 0.26 s with 1 thread, 1.4-5.8 s with 2, at load 8)."""
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] >= 0.5 * cores
    except OSError:
        busy = False
    return 1 if busy else cores


def warm_up(engine) -> None:
    """One short request through prefill and decode, so the first measured step pays no one-time
    costs; leaves the engine empty and its statistics reset."""
    from pagemesh.workers.engine.stats import EngineStats

    engine.add_request("warm-up", list(range(200, 264)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.stats = EngineStats()
    engine.scheduler.num_preemptions = 0
