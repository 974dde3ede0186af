"""Seeded workloads for in-process engines: prompts are random token ids (no tokenizer needed;
the engine's cost depends on lengths, not on which tokens), lengths drawn uniformly."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pagemesh.common.sampling import SamplingParams

FIRST_ORDINARY_TOKEN = 100  # below this the model's vocabulary holds special tokens


@dataclass(frozen=True)
class Job:
    """One request of a workload: `arrival` seconds after the start."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(length)]


def fixed_output(max_tokens: int, **extra) -> SamplingParams:
    """Exactly `max_tokens` tokens (EOS ignored), greedy unless `extra` says otherwise."""
    return SamplingParams(**({"temperature": 0.0} | extra), max_tokens=max_tokens, min_tokens=0, ignore_eos=True)


def mixed_jobs(
    rng: random.Random,
    count: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    arrivals: list[float] | None = None,
    prefix: str = "r",
) -> list[Job]:
    """`count` jobs with prompt and output lengths uniform in the inclusive ranges."""
    arrivals = arrivals or [0.0] * count
    jobs = []
    for i in range(count):
        prompt = random_prompt(rng, rng.randint(*prompt_range), vocab_size)
        jobs.append(Job(f"{prefix}{i}", prompt, fixed_output(rng.randint(*output_range)), arrivals[i]))
    return jobs
