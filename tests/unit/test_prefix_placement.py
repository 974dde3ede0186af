"""Prefix caching across the mesh: stable page keys, what a block manager reports, placement by
cached prefix and load, and a handoff that carries only the pages the decode side lacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagemesh.common.kv_events import BlockRemoved, BlockStored
from pagemesh.common.messages import Heartbeat, KVPoolLoad, WorkerKind
from pagemesh.common.page_hash import HASH_BITS, chain_hash, prefix_page_hashes
from pagemesh.common.sampling import SamplingParams
from pagemesh.services.scheduler.main import parse as parse_scheduler_flags
from pagemesh.services.scheduler.placement import Placement, PlacementPolicy, Placer, score
from pagemesh.services.scheduler.prefix_index import PromptPages
from pagemesh.services.scheduler.registry import Registry, WorkerInfo
from pagemesh.tests.llm_tiny import tiny_engine, tiny_llama
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.kv_events import KVEventCollector

PAGE = 4
PROMPT = list(range(100, 117))  # 17 tokens: 4 full pages, all reusable (one token stays to compute)


def worker(worker_id: str, role: str = "prefill", load: int = 0, held: int = 0, prompt=PROMPT, **kw) -> WorkerInfo:
    """A registered worker holding the first `held` pages of `prompt`."""
    info = WorkerInfo(
        worker_id=worker_id,
        kind=WorkerKind.LLM,
        role=role,
        model="m",
        max_running=kw.pop("max_running", 8),
        last_seen=0.0,
        page_size=PAGE,
        total_pages=100,
        kv_endpoint=f"ipc://{worker_id}",
        free_pages=kw.pop("free_pages", 100),
        **kw,
    )
    info.running = load
    info.page_hashes.apply([BlockStored(prefix_page_hashes(prompt, PAGE)[:held], None, [], PAGE, None, "GPU")])
    return info


def cache_prompt(bm: BlockManager, tokens: list[int]) -> list[int]:
    """What the engine does for a computed prompt: pages for it, full pages published."""
    table: list[int] = []
    bm.grow(table, len(tokens))
    bm.cache_full_pages(table, tokens, 0, len(tokens))
    return table


# --------------------------------------------------------------------------- page keys


def test_keys_are_62_bit_chained_and_the_same_in_another_process():
    keys = prefix_page_hashes(PROMPT, PAGE)
    assert len(keys) == 4 and all(0 <= k < 1 << HASH_BITS for k in keys)
    assert keys[0] == chain_hash(None, PROMPT[:4]) and keys[1] == chain_hash(keys[0], PROMPT[4:8])
    assert chain_hash(None, [1, 2, 3, 4]) != chain_hash(keys[0], [1, 2, 3, 4])  # the parent counts
    assert prefix_page_hashes(PROMPT[:16], PAGE) == keys[:3]  # 16 tokens: the 4th page is not reusable
    code = f"from pagemesh.common.page_hash import prefix_page_hashes as f; print(f({PROMPT}, {PAGE}))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    ).stdout
    assert out.strip() == str(keys)


def test_scheduler_keys_agree_with_what_the_block_manager_publishes_and_matches():
    bm = BlockManager(num_pages=20, page_size=PAGE)
    bm.events = KVEventCollector(PAGE)
    table = cache_prompt(bm, PROMPT)
    info = worker("w", prompt=PROMPT, held=0)
    info.page_hashes.apply(bm.events.take_batch().events)
    assert set(info.page_hashes) == set(prefix_page_hashes(PROMPT, PAGE))
    bm.free_table(table)
    longer = PROMPT[:12] + [5, 6, 7, 8, 9]  # shares 3 pages
    assert PromptPages(longer).cached_pages(info) == 3 == len(bm.match_prefix(longer))


# --------------------------------------------------------------------------- reporting


def test_block_manager_reports_publishes_and_evictions_in_lru_order():
    bm = BlockManager(num_pages=4, page_size=PAGE)  # 3 usable pages
    bm.events = KVEventCollector(PAGE)
    a = cache_prompt(bm, PROMPT[:9])  # pages [1, 2, 3]; 1 and 2 full
    k0, k1 = prefix_page_hashes(PROMPT[:9], PAGE)
    assert a == [1, 2, 3]
    assert bm.events.take_batch().events == [BlockStored([k0, k1], None, PROMPT[:8], PAGE, None, "GPU")]
    bm.free_table(a)  # 3 free; 2 then 1 evictable (tail first)
    assert bm.events.take_batch() is None  # freeing keeps the pages cached
    b = cache_prompt(bm, [1] * 12)  # takes the free page 3, then evicts page 2 (k1), then 1 (k0)
    assert b == [3, 2, 1]
    ones = prefix_page_hashes([1] * 13, PAGE)
    assert bm.events.take_batch().events == [
        BlockRemoved([k1, k0], "GPU"),
        BlockStored(ones, None, [1] * 12, PAGE, None, "GPU"),
    ]
    bm.check_invariants([b])


def test_registry_keys_start_over_when_a_worker_registers_again():
    reg = Registry(timeout=3.0)
    reg.register(worker("d0", "decode"))
    reg.workers["d0"].page_hashes.apply([BlockStored([1, 2, 3], None, [], PAGE, None, "GPU")])
    reg.workers["d0"].page_hashes.last_seq = 4
    reg.workers["d0"].requests.add("r1")
    load = KVPoolLoad(free_pages=60, used_pages=40, total_pages=100, bytes_sent=0, bytes_received=7)
    reg.heartbeat(Heartbeat(worker_id="d0", running=3, waiting=1, time=5.0, requests_finished=9, kv=load), now=5.0)
    assert reg.register(worker("d0", "decode")) is None  # the same process registering again
    d0 = reg.workers["d0"]
    assert d0.requests == {"r1"} and (d0.running, d0.free_pages, d0.requests_finished) == (3, 60, 9)  # kept
    assert not d0.page_hashes and d0.page_hashes.last_seq is None  # its snapshot comes next
    replaced = reg.register(worker("d0", "decode", instance="new"))  # a restarted worker
    assert replaced is not None and replaced.requests == {"r1"}  # those requests died with it
    assert not reg.workers["d0"].page_hashes and reg.workers["d0"].requests == set()


# --------------------------------------------------------------------------- placement


def test_score_and_cached_fraction():
    prompt = PromptPages(PROMPT)
    assert prompt.cached_fraction(worker("a", held=3)) == 0.75
    assert score(worker("a", load=2, held=3), prompt, PlacementPolicy("prefix", 1.0, 1.0)) == 0.75 - 2 / 8
    holes = worker("b", held=4)
    holes.page_hashes.apply([BlockRemoved(prefix_page_hashes(PROMPT, PAGE)[:1], "GPU")])
    assert prompt.cached_pages(holes) == 0  # a later page without the first is no hit


def test_prefix_wins_until_load_outweighs_it():
    prompt = PromptPages(PROMPT)
    decode = [worker("d0", "decode")]
    cached_busy, idle = worker("p0", load=2, held=3), worker("p1")
    # 1.0 * 0.75 - 1.0 * 2/8 = 0.5 > 0: the cache wins
    assert (
        Placer(PlacementPolicy("prefix", 1.0, 1.0)).place([cached_busy, idle], decode, [], prompt).prefill
        is cached_busy
    )
    # 1.0 * 0.75 - 4.0 * 2/8 = -0.25 < 0: the load wins
    assert Placer(PlacementPolicy("prefix", 1.0, 4.0)).place([cached_busy, idle], decode, [], prompt).prefill is idle
    assert Placer(PlacementPolicy("load")).place([cached_busy, idle], decode, [], prompt).prefill is idle
    # the longer prefix wins at equal load; equal scores go to the least loaded, then by id
    more, less = worker("p2", held=4), worker("p3", held=1)
    assert Placer().place([less, more], decode, [], prompt).prefill is more
    assert (
        Placer().place([worker("p5", load=1), worker("p4", load=1), worker("p6")], decode, [], prompt).prefill.worker_id
        == "p6"
    )
    assert Placer().place([worker("p5"), worker("p4")], decode, [], prompt).prefill.worker_id == "p4"


def test_a_worker_that_cannot_take_the_request_is_not_chosen_for_its_cache():
    prompt = PromptPages(PROMPT)
    full = worker("p0", load=8, held=4)  # at max_running
    no_room = worker("p1", held=4, free_pages=2)
    other = worker("p2")
    assert Placer().place([full, no_room, other], [worker("d0", "decode")], [], prompt).prefill is other
    assert Placer().place([full, no_room], [worker("d0", "decode")], [worker("m0", "mixed")], prompt) == Placement(
        None, worker("m0", "mixed")
    )


def test_decode_choice_and_skip_pages():
    prompt = PromptPages(PROMPT)
    p = worker("p0")
    d_cached, d_idle = worker("d0", "decode", held=2), worker("d1", "decode")
    placed = Placer().place([p], [d_idle, d_cached], [], prompt)
    assert (placed.worker, placed.skip_pages) == (d_cached, 2)
    # other policies pick by their own rule; pages the chosen decode worker holds still stay home
    placed = Placer(PlacementPolicy("load")).place([p], [worker("d0", "decode", load=1, held=3), d_idle], [], prompt)
    assert (placed.worker, placed.skip_pages) == (d_idle, 0)
    placed = Placer(PlacementPolicy("load")).place([p], [worker("d0", "decode", held=3)], [], prompt)
    assert placed.skip_pages == 3
    assert Placer().place([], [], [worker("m0", "mixed", held=4)], prompt).skip_pages == 0


def test_round_robin_takes_turns_per_pool():
    prompt = PromptPages(PROMPT)
    placer = Placer(PlacementPolicy("round-robin"))
    prefill = [worker("p1"), worker("p0", held=4), worker("p2")]
    decode = [worker("d1", "decode"), worker("d0", "decode")]
    picks = [placer.place(prefill, decode, [], prompt) for _ in range(4)]
    assert [(x.prefill.worker_id, x.worker.worker_id) for x in picks] == [
        ("p0", "d0"),
        ("p1", "d1"),
        ("p2", "d0"),
        ("p0", "d1"),
    ]


def test_placement_flags():
    config = parse_scheduler_flags(["--placement", "round-robin", "--prefix-weight", "2", "--load-weight", "0.5"])
    assert config.placement == PlacementPolicy("round-robin", 2.0, 0.5)
    assert parse_scheduler_flags([]).placement == PlacementPolicy("prefix", 1.0, 4.0)
    with pytest.raises(SystemExit):
        parse_scheduler_flags(["--placement", "random"])
    with pytest.raises(SystemExit):
        parse_scheduler_flags(["--load-weight", "-1"])


# --------------------------------------------------------------------------- the handoff, in process


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama(seed=3)


def make_engine(model, prefix_caching=True):
    return tiny_engine(model, page_size=PAGE, enable_prefix_caching=prefix_caching)


def prefill(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params, prefill_only=True)
    while engine.take_prefilled(rid) is None:
        engine.step()
    return engine.take_prefilled(rid)


def hand_off(p_engine, d_engine, rid, prompt, params, skip_pages):
    """What the two worker services do: the decode side pins, the prefill side packs the tail,
    the decode side checks and imports. Returns the header."""
    from pagemesh.common import protocol
    from pagemesh.workers.engine.kv_handoff import write_pages
    from pagemesh.workers.llm.handoff_in import check_header
    from pagemesh.workers.llm.handoff_out import pack_export

    hits = d_engine.blocks.match_prefix(prompt) if skip_pages else []
    pinned = hits[:skip_pages]
    d_engine.blocks.free_table(hits[skip_pages:])
    prefill(p_engine, rid, prompt, params)
    [(header, layers)] = pack_export(p_engine.export_prefilled(rid, skip_pages))
    frames = [bytes(f) for f in protocol.encode_tensor_frames(header, layers)]
    header = protocol.decode(frames)
    p_engine.release_prefilled(rid)
    try:
        skip = check_header(header, d_engine.runner.kv_cache.shape, len(prompt))
        if skip > len(pinned):
            raise ValueError(f"kv: {skip} pages not sent, {len(pinned)} held")
    except ValueError:
        d_engine.blocks.free_table(pinned)
        raise
    tensors = protocol.decode_tensor_frames(header, frames[2:])
    d_engine.import_prefilled(
        rid,
        prompt,
        params,
        list(header.first_token_ids),
        lambda table: write_pages(d_engine.runner.kv_cache, table, tensors),
        pinned,
    )
    return header


def run_out(engine, rid):
    tokens = []
    while rid in engine.requests:
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.outputs[0].new_token_ids if out.outputs else []
    return tokens


def test_second_handoff_sends_only_missing_pages_and_decodes_the_same(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=6)
    shared = [(7 * i) % 250 + 1 for i in range(40)]
    first, second = shared + [3, 4, 5], shared + [9, 8, 7, 6, 5, 4]
    expected = [r.token_ids[0] for r in make_engine(tiny_model, prefix_caching=False).generate([first, second], params)]
    p_engine, d_engine = make_engine(tiny_model), make_engine(tiny_model)

    h1 = hand_off(p_engine, d_engine, "r1", first, params, skip_pages=0)
    got1 = [h1.first_token_ids[0]] + run_out(d_engine, "r1")
    d_info = worker("d0", "decode", prompt=second)
    d_info.page_hashes.apply([BlockStored(d_engine.blocks.cached_keys()[0], None, [], PAGE, None, "GPU")])
    skip = PromptPages(second).cached_pages(d_info)
    assert skip == 10  # the 40 shared tokens: 10 pages of 4

    held = [d_engine.blocks.hash_to_page[k] for k in prefix_page_hashes(second, PAGE)[:skip]]
    h2 = hand_off(p_engine, d_engine, "r2", second, params, skip_pages=skip)
    assert (h1.num_pages, h1.page_indices) == (11, list(range(11)))
    assert (h2.num_pages, h2.page_indices) == (2, [10, 11])  # 46 tokens = 12 pages, 10 held
    [seq] = d_engine.requests["r2"].seqs
    assert seq.block_table[:10] == held and len(seq.block_table) == 12  # reused + the two received
    got2 = [h2.first_token_ids[0]] + run_out(d_engine, "r2")
    assert [got1, got2] == expected
    d_engine.blocks.check_invariants([])
    p_engine.blocks.check_invariants([])


def test_decode_side_refuses_when_its_pages_are_gone_and_leaks_nothing(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=3)
    prompt = [(5 * i) % 250 + 1 for i in range(21)]
    p_engine, d_engine = make_engine(tiny_model), make_engine(tiny_model)
    free = d_engine.blocks.num_free_pages
    with pytest.raises(ValueError, match="4 pages not sent, 0 held"):
        hand_off(p_engine, d_engine, "r1", prompt, params, skip_pages=4)  # the decode cache is empty
    assert d_engine.blocks.num_free_pages == free and "r1" not in d_engine.requests
    d_engine.blocks.check_invariants([])
    p_engine.blocks.check_invariants([])
