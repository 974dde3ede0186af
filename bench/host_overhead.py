"""Host time of an engine decode step outside the model's forward: scheduling, attention
metadata, sampling, bookkeeping. On a GPU the forward of a step is a few milliseconds, so this
Python time is what stands between a step and its roofline; here a tiny model makes the forward
negligible, so the figures are the host's work alone.

    PYTHONPATH=. python bench/host_overhead.py [--steps 50]

Prints, per batch x context: ms per step, of which the forward (model call), the metadata build
(`AttentionMetadata.build`) and the scheduler (`schedule`), and the rest (sampling, updates,
outputs, stats), all greedy decode steps.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pagemesh.common.model_config import ModelConfig  # noqa: E402
from pagemesh.common.sampling import SamplingParams  # noqa: E402
from pagemesh.workers.attention import metadata as attention_module  # noqa: E402
from pagemesh.workers.engine.config import EngineConfig  # noqa: E402
from pagemesh.workers.engine.engine import Engine  # noqa: E402
from pagemesh.workers.model.loader import build_random_model  # noqa: E402

TINY = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)
CASES = [(1, 1024), (32, 1024), (128, 1024), (128, 4096), (256, 2048)]
PAGE = 16


class Timed:
    """Wraps a callable and sums the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def measure(model, batch: int, context: int, steps: int) -> dict[str, float]:
    pages = batch * (-(-(context + steps + 8) // PAGE)) + 8
    engine = Engine(
        EngineConfig(
            device="cpu",
            dtype="float32",
            page_size=PAGE,
            num_pages=pages,
            max_model_len=context + steps + 16,
            max_num_seqs=batch,
            max_num_batched_tokens=max(8192, context),
            max_prefill_chunk=context,
            max_num_partial_prefills=batch,
            enable_prefix_caching=False,
        ),
        model=model,
    )
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(i + j) % 255 + 1 for j in range(context)], params)
    while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    engine.step()
    runner, scheduler = engine.runner, engine.scheduler
    forward, schedule = Timed(runner.model), Timed(scheduler.schedule)
    metadata_cls = attention_module.AttentionMetadata
    original_build = metadata_cls.__dict__["build"]  # the classmethod itself, put back below
    build = Timed(metadata_cls.build)
    runner.model, scheduler.schedule = forward, schedule
    metadata_cls.build = build
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    finally:
        metadata_cls.build = original_build
    ms = lambda s: 1e3 * s / steps  # noqa: E731
    return {
        "step": ms(total),
        "forward": ms(forward.seconds),
        "metadata": ms(build.seconds),
        "schedule": ms(schedule.seconds),
        "rest": ms(total - forward.seconds - build.seconds - schedule.seconds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    model = build_random_model(TINY, torch.float32, torch.device("cpu"))
    print("| batch | context | step ms | forward ms | host ms | metadata ms | schedule ms | rest ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch, context in CASES:
        r = measure(model, batch, context, opts.steps)
        print(
            f"| {batch} | {context} | {r['step']:.2f} | {r['forward']:.2f} | {r['step'] - r['forward']:.2f} | "
            f"{r['metadata']:.2f} | {r['schedule']:.2f} | {r['rest']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
