"""The local scheduler with pipeline steps in flight (workers/engine/in_flight.py): a request with
a step in flight is not planned again until that step's output is applied; plans split the live
sequences into micro-batches; a request's sequences stay together; preemption spares in-flight
sequences; an abort in flight keeps the pages until the step returns and drops its rows; the
prefix cache only learns a page after its step returns. Pure logic, exact expectations."""

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.in_flight import StepsInFlight, surviving_rows
from pagemesh.workers.engine.scheduler import ScheduledChunk, Scheduler, StepPlan, StepSchedulerConfig
from pagemesh.workers.engine.sequence import Sequence


def make_seq(n: int, rid: str, index: int = 0, **params) -> Sequence:
    sampling = SamplingParams(temperature=0, max_tokens=100, **params)
    return Sequence(rid, index, list(range(1, n + 1)), n, sampling)


def pipelined(num_pages: int = 100, depth: int = 2, **limits) -> tuple[Scheduler, BlockManager]:
    limits.setdefault("max_num_batched_tokens", 64)
    limits.setdefault("max_prefill_chunk", 64)
    bm = BlockManager(num_pages, 4)
    return Scheduler(StepSchedulerConfig(max_steps_in_flight=depth, **limits), bm), bm


def launch(s: Scheduler) -> StepPlan:
    plan = s.schedule()
    s.in_flight.launch(plan, handle=None, started=0.0)
    return plan


def apply_oldest(s: Scheduler, bm: BlockManager, next_token: int = 7) -> StepPlan:
    """What the engine does when the oldest step's logits are back: free what ended in flight,
    then advance the survivors (publishing full pages) and sample at the end of each."""
    plan = s.in_flight.oldest().plan
    s.step_returned(plan)
    for c in plan.chunks:
        if c.seq.finished:
            continue
        c.seq.num_computed += c.num_tokens
        c.seq.num_cached_pages = bm.cache_full_pages(
            c.seq.block_table, c.seq.token_ids, c.seq.num_cached_pages, c.seq.num_computed
        )
        if c.samples:
            c.seq.append_token(next_token, None)
    return plan


def rids(plan: StepPlan) -> list[str]:
    return [c.seq.request_id for c in plan.chunks]


def test_the_live_sequences_take_turns_in_micro_batches_and_none_is_in_two_steps():
    s, bm = pipelined()
    for i in range(4):
        s.add(make_seq(3, f"r{i}"))
    assert rids(launch(s)) == ["r0", "r1"]  # 4 live sequences, 2 stages: 2 a micro-batch
    assert rids(launch(s)) == ["r2", "r3"]  # admitted while the first step is in flight
    assert s.in_flight.full and s.in_flight.overlapped == 1 and s.in_flight.peak == 2
    assert s.schedule().empty  # everything is in flight
    apply_oldest(s, bm)
    plan = launch(s)  # r0, r1 decode; r2, r3 are still in the pipe
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("r0", 3, 1), ("r1", 3, 1)]
    apply_oldest(s, bm)
    assert rids(s.schedule()) == ["r2", "r3"]
    bm.check_invariants([x.block_table for x in s.live_sequences])


def test_a_requests_sequences_stay_together_past_the_micro_batch_share():
    s, bm = pipelined()
    a0, a1 = make_seq(3, "a", 0), make_seq(3, "a", 1)
    s.add(a0)
    s.add(a1)
    s.add(make_seq(3, "b"))
    # 3 live, 2 stages: a share of 2, and a's second sequence joins its first
    assert rids(launch(s)) == ["a", "a"]
    assert rids(launch(s)) == ["b"]


def test_a_prompt_still_in_flight_is_not_continued_nor_matched_in_the_prefix_cache():
    s, bm = pipelined(max_num_batched_tokens=8, max_prefill_chunk=8)
    first = make_seq(16, "first")
    s.add(first)
    assert [(c.start, c.num_tokens) for c in launch(s).chunks] == [(0, 8)]
    assert s.schedule().empty  # its next chunk waits for this one to come back
    apply_oldest(s, bm)
    launch(s)  # tokens 8..16: pages 3 and 4 are computed in flight
    twin = make_seq(16, "twin")
    s.add(twin)
    launch(s)
    assert twin.num_prefix_hit_tokens == 8  # the two pages of the step that returned, not the in-flight ones
    apply_oldest(s, bm)
    later = make_seq(16, "later")
    s.add(later)
    s.schedule()
    assert later.num_prefix_hit_tokens == 12  # published once back (a prompt's last token always runs)


def test_preemption_never_picks_a_sequence_in_flight():
    s, bm = pipelined(num_pages=3)  # 2 usable pages
    a, b = make_seq(4, "a"), make_seq(4, "b")  # b is the newer: the victim a step at a time would pick
    s.add(a)
    s.add(b)
    assert rids(launch(s)) == ["a"] and rids(launch(s)) == ["b"]  # a page each: none left
    apply_oldest(s, bm)  # a is back with a token: it needs a second page
    plan = s.schedule()
    assert plan.empty and plan.preempted == [a]  # b runs in the pipe: a gives way itself
    assert b.block_table and not a.block_table and bm.num_free_pages == 1
    bm.check_invariants([x.block_table for x in s.live_sequences])


def test_an_abort_in_flight_frees_its_pages_when_the_step_returns_and_drops_its_rows():
    s, bm = pipelined()
    a, b = make_seq(6, "a", prompt_logprobs=1), make_seq(5, "b")
    s.add(a)
    s.add(b)
    s.in_flight.depth = 1  # one micro-batch holding both
    plan = launch(s)
    pages_a = list(a.block_table)
    s.finish(a, "abort")  # the engine's abort while the step runs
    assert a.block_table == pages_a and not any(p in bm.free for p in pages_a)  # still written by the stages
    survivors, rows = surviving_rows(plan)
    # rows: sampled [a, b] then a's prompt rows [0..4]: only b's sampled row is left
    assert rids(survivors) == ["b"] and rows == [1]
    apply_oldest(s, bm)
    assert a.block_table == [] and b.num_computed == 5
    s.finish(b, "stop")
    assert bm.num_used_pages == 0
    bm.check_invariants([])


def test_surviving_rows_keep_the_plan_when_nothing_ended():
    seq = make_seq(3, "x")
    assert surviving_rows(StepPlan(chunks=[ScheduledChunk(seq, 0, 3)])) is None


def test_without_a_pipeline_nothing_is_tracked():
    s = Scheduler(StepSchedulerConfig(), BlockManager(10, 4))
    assert s.in_flight is None
    assert StepsInFlight(2).batch_cap(5) == 3
