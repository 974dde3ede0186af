"""The executor boundary: the plain-data ModelInput built from a step plan."""

import dataclasses

import msgpack

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.model_input import ModelInput, build_model_input
from pagemesh.workers.engine.scheduler import ScheduledChunk, Scheduler, StepPlan, StepSchedulerConfig
from pagemesh.workers.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def seq(tokens, params=GREEDY, table=()):
    return Sequence("r", 0, list(tokens), len(tokens), params, block_table=list(table))


def test_decodes_and_a_chunk_flatten_in_plan_order():
    a = seq(range(10, 51), table=[3, 4, 5])  # 41 tokens: a decode of token 40
    b = seq([7] * 8, table=[9])
    c = seq([1, 2, 3, 4, 5, 6], table=[11, 12])  # a prompt, run in two chunks
    plan = StepPlan(
        [ScheduledChunk(a, 40, 1), ScheduledChunk(b, 7, 1), ScheduledChunk(c, 0, 4)],
        page_copies=[(2, 6)],
        swap_out=[(5, [1, 2])],
        swap_in=[(6, [7])],
        swap_discard=[8],
        num_decodes=2,
    )
    step = build_model_input(plan)
    assert step == ModelInput(
        token_ids=[50, 7, 1, 2, 3, 4],
        query_lens=[1, 1, 4],
        seq_lens=[41, 8, 4],
        block_tables=[[3, 4, 5], [9], [11, 12]],
        sample_rows=[0, 1],
        prompt_logprob_rows=[],
        num_decodes=2,
        page_copies=[(2, 6)],
        swap_out=[(5, [1, 2])],
        swap_in=[(6, [7])],
        swap_discard=[8],
    )
    assert step.logit_rows == [0, 1]
    final = build_model_input(StepPlan([ScheduledChunk(c, 4, 2)]))
    assert (final.token_ids, final.sample_rows, final.seq_lens) == ([5, 6], [1], [6])  # the prompt's end samples


def test_prompt_logprob_rows_follow_the_sampled_rows():
    scored = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1)
    d = seq([7] * 5, table=[2])
    p = seq([1, 2, 3, 4, 5], params=scored, table=[3, 4])
    step = build_model_input(StepPlan([ScheduledChunk(d, 4, 1), ScheduledChunk(p, 0, 5)], num_decodes=1))
    # p's positions 0..3 predict its prompt tokens 1..4 (rows 1..4 of the flat batch); row 5 samples
    assert step.sample_rows == [0, 5] and step.prompt_logprob_rows == [1, 2, 3, 4]
    assert step.logit_rows == [0, 5, 1, 2, 3, 4]


def test_a_scheduled_plan_is_plain_data_that_msgpack_round_trips():
    blocks = BlockManager(32, 4)
    scheduler = Scheduler(StepSchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=16), blocks)
    for n in (3, 9):
        scheduler.add(seq(range(1, n + 1)))
    step = build_model_input(scheduler.schedule())
    fields = dataclasses.asdict(step)
    assert msgpack.unpackb(msgpack.packb(fields), use_list=True, strict_map_key=False) == {
        k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, list) else v for k, v in fields.items()
    }
    assert step.block_tables == [[1], [2, 3, 4]] and step.query_lens == [3, 9] and step.sample_rows == [2, 11]
