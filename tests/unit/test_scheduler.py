"""Local scheduler: token budget, decodes first, chunking, preemption by recompute."""

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.scheduler import Scheduler, StepSchedulerConfig
from pagemesh.workers.engine.sequence import SeqStatus, Sequence


def make_seq(n: int, rid: str) -> Sequence:
    return Sequence(rid, 0, list(range(1, n + 1)), n, SamplingParams(temperature=0, max_tokens=100))


def run_plan(plan, next_token=7):
    """What the engine does after the runner: advance computed tokens, sample at the end."""
    for c in plan.chunks:
        c.seq.num_computed += c.num_tokens
        if c.samples:
            c.seq.append_token(next_token, None)


def test_prompt_is_chunked_to_the_budget_and_decodes_go_first():
    bm = BlockManager(100, 4)
    s = Scheduler(StepSchedulerConfig(max_num_batched_tokens=8, max_prefill_chunk=8), bm)
    short, long = make_seq(3, "short"), make_seq(20, "long")
    s.add(short)
    s.add(long)
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("short", 0, 3), ("long", 0, 5)]
    run_plan(plan)
    plan = s.schedule()  # short decodes (1 token) first, long continues with the rest of the budget
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("short", 3, 1), ("long", 5, 7)]
    assert plan.num_decodes == 1
    assert not plan.chunks[1].samples
    run_plan(plan)
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("short", 4, 1), ("long", 12, 7)]
    run_plan(plan)
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("short", 5, 1), ("long", 19, 1)]
    assert plan.chunks[1].samples  # the prompt's last token: sample the first output token
    bm.check_invariants([x.block_table for x in s.live_sequences])


def test_out_of_pages_preempts_the_newest_and_recomputes_it_later():
    bm = BlockManager(4, 4)  # 3 usable pages
    s = Scheduler(StepSchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=64), bm)
    a, b = make_seq(4, "a"), make_seq(4, "b")
    s.add(a)
    s.add(b)
    run_plan(s.schedule())  # both prompts: 1 page each, then one token each appended
    assert bm.num_free_pages == 1
    plan = s.schedule()  # both need a new page for position 4; only one is free
    assert [c.seq.request_id for c in plan.chunks] == ["a"]
    assert plan.preempted == [b] and b.status is SeqStatus.WAITING
    assert b.num_computed == 0 and b.block_table == [] and b.token_ids == [1, 2, 3, 4, 7]
    bm.check_invariants([x.block_table for x in s.live_sequences])
    run_plan(plan)
    s.finish(a, "stop")
    plan = s.schedule()  # b comes back and recomputes prompt + the token it had
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("b", 0, 5)]
    assert plan.chunks[0].samples
    bm.check_invariants([x.block_table for x in s.live_sequences])


def test_admission_respects_max_num_seqs_and_partial_prefill_cap():
    bm = BlockManager(100, 4)
    s = Scheduler(StepSchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_prefill_chunk=100), bm)
    for i in range(3):
        s.add(make_seq(5, f"r{i}"))
    plan = s.schedule()
    assert [c.seq.request_id for c in plan.chunks] == ["r0", "r1"]
    assert [x.request_id for x in s.waiting] == ["r2"]
    s2 = Scheduler(
        StepSchedulerConfig(max_num_batched_tokens=8, max_prefill_chunk=4, max_num_partial_prefills=1),
        BlockManager(100, 4),
    )
    for i in range(2):
        s2.add(make_seq(10, f"p{i}"))
    plan = s2.schedule()  # p0 is mid-prefill: p1 waits although budget remains
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("p0", 4)]


def test_prefix_cache_hit_skips_computed_pages():
    bm = BlockManager(100, 4)
    s = Scheduler(StepSchedulerConfig(), bm)
    first = make_seq(10, "first")
    s.add(first)
    plan = s.schedule()
    run_plan(plan)
    first.num_cached_pages = bm.cache_full_pages(first.block_table, first.token_ids, 0, first.num_computed)
    s.finish(first, "stop")
    second = make_seq(10, "second")
    s.add(second)
    plan = s.schedule()
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(8, 2)]
    assert second.num_prefix_hit_tokens == 8


def make_prio(n: int, rid: str, priority: int) -> Sequence:
    return Sequence(rid, 0, list(range(1, n + 1)), n, SamplingParams(temperature=0, max_tokens=100, priority=priority))


def test_waiting_is_ordered_by_priority_then_arrival_and_victims_are_lowest_priority():
    bm = BlockManager(100, 4)
    s = Scheduler(StepSchedulerConfig(max_num_seqs=2), bm)
    for rid, prio in (("late-normal", 0), ("urgent", -1), ("background", 5), ("normal", 0)):
        s.add(make_prio(4, rid, prio))
    assert [x.request_id for x in s.waiting] == ["urgent", "late-normal", "normal", "background"]
    plan = s.schedule()
    assert [c.seq.request_id for c in plan.chunks] == ["urgent", "late-normal"]


