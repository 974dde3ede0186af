"""The draft-length policy (workers/engine/draft_length.py): acceptance estimates, the step-cost fit,
and the per-step choice of how many drafts each sequence verifies."""

import subprocess
import sys

import pytest

from pagemesh.workers.engine.draft_length import (
    PROBE_EVERY,
    Acceptance,
    DraftLengths,
    StepCost,
    choose,
    expected_tokens,
)


def _cost(fixed: float, per_row: float, rows=(1, 2, 4, 8, 16, 32, 64)) -> StepCost:
    cost = StepCost()
    for _ in range(20):
        for r in rows:
            cost.observe(r, fixed + per_row * r)
    return cost


def test_the_fit_recovers_a_measured_line_and_keeps_the_prior_shape_before_any_step():
    assert StepCost().fit() == (1.0, 1 / 16)
    fixed, per_row = _cost(0.012, 0.0007).fit()
    assert fixed == pytest.approx(0.012, rel=0.05) and per_row == pytest.approx(0.0007, rel=0.05)
    one_size = StepCost()  # every step the same size: the slope comes from the prior's shape
    for _ in range(50):
        one_size.observe(4, 0.02)
    fixed, per_row = one_size.fit()
    assert fixed + 4 * per_row == pytest.approx(0.02) and per_row / fixed == pytest.approx(1 / 16, rel=0.01)


def test_a_stall_counts_at_most_four_predicted_steps():
    cost = _cost(0.01, 0.001)
    before = cost.time(8)
    cost.observe(8, 60.0)  # the engine sat idle between two runs
    assert cost.time(8) < 1.2 * before


def test_low_acceptance_verifies_no_drafts_and_high_acceptance_at_one_row_verifies_all():
    cost = _cost(0.012, 0.0007)
    assert choose([0.02], [4], 1, cost, 64) == [0]
    assert choose([0.95], [4], 1, cost, 64) == [4]
    assert choose([0.95], [2], 1, cost, 64) == [2]  # never more than were proposed
    assert choose([0.95], [4], 1, cost, 3) == [3]  # nor past the step's budget


def test_larger_batches_verify_fewer_drafts():
    cost = _cost(0.012, 0.0007)
    totals = [sum(choose([0.7] * 4, [8] * 4, rows, cost, 10_000)) for rows in (4, 16, 64, 256)]
    assert totals[0] > totals[1] > totals[2] >= totals[3]
    assert totals[0] >= 4 and totals[-1] == 0


def test_a_cliff_in_the_step_time_keeps_the_batch_below_it():
    """A kernel that changes path from 65 rows (3x the step): the line alone would verify every
    draft of 32 sure sequences (160 rows); the bins stop the step at 64 rows."""
    line = _cost(0.012, 0.0007)
    assert sum(choose([0.99] * 32, [4] * 32, 32, line, 10_000)) == 128
    cliff = StepCost()
    for _ in range(5):
        for r in range(1, 200):
            cliff.observe(r, (0.012 + 0.0007 * r) * (3 if r > 64 else 1))
    ks = choose([0.99] * 32, [4] * 32, 32, cliff, 10_000)
    assert sum(ks) == 32 and max(ks) == 1  # 64 rows: one draft each (equal rates: spread evenly)


def test_the_better_sequence_gets_the_drafts_first():
    cost = _cost(0.012, 0.0007)
    ks = choose([0.3, 0.97], [8, 8], 32, cost, 10_000)
    assert ks[1] > ks[0] and ks[1] >= 4


def test_the_choice_maximises_expected_tokens_per_second():
    """Against every allocation of up to 4 drafts to each of three sequences (brute force)."""
    cost = _cost(0.01, 0.002)
    rates, rows = [0.9, 0.6, 0.3], 8

    def speed(ks):
        tokens = rows - len(ks) + sum(expected_tokens(a, k) for a, k in zip(rates, ks))
        return tokens / cost.time(rows + sum(ks))

    best = max(((a, b, c) for a in range(5) for b in range(5) for c in range(5)), key=speed)
    assert speed(choose(rates, [4, 4, 4], rows, cost, 10_000)) == pytest.approx(speed(best))


