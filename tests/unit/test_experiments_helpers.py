"""pagemesh.bench.experiments: contiguous-allocation arithmetic, per-token traces and their summary,
and the wall-clock driver (against a fake engine), with exact numbers."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pagemesh.bench.experiments.cow import saving
from pagemesh.bench.experiments.driver import Run, Trace, drive, summarize
from pagemesh.bench.experiments.paged_memory import contiguous_reservation, sequences_that_fit, utilization
from pagemesh.bench.experiments.workload import Job, fixed_output, mixed_jobs
from pagemesh.common.sampling import SamplingParams


# ---- contiguous allocation -----------------------------------------------------------------
def test_contiguous_reservation_policies():
    assert contiguous_reservation(100, 50, 2048, "max_model_len") == 2048
    assert contiguous_reservation(100, 50, 2048, "prompt+max_tokens") == 150
    assert contiguous_reservation(2000, 512, 2048, "prompt+max_tokens") == 2048  # capped by the context
    with pytest.raises(ValueError, match="policy"):
        contiguous_reservation(1, 1, 8, "paged")


def test_sequences_that_fit_admits_in_order_until_one_overflows():
    assert sequences_that_fit([2048] * 10, 8192) == 4
    assert sequences_that_fit([100, 200, 300], 300) == 2  # 100 + 200 fills it exactly
    assert sequences_that_fit([100, 5000, 1], 1000) == 1  # FCFS: the big one blocks the rest
    assert sequences_that_fit([10, 10], 1000) == 2
    assert sequences_that_fit([], 10) == 0


def test_utilization_is_the_mean_of_per_step_ratios():
    assert utilization([50, 100], [100, 400]) == pytest.approx((0.5 + 0.25) / 2)
    assert utilization([0, 30], [0, 60]) == pytest.approx(0.5)  # empty steps skipped
    assert utilization([], []) == 0.0


def test_copy_on_write_saving():
    assert saving(36, 80) == pytest.approx(0.55)
    assert saving(0, 0) == 0.0


# ---- traces and their summary ----------------------------------------------------------------
def test_trace_ttft_latency_and_gaps_per_choice():
    trace = Trace("r", arrival=1.0, prompt_len=10, token_times={0: [1.5, 1.7, 2.0], 1: [1.6, 2.1]}, finished=2.1)
    assert trace.ttft == pytest.approx(0.5)
    assert trace.latency == pytest.approx(1.1)
    assert trace.num_output_tokens == 5
    assert trace.itls() == pytest.approx([0.2, 0.3, 0.5])
    assert Trace("q", 0.0, 1).ttft is None


def test_summarize_counts_finished_requests_only():
    done = Trace("a", 0.0, 10, {0: [0.1, 0.3, 0.4]}, finished=0.4)
    other = Trace("b", 0.2, 30, {0: [0.4, 0.6]}, finished=0.6)
    unfinished = Trace("c", 0.0, 99, {0: [0.5]})
    s = summarize(Run({"a": done, "b": other, "c": unfinished}, [], duration=1.0))
    assert s["completed"] == 2
    assert s["output_throughput"] == pytest.approx(5.0)
    assert s["total_token_throughput"] == pytest.approx(45.0)
    assert s["median_ttft_ms"] == pytest.approx(150.0)  # TTFTs 100 and 200 ms
    assert s["median_itl_ms"] == pytest.approx(200.0)  # gaps 200, 100, 200 ms
    assert s["p99_itl_ms"] == pytest.approx(200.0)
    assert s["mean_e2el_ms"] == pytest.approx(400.0)
    assert s["mean_norm_latency_ms"] == pytest.approx((400 / 3 + 400 / 2) / 2)


def test_mixed_jobs_are_seeded_and_within_ranges():
    import random

    a = mixed_jobs(random.Random(3), 5, (4, 8), (1, 3), 1000)
    b = mixed_jobs(random.Random(3), 5, (4, 8), (1, 3), 1000)
    assert [j.prompt for j in a] == [j.prompt for j in b]
    assert all(4 <= j.prompt_len <= 8 and 1 <= j.params.max_tokens <= 3 and j.params.ignore_eos for j in a)
    assert all(100 <= t < 1000 for j in a for t in j.prompt)


# ---- the driver, against a fake engine ----------------------------------------------------
@dataclass
class _Stats:
    tokens: int = 0
    decode_tokens: int = 0


@dataclass
class _Out:
    index: int
    new_token_ids: list[int]


@dataclass
class _RequestOutput:
    request_id: str
    outputs: list[_Out]
    finished: bool


@dataclass
class FakeEngine:
    """One token per running request per step; the first step of a request is its prefill."""

    max_batch: int = 100
    requests: dict[str, list[int]] = field(default_factory=dict)  # id -> [left, prefilled]
    stats: _Stats = field(default_factory=_Stats)
    batches: list[list[str]] = field(default_factory=list)

    @property
    def scheduler(self):
        return type("S", (), {"running": list(self.requests)})()

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = [params.max_tokens, 0]

    def has_unfinished(self):
        return bool(self.requests)

    def abort(self, request_id):
        self.requests.pop(request_id, None)

    def step(self):
        batch = list(self.requests)[: self.max_batch]
        self.batches.append(batch)
        outs = []
        for rid in batch:
            state = self.requests[rid]
            self.stats.tokens += 1
            self.stats.decode_tokens += state[1]
            state[0] -= 1
            state[1] = 1
            if state[0] == 0:
                del self.requests[rid]
            outs.append(_RequestOutput(rid, [_Out(0, [7])], rid not in self.requests))
        return outs


def _jobs(lengths, arrival=0.0):
    return [Job(f"r{i}", [1, 2, 3], fixed_output(n), arrival) for i, n in enumerate(lengths)]


def test_drive_iteration_level_lets_new_requests_join_every_step():
    engine = FakeEngine()
    run = drive(engine, _jobs([3, 1]))
    assert engine.batches == [["r0", "r1"], ["r0"], ["r0"]]
    assert [len(run.traces[r].token_times[0]) for r in ("r0", "r1")] == [3, 1]
    assert run.traces["r1"].finished is not None and run.duration == run.traces["r0"].finished
    assert [s.tokens for s in run.steps] == [2, 1, 1]
    assert [s.decodes for s in run.steps] == [0, 1, 1]


def test_drive_inject_and_until():
    engine = FakeEngine()
    extra = iter([Job("late", [1], fixed_output(1))])

    def inject(run, now):
        return [next(extra)] if "late" not in run.traces else []

    run = drive(engine, _jobs([10]), inject=inject, until=lambda run: run.traces["late"].finished is not None)
    assert run.traces["late"].arrival > 0.0  # arrives when injected
    assert run.traces["r0"].finished is None and not engine.requests  # the rest was aborted
    assert len(engine.batches) == 2


def test_drive_waits_for_arrivals_in_wall_clock_time():
    engine = FakeEngine()
    run = drive(engine, _jobs([1], arrival=0.05))
    assert run.traces["r0"].token_times[0][0] >= 0.05
    assert run.traces["r0"].arrival == 0.05


def test_fixed_output_forces_the_length():
    p = fixed_output(5, temperature=1.0, seed=2)
    assert (p.max_tokens, p.ignore_eos, p.temperature, p.seed) == (5, True, 1.0, 2)
    assert isinstance(p, SamplingParams)


def test_stall_share_counts_gaps_over_twice_the_median():
    from pagemesh.bench.experiments.disagg import stall_share

    assert stall_share([0.1, 0.1, 0.1, 0.25, 0.5]) == pytest.approx(0.4)
    assert stall_share([0.1, 0.2]) == 0.0  # upper median 0.2: nothing above 0.4
    assert stall_share([]) == 0.0
