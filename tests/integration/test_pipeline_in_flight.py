"""An engine of two pipeline stages with two steps in flight (workers/engine/in_flight.py): the
real second stage (a rank process, gloo point-to-point on loopback), this test process being
rank 0, on the tiny random Llama of test_tensor_parallel. Against a single-rank engine of the
same model and limits: the same greedy tokens over many concurrent requests (prefill chunks
beside decodes, n > 1, beam search, preemption by recompute and by swap, prefix-cache hits,
speculative decoding), an abort while its step is in flight (pages kept until the step returns, none leaked),
and the pipeline really held two steps at once (its counters, not a clock)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration import test_tensor_parallel as tp_tests
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.engine.model_input import ModelInput
from pagemesh.workers.engine.speculative import SpeculativeConfig, use_speculation
from pagemesh.workers.engine.step_trace import StepTrace

tiny_llama = tp_tests.tiny_llama
LIMITS = dict(dtype="float32", num_pages=40, page_size=4, max_num_batched_tokens=32, max_prefill_chunk=16)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """(one rank, two stages with up to two steps in flight), the same limits."""
    single = Engine(EngineConfig(model=str(tiny_llama), **LIMITS))
    pipelined = Engine(EngineConfig(model=str(tiny_llama), pipeline_parallel_size=2, **LIMITS))
    try:
        assert pipelined.scheduler.in_flight.depth == 2 and pipelined.runner.kv_cache.shape[0] == 1  # its layer
        yield single, pipelined
    finally:
        pipelined.close()
        torch.distributed.destroy_process_group()


def prompts(count: int, seed: int, shared: int = 16) -> list[list[int]]:
    """`count` prompts of 5..40 tokens; the even ones start with the same `shared` tokens."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (shared,), generator=gen).tolist()
    out = []
    for i in range(count):
        own = torch.randint(0, 256, (5 + (i * 7) % 36,), generator=gen).tolist()
        out.append(prefix + own if i % 2 == 0 else own)
    return out


def tokens(engine: Engine, batch: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    return [r.token_ids for r in engine.generate(batch, params)]


def assert_no_page_leaked(engine: Engine) -> None:
    assert not engine.scheduler.has_work() and not engine.scheduler.in_flight
    assert engine.blocks.num_used_pages == 0
    engine.blocks.check_invariants([])


def test_many_requests_in_flight_give_the_single_rank_engines_tokens(engines, tmp_path):
    single, pipelined = engines
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batch = prompts(8, seed=3)
    params = [greedy] * 8
    params[1] = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    params[4] = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2, use_beam_search=True)
    steps = pipelined.scheduler.in_flight
    launched, overlapped = steps.launched, steps.overlapped
    preemptions, hits, applied = (
        pipelined.scheduler.num_preemptions,
        pipelined.blocks.prefix_hits,
        pipelined.stats.steps,
    )
    want = tokens(single, batch, params)
    pipelined.step_trace = StepTrace(tmp_path)  # what the simulator's fit reads: one line a step
    try:
        got = tokens(pipelined, batch, params)
    finally:
        pipelined.step_trace.file.close()
        pipelined.step_trace = None
    assert got == want
    assert steps.overlapped > overlapped and steps.peak == 2  # a step launched while another was in the pipe
    assert pipelined.stats.steps - applied == steps.launched - launched  # every launched step counted once
    (trace,) = tmp_path.glob("steps-*.jsonl")
    assert len(trace.read_text().splitlines()) == steps.launched - launched
    assert pipelined.scheduler.num_preemptions > preemptions  # 39 pages of 4 for ~300 tokens
    assert pipelined.blocks.prefix_hits > hits
    assert_no_page_leaked(pipelined)


def test_swapping_out_and_in_while_steps_are_in_flight(engines):
    """Preemption by swap (a scheduler switch on the loaded engine): pages go to host memory and
    back on every stage in launch order, a preempted sequence never in flight; same tokens."""
    single, pipelined = engines
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = prompts(6, seed=13, shared=0)
    want = tokens(single, batch, [greedy] * 6)
    scheduler = pipelined.scheduler
    recompute = scheduler.config
    moves = []
    move_pages = pipelined.runner.move_pages
    pipelined.runner.move_pages = lambda step: (moves.append(bool(step.swap_out or step.swap_in)), move_pages(step))
    scheduler.config = dataclasses.replace(recompute, preemption_mode="swap", swap_pages=64)
    try:
        got = tokens(pipelined, batch, [greedy] * 6)
    finally:
        scheduler.config = recompute
        pipelined.runner.move_pages = move_pages
    assert got == want
    assert sum(moves) > 0 and not pipelined.runner.host_pages and scheduler.swapped_pages == 0
    assert_no_page_leaked(pipelined)
    # a preemption that leaves nothing to run still moves pages, on every stage: a step of no tokens
    pipelined.runner.launch(ModelInput([], [], [], [], [], [], swap_out=[(-1, [1, 2])])).result()
    assert pipelined.runner.host_pages[-1].shape[1] == 2
    pipelined.runner.launch(ModelInput([], [], [], [], [], [], swap_discard=[-1])).result()
    assert not pipelined.runner.host_pages and pipelined.followers.procs[0].poll() is None


def test_an_abort_while_in_flight_keeps_the_pages_until_the_step_returns(engines):
    single, pipelined = engines
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batch = prompts(4, seed=5)
    want = tokens(single, batch[1:], [greedy] * 3)
    for i, prompt in enumerate(batch):
        pipelined.add_request(f"r{i}", prompt, greedy)
    victim = pipelined.requests["r0"].seqs[0]
    steps = pipelined.scheduler.in_flight
    collected: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}

    def step() -> None:
        for out in pipelined.step():
            collected[out.request_id] += out.outputs[0].new_token_ids if out.outputs else []

    while not (steps.holds(victim) and victim.num_output_tokens > 0):  # decoding, a step in the pipe
        assert not victim.finished, "r0 ended before it was seen in flight"
        step()
    pages = list(victim.block_table)
    before = len(collected["r0"])
    assert pipelined.abort("r0")
    assert victim.block_table == pages and not set(pages) & set(pipelined.blocks.free)  # the stages still write them
    while pipelined.has_unfinished() or pipelined.scheduler.has_work():
        step()
    assert victim.block_table == []  # freed once its step came back
    assert len(collected["r0"]) == before  # and its output was dropped
    assert [collected[f"r{i}"] for i in range(1, 4)] == [w[0] for w in want]
    assert_no_page_leaked(pipelined)


def test_speculative_decoding_in_flight_keeps_the_greedy_tokens(engines):
    single, pipelined = engines
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # prompts of one token repeated, after which this model repeats a token: drafts get accepted
    batch = [[t] * 12 for t in (26, 42, 67, 73)]
    want = tokens(single, batch, [greedy] * 4)
    stats = use_speculation(pipelined, SpeculativeConfig(num_speculative_tokens=3))
    try:
        got = tokens(pipelined, batch, [greedy] * 4)
    finally:
        use_speculation(pipelined, None)
    assert got == want
    assert stats.proposed > 0 and stats.accepted > 0
    assert_no_page_leaked(pipelined)
