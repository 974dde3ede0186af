"""LoRASlots (workers/engine/lora_slots.py): exact slots, pins and the LRU order of evictions."""

import pytest

from pagemesh.workers.engine.lora_slots import LoRASlots


def slots_of(names: dict[str, str], max_loras: int) -> LoRASlots:
    s = LoRASlots(max_loras)
    for name, path in names.items():
        s.add(name, path)
    return s


def test_slots_fill_in_order_then_the_least_recently_used_unpinned_one_is_evicted():
    s = slots_of({"a": "/a", "b": "/b", "c": "/c"}, 2)
    assert s.acquire("a") == (0, "/a")  # empty slot 0, load a
    assert s.acquire("b") == (1, "/b")
    assert s.acquire("a") == (0, None)  # held already: nothing to load
    assert s.acquire("c") is None  # both pinned by running sequences: c waits
    s.release(1)  # b's sequence ends: slot 1 stays b's, unpinned
    assert s.in_slots() == ["a", "b"] and s.running() == {"a": 2}
    assert s.acquire("c") == (1, "/c")  # b evicted (the only unpinned slot)
    assert (s.loads, s.evictions) == (3, 1)
    s.release(0), s.release(0), s.release(1)
    assert s.acquire("b") == (0, "/b")  # a (used at acquire 3) is older than c (acquire 5)
    s.check_invariants()


def test_an_adapter_in_use_cannot_be_removed_and_a_removed_one_frees_its_slot():
    s = slots_of({"a": "/a"}, 1)
    slot, _ = s.acquire("a")
    with pytest.raises(ValueError, match="in use by 1 running sequences"):
        s.remove("a")
    s.pin(slot)  # a fork of the running sequence
    s.release(slot)
    s.release(slot)
    assert s.remove("a") == 0 and s.in_slots() == [] and "a" not in s.adapters
    with pytest.raises(KeyError):
        s.acquire("a")
    with pytest.raises(ValueError, match="not pinned"):
        s.release(0)
