"""A prefill and a decode worker pair only at one tensor-parallel size (KV pages go rank i -> rank
i and are not resharded): the pure placement logic, and the scheduler core that refuses requests
with the reason when the live pools have no pair of one size."""

from __future__ import annotations

import pytest

from pagemesh.common.messages import KVPoolInfo, Registered, RegisterWorker, WorkerKind
from pagemesh.common.messages.base import ProtocolError
from pagemesh.services.scheduler.placement import Placement, PlacementPolicy, Placer, pairing_problem
from pagemesh.services.scheduler.prefix_index import PromptPages
from pagemesh.tests.scheduler_harness import AFTER_GRACE, PAGE, TOK, new_core, refused, schedule
from pagemesh.tests.unit.test_prefix_placement import PROMPT, worker

MISMATCH = (
    "no prefill and decode worker of one parallel shape (prefill: tp 1 x pp 1, tp 2 x pp 1; decode: tp 3 x pp 1): "
    "KV pages go rank i to rank i and stage j to stage j, not resharded"
)


def test_only_workers_of_one_size_pair_even_when_another_is_less_loaded_or_holds_the_prompt():
    prompt = PromptPages(PROMPT)
    p1, p3 = worker("p1", ranks=1, held=4), worker("p3", ranks=3, load=5)
    d1, d3 = worker("d1", "decode", ranks=1, load=7), worker("d3", "decode", ranks=3, held=4)
    for mode in ("prefix", "load", "round-robin"):
        placed = Placer(PlacementPolicy(mode)).place([p1, p3], [d3], [], prompt)
        assert (placed.prefill, placed.worker) == (p3, d3)
        placed = Placer(PlacementPolicy(mode)).place([p3], [d1, d3], [], prompt)
        assert (placed.prefill, placed.worker, placed.skip_pages) == (p3, d3, 4)
    # both sizes pair: the decode worker is picked first (its cache), then a prefill worker of its size
    placed = Placer().place([p1, p3], [d1, d3], [], prompt)
    assert (placed.prefill, placed.worker) == (p3, d3)
    placed = Placer(PlacementPolicy("load")).place([p1, p3], [d1, d3], [], prompt)
    assert (placed.prefill, placed.worker) == (p3, d3)  # d3 is less loaded than d1


def test_a_size_whose_partner_has_no_room_does_not_pair():
    prompt = PromptPages(PROMPT)
    busy_p3 = worker("p3", ranks=3, load=8)  # at max_running
    placed = Placer().place([worker("p1", ranks=1), busy_p3], [worker("d3", "decode", ranks=3)], [], prompt)
    assert placed is None  # waits for p3 (or a mixed worker), never pairs p1 with d3


def test_no_pair_of_one_size_falls_back_to_mixed_or_nothing_and_says_why():
    prompt = PromptPages(PROMPT)
    prefill = [worker("p1", ranks=1), worker("p2", ranks=2)]
    decode = [worker("d3", "decode", ranks=3)]
    assert Placer().place(prefill, decode, [], prompt) is None
    mixed = worker("m0", "mixed", ranks=3)
    assert Placer().place(prefill, decode, [mixed], prompt) == Placement(None, mixed)
    assert pairing_problem(prefill, decode) == MISMATCH
    assert pairing_problem(prefill + [worker("p3", ranks=3)], decode) is None
    assert pairing_problem(prefill, []) is None and pairing_problem([], decode) is None  # nothing to pair yet


def register(core, wid: str, role: str, ranks: int, now: float, stages: int = 1):
    kv = KVPoolInfo(page_size=PAGE, num_pages=100, kv_endpoint=f"ipc:///{wid}-kv")
    msg = RegisterWorker(
        worker_id=wid,
        kind=WorkerKind.LLM,
        role=role,
        model="m",
        max_running=8,
        kv=kv,
        ranks=ranks,
        pipeline_stages=stages,
    )
    return core.handle(wid.encode(), msg, now)


def test_the_scheduler_is_not_ready_and_refuses_requests_naming_the_sizes_until_a_pair_of_one_size_registers():
    core = new_core()
    for wid, role, ranks in (("p1", "prefill", 1), ("p2", "prefill", 2), ("d3", "decode", 3)):
        assert register(core, wid, role, ranks, AFTER_GRACE) == [(wid.encode(), Registered(worker_id=wid))]
    assert not core.status(AFTER_GRACE).ready
    assert schedule(core, "r1", now=AFTER_GRACE) == [(TOK, refused("r1", MISMATCH))]
    register(core, "p3", "prefill", 3, AFTER_GRACE)
    assert core.status(AFTER_GRACE).ready
    [(to, task)] = [o for o in schedule(core, "r2", now=AFTER_GRACE) if o[0] == "p3"]
    assert task.decode_kv_endpoint == "ipc:///d3-kv"


def test_workers_of_one_rank_count_but_another_shape_do_not_pair_and_the_reason_names_both_shapes():
    """tp 2 x pp 1 and tp 1 x pp 2 both run 2 ranks, but one splits the heads and the other the
    layers: their pages cannot go rank i -> rank i."""
    prompt = PromptPages(PROMPT)
    tp2, pp2 = worker("p-tp2", ranks=2), worker("p-pp2", ranks=2, pipeline_stages=2)
    d_pp2 = worker("d-pp2", "decode", ranks=2, pipeline_stages=2, held=4)
    assert (tp2.parallel_shape, pp2.parallel_shape) == ((2, 1), (1, 2))
    assert Placer().place([tp2], [d_pp2], [], prompt) is None
    assert pairing_problem([tp2], [d_pp2]) == (
        "no prefill and decode worker of one parallel shape (prefill: tp 2 x pp 1; decode: tp 1 x pp 2): "
        "KV pages go rank i to rank i and stage j to stage j, not resharded"
    )
    placed = Placer().place([tp2, pp2], [d_pp2], [], prompt)
    assert (placed.prefill, placed.worker, placed.skip_pages) == (pp2, d_pp2, 4)
    assert pairing_problem([tp2, pp2], [d_pp2]) is None


def test_registration_carries_the_stages_and_the_scheduler_pairs_by_shape():
    core = new_core()
    register(core, "p-tp2", "prefill", 2, AFTER_GRACE)
    register(core, "d-tp2xpp2", "decode", 4, AFTER_GRACE, stages=2)
    assert not core.status(AFTER_GRACE).ready
    why = (
        "no prefill and decode worker of one parallel shape (prefill: tp 2 x pp 1; decode: tp 2 x pp 2): "
        "KV pages go rank i to rank i and stage j to stage j, not resharded"
    )
    assert schedule(core, "r1", now=AFTER_GRACE) == [(TOK, refused("r1", why))]
    register(core, "p-tp2xpp2", "prefill", 4, AFTER_GRACE, stages=2)
    assert core.status(AFTER_GRACE).ready
    [(to, task)] = [o for o in schedule(core, "r2", now=AFTER_GRACE) if o[0] == "p-tp2xpp2"]
    assert task.decode_kv_endpoint == "ipc:///d-tp2xpp2-kv"
    kv = KVPoolInfo(page_size=PAGE, num_pages=100, kv_endpoint="")
    for ranks, stages in ((3, 2), (2, 4), (2, 0)):
        msg = RegisterWorker(
            worker_id="w",
            kind=WorkerKind.LLM,
            role="prefill",
            model="m",
            max_running=8,
            kv=kv,
            ranks=ranks,
            pipeline_stages=stages,
        )
        with pytest.raises(ProtocolError, match="pipeline_stages: must divide ranks"):
            msg._check()
