"""The diffusion batcher's decisions (pure: no torch): which requests share each forward in step,
request and serial modes; admission, row budgets, shape turns, removal."""

from __future__ import annotations

import pytest

from pagemesh.workers.diffusion.engine.batcher import Batcher, Member
from pagemesh.workers.diffusion.engine.config import EngineConfig

SMALL = (1, 8, 8)
LARGE = (1, 16, 16)


class Requests:
    """Members in arrival order; `ids(group)` names a plan's group."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher
        self.count = 0

    def add(self, name: str, shape=SMALL, rows: int = 1, arrival: float = 0.0) -> None:
        self.batcher.add(Member(request_id=name, order=self.count, shape=shape, rows=rows, arrival=arrival))
        self.count += 1


def ids(group: list[Member]) -> list[str]:
    return [m.request_id for m in group]


def make(**config) -> tuple[Batcher, Requests]:
    batcher = Batcher(EngineConfig(**config))
    return batcher, Requests(batcher)


def run_to_end(batcher: Batcher, steps: dict[str, int], now: float = 10.0) -> list[list[str]]:
    """Plan until nothing runs; a request leaves after its number of steps. Returns each group."""
    done: dict[str, int] = {}
    history = []
    while group := batcher.plan(now):
        history.append(ids(group))
        for member in group:
            done[member.request_id] = done.get(member.request_id, 0) + 1
            if done[member.request_id] == steps[member.request_id]:
                batcher.remove(member.request_id)
    return history


# ---- step mode ------------------------------------------------------------------------------
def test_step_mode_equal_shapes_share_a_forward_oldest_first_within_the_row_budget():
    batcher, reqs = make(max_batch_rows=5)
    reqs.add("a", rows=2)
    reqs.add("b", rows=2)
    reqs.add("c", rows=2)  # does not fit after a and b (6 > 5) ...
    reqs.add("d", rows=1)  # ... but d does: first fit
    assert ids(batcher.plan(0.0)) == ["a", "b", "d"]
    assert batcher.num_running == 4 and batcher.num_waiting == 0
    batcher.remove("a")
    assert ids(batcher.plan(0.0)) == ["b", "c", "d"]


def test_step_mode_a_request_bigger_than_the_budget_runs_alone():
    batcher, reqs = make(max_batch_rows=4)
    reqs.add("big", rows=20)
    reqs.add("small", rows=1)
    assert ids(batcher.plan(0.0)) == ["big"]


def test_step_mode_admits_up_to_max_running_and_newcomers_join_at_the_next_plan():
    batcher, reqs = make(max_running=2)
    reqs.add("a")
    assert ids(batcher.plan(0.0)) == ["a"]
    reqs.add("b")
    reqs.add("c")
    assert batcher.num_waiting == 2
    assert ids(batcher.plan(0.0)) == ["a", "b"]  # b joined a mid-way; c waits for a slot
    assert (batcher.num_running, batcher.num_waiting) == (2, 1)
    batcher.remove("a")
    assert ids(batcher.plan(0.0)) == ["b", "c"]


def test_step_mode_requests_with_different_step_counts_leave_when_each_is_done():
    batcher, reqs = make()
    for name in "abc":
        reqs.add(name)
    history = run_to_end(batcher, {"a": 3, "b": 1, "c": 2})
    assert history == [["a", "b", "c"], ["a", "c"], ["a"]]


def test_step_mode_shapes_take_turns_so_none_starves():
    batcher, reqs = make()
    reqs.add("s1", SMALL)
    reqs.add("s2", SMALL)
    assert ids(batcher.plan(0.0)) == ["s1", "s2"]
    reqs.add("l1", LARGE)
    reqs.add("s3", SMALL)
    # the large shape was never served: it goes next, then the shapes alternate
    assert ids(batcher.plan(0.0)) == ["l1"]
    assert ids(batcher.plan(0.0)) == ["s1", "s2", "s3"]
    assert ids(batcher.plan(0.0)) == ["l1"]
    batcher.remove("l1")
    assert ids(batcher.plan(0.0)) == ["s1", "s2", "s3"]
    assert ids(batcher.plan(0.0)) == ["s1", "s2", "s3"]
    assert batcher.last_served == {SMALL: 6}  # a shape no longer running is forgotten


def test_step_mode_shapes_never_served_go_by_their_oldest_request():
    batcher, reqs = make()
    reqs.add("l1", LARGE)
    reqs.add("s1", SMALL)
    assert ids(batcher.plan(0.0)) == ["l1"]
    assert ids(batcher.plan(0.0)) == ["s1"]
    assert ids(batcher.plan(0.0)) == ["l1"]


# ---- request mode ---------------------------------------------------------------------------
def test_request_mode_gathers_for_the_window_from_the_first_arrival():
    batcher, reqs = make(batching="request", request_wait_s=0.05)
    reqs.add("a", arrival=1.0)
    assert batcher.plan(1.01) == []
    reqs.add("b", arrival=1.03)
    assert batcher.plan(1.04) == []
    assert ids(batcher.plan(1.05)) == ["a", "b"]


def test_request_mode_starts_at_once_when_the_batch_is_full():
    batcher, reqs = make(batching="request", max_running=2, request_wait_s=10.0)
    reqs.add("a", arrival=1.0)
    assert batcher.plan(1.0) == []
    reqs.add("b", arrival=1.0)
    reqs.add("c", arrival=1.0)
    assert ids(batcher.plan(1.0)) == ["a", "b"]


def test_request_mode_a_batch_that_the_row_budget_cuts_is_full():
    batcher, reqs = make(batching="request", max_batch_rows=4, request_wait_s=10.0)
    reqs.add("a", rows=2, arrival=1.0)
    reqs.add("b", rows=2, arrival=1.0)
    reqs.add("c", rows=2, arrival=1.0)
    assert ids(batcher.plan(1.0)) == ["a", "b"]


def test_request_mode_runs_the_batch_to_its_end_while_arrivals_wait():
    batcher, reqs = make(batching="request", request_wait_s=0.0)
    reqs.add("a")
    reqs.add("b")
    assert ids(batcher.plan(1.0)) == ["a", "b"]
    reqs.add("c")
    assert ids(batcher.plan(1.0)) == ["a", "b"]
    batcher.remove("b")  # b finished: a runs on alone, c still waits
    assert ids(batcher.plan(1.0)) == ["a"]
    assert (batcher.num_running, batcher.num_waiting) == (1, 1)
    batcher.remove("a")
    assert ids(batcher.plan(1.0)) == ["c"]


def test_request_mode_batches_only_compatible_shapes_oldest_first():
    batcher, reqs = make(batching="request", request_wait_s=0.0)
    reqs.add("s1", SMALL)
    reqs.add("l1", LARGE)
    reqs.add("s2", SMALL)
    assert run_to_end(batcher, {"s1": 2, "l1": 1, "s2": 1}) == [["s1", "s2"], ["s1"], ["l1"]]


def test_request_mode_an_aborted_batch_lets_the_next_one_start():
    batcher, reqs = make(batching="request", request_wait_s=0.0, max_running=1)
    reqs.add("a")
    reqs.add("b")
    assert ids(batcher.plan(0.0)) == ["a"]
    assert batcher.remove("a")
    assert ids(batcher.plan(0.0)) == ["b"]


# ---- serial mode ----------------------------------------------------------------------------
def test_serial_mode_runs_one_request_at_a_time_in_arrival_order_without_a_window():
    batcher, reqs = make(batching="serial", request_wait_s=5.0)
    reqs.add("a", arrival=0.0)
    reqs.add("b", arrival=0.0)
    reqs.add("c", LARGE, arrival=0.0)
    assert run_to_end(batcher, {"a": 2, "b": 1, "c": 2}, now=0.0) == [["a"], ["a"], ["b"], ["c"], ["c"]]


# ---- membership and config ------------------------------------------------------------------
def test_remove_finds_waiting_and_running_requests_and_refuses_unknown_ones():
    batcher, reqs = make(max_running=1)
    reqs.add("a")
    reqs.add("b")
    batcher.plan(0.0)
    assert batcher.remove("b") and batcher.num_waiting == 0
    assert batcher.remove("a") and batcher.num_running == 0
    assert not batcher.remove("a")
    assert batcher.plan(0.0) == []


@pytest.mark.parametrize(
    "config, message",
    [
        ({"batching": "dynamic"}, "batching: must be one of step, request, serial"),
        ({"max_running": 0}, "max_running: must be >= 1"),
        ({"max_batch_rows": 0}, "max_batch_rows: must be >= 1"),
        ({"max_waiting": 0}, "max_waiting: must be >= 1"),
        ({"request_wait_s": -1.0}, "request_wait_s: must be >= 0"),
    ],
)
def test_config_refuses_bad_values(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**config)


def test_config_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        EngineConfig("step")  # type: ignore[misc]
    config = EngineConfig()
    with pytest.raises(AttributeError):
        config.batching = "serial"  # type: ignore[misc]