def test_expected_tokens():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1


def test_acceptance_is_per_sequence_geometric_and_seeded_from_the_engine_wide_rate():
    acc = Acceptance()
    for _ in range(10):
        acc.record("quoting", 4, 4)  # every draft kept: no failure observed
        acc.record("chat", 4, 0)  # the first draft missed: one failure, the rest never tested
    assert acc.rate("quoting") > 0.95 and acc.rate("chat") < 0.05
    assert acc.global_rate == pytest.approx(40 / 50)  # 40 kept of 50 tested
    assert acc.rate("new") == pytest.approx(acc.global_rate)
    acc.record("half", 4, 2)  # 2 kept, then a miss: 2/3 under the geometric model
    acc.forget("quoting")
    assert acc.rate("quoting") == pytest.approx(acc.global_rate)


def test_a_sequence_held_at_zero_probes_one_draft_now_and_then():
    policy = DraftLengths()
    for _ in range(20):
        policy.acceptance.record(7, 4, 0)
    got = [policy.lengths([7], [4], 1, 64)[0] for _ in range(2 * PROBE_EVERY)]
    assert got.count(1) == 2 and set(got) == {0, 1}


def test_steps_are_timed_from_one_plan_to_the_next_and_empty_plans_are_skipped():
    policy = DraftLengths()
    policy.step_started(10.0)
    policy.planned(4)
    policy.step_started(10.5)  # the 4-row step took 0.5 s
    policy.planned(0)
    policy.step_started(99.0)  # nothing ran: not a sample
    assert policy.cost.w == 1 and policy.cost.sy == pytest.approx(0.5) and policy.cost.sx == 4


def test_the_policy_is_pure():
    code = "import sys, pagemesh.workers.engine.draft_length as m; assert not {'torch', 'zmq'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_scheduler_cuts_each_proposal_to_the_policys_length():
    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.block_manager import BlockManager
    from pagemesh.workers.engine.scheduler import Scheduler, StepSchedulerConfig
    from pagemesh.workers.engine.sequence import Sequence
    from pagemesh.workers.engine.speculative import SpeculativeConfig, Speculator

    def plan_drafts(max_decode_rows, acceptance):
        spec = Speculator(SpeculativeConfig(prompt_lookup_min=1, max_decode_rows=max_decode_rows), 256)
        spec.policy.cost = _cost(0.012, 0.0007)
        s = Scheduler(StepSchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=64), BlockManager(64, 4), spec)
        seqs = [
            Sequence("r", i, [1, 2, 3, 4, 5, 6, 7, 1], 8, SamplingParams(temperature=0, max_tokens=99))
            for i in range(2)
        ]
        for seq in seqs:
            s.add(seq)
        for c in s.schedule().chunks:
            c.seq.num_computed += c.num_tokens
        for seq in seqs:
            seq.append_token(2, None)  # tokens end in [1, 2]: the proposal is 3, 4, 5, 6
            for _ in range(20):
                spec.stats.record(4, acceptance[seq.index], seq.seq_id)
        return [c.drafts for c in s.schedule().chunks]

    assert plan_drafts(None, [4, 0]) == [[], [3, 4, 5, 6]]  # the plain decode first, then the drafts
    assert plan_drafts(8, [4, 0]) == [[3, 4, 5, 6], [3, 4, 5, 6]]  # the old fixed rule: every draft
    assert plan_drafts(1, [4, 4]) == [[], []]  # ... and its cut-off


def test_a_new_sequence_is_read_optimistically_until_its_own_passes_speak():
    acc = Acceptance()
    for _ in range(50):
        acc.record("chat", 4, 0)
    acc.forget("chat")
    low = acc.global_rate
    assert low < 0.05 and acc.rate("new") == pytest.approx(low)
    assert acc.optimistic("new") > low + 0.1  # one standard error of nothing seen yet
    for _ in range(3):
        acc.record("new", 1, 0)
    assert acc.optimistic("new") < low + 0.1