def test_preemption_picks_the_lowest_priority_running_sequence():
    bm = BlockManager(4, 4)  # 3 usable pages
    s = Scheduler(StepSchedulerConfig(), bm)
    low, high = make_prio(4, "low", 3), make_prio(4, "high", 0)
    s.add(low)
    s.add(high)
    run_plan(s.schedule())
    plan = s.schedule()  # both need a page, one is free: the low-priority one goes
    assert plan.preempted == [low]
    assert [c.seq.request_id for c in plan.chunks] == ["high"]


def test_short_prompts_pass_a_long_one_when_long_prefills_are_capped():
    bm = BlockManager(1000, 4)
    cfg = StepSchedulerConfig(
        max_num_batched_tokens=64, max_prefill_chunk=32, long_prefill_threshold=100, max_long_partial_prefills=1
    )
    s = Scheduler(cfg, bm)
    for rid, n in (("long-1", 300), ("long-2", 300), ("short", 10)):
        s.add(make_seq(n, rid))
    plan = s.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("long-1", 32), ("short", 10)]


def test_request_level_batching_admits_nothing_until_the_batch_is_done():
    bm = BlockManager(100, 4)
    s = Scheduler(StepSchedulerConfig(max_num_seqs=2, batching="request"), bm)
    a, b, c = make_seq(4, "a"), make_seq(4, "b"), make_seq(4, "c")
    for x in (a, b, c):
        s.add(x)
    run_plan(s.schedule())
    s.finish(a, "stop")
    plan = s.schedule()  # a slot is free, but c must wait for b
    assert [x.seq.request_id for x in plan.chunks] == ["b"]
    run_plan(plan)
    s.finish(b, "stop")
    assert [x.seq.request_id for x in s.schedule().chunks] == ["c"]


def test_swap_preemption_moves_pages_to_host_and_back():
    bm = BlockManager(4, 4)
    s = Scheduler(StepSchedulerConfig(preemption_mode="swap", swap_pages=8), bm)
    a, b = make_seq(4, "a"), make_seq(4, "b")
    s.add(a)
    s.add(b)
    run_plan(s.schedule())
    b_pages = list(b.block_table)
    plan = s.schedule()
    assert plan.preempted == [b] and plan.swap_out == [(b.seq_id, b_pages)]
    assert b.swapped_computed == 4 and s.swapped_pages == 1
    run_plan(plan)
    s.finish(a, "stop")
    plan = s.schedule()  # b comes back without recomputing its 4 tokens
    assert plan.swap_in == [(b.seq_id, b.block_table[:1])]
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("b", 4, 1)]
    assert s.swapped_pages == 0 and b.swapped_computed is None
    bm.check_invariants([x.block_table for x in s.live_sequences])


def test_a_waiting_sequence_that_does_not_fit_gives_back_its_prefix_hits():
    """Regression: waiting sequences kept the cached pages they matched and starved everyone."""
    bm = BlockManager(5, 4)  # 4 usable pages
    s = Scheduler(StepSchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=64), bm)
    first = make_seq(9, "first")
    s.add(first)
    run_plan(s.schedule())
    first.num_cached_pages = bm.cache_full_pages(first.block_table, first.token_ids, 0, first.num_computed)
    blocker = make_seq(8, "blocker")  # takes both never-cached free pages
    s.finish(first, "stop")
    s.add(blocker)
    s.add(make_seq(9, "same-prefix"))
    hog = make_seq(12, "hog")
    s.add(hog)
    s.schedule()
    waiting = [x for x in s.waiting]
    assert all(not x.block_table and x.num_computed == 0 for x in waiting)
    bm.check_invariants([x.block_table for x in s.live_sequences])


def test_a_sequence_with_pages_freed_behind_its_window_is_recomputed_not_swapped():
    """A swapped-in table comes back whole and is published to the prefix cache as such, so a table
    whose leading pages a sliding window freed (null-page entries) is preempted by recompute."""
    bm = BlockManager(6, 2, enable_prefix_caching=False, window=4)  # 5 usable pages of 2 tokens
    s = Scheduler(StepSchedulerConfig(preemption_mode="swap", swap_pages=8), bm)
    a, b = make_seq(3, "a"), make_seq(8, "b")
    s.add(a)
    s.add(b)

    def step():
        plan = s.schedule()
        run_plan(plan)
        for c in plan.chunks:  # what the engine's update does after each step
            bm.free_passed(c.seq.block_table, c.seq.num_computed, c.seq.num_cached_pages)
        return plan

    step()  # a's prompt, 6 of b's 8 tokens; b's first page falls behind its window
    assert a.block_table == [1, 2] and b.block_table == [0, 4, 5]
    step()  # b's last 2 prompt tokens, on the page it freed
    assert b.block_table == [0, 0, 5, 3] and list(bm.free) == [4]
    plan = s.schedule()  # a takes the last free page for position 4; b needs one for position 8
    assert plan.preempted == [b] and plan.swap_out == [] and b.swapped_computed is None
    assert b.num_computed == 0 and b.block_table == [] and s.swapped_pages == 0
    bm.check_invariants([a.block_table])
