"""Which LoRA adapter each of a worker's `--max-loras` slots holds, and which a step may use.

Pure Python (no torch, no zmq), like the scheduler that calls it. A running sequence with an
adapter pins the adapter's slot; a slot whose adapter no running sequence uses stays filled
(a later request for it loads nothing) until a new adapter needs room: then the least recently
used unpinned slot is given over (an eviction).

    known adapters (name -> path)      slots [0 .. max_loras)
    ───────────────────────────────    ──────────────────────────────────────────────
    "sql"   -> /adapters/sql           slot 0: "sql"    pinned by 3 sequences
    "chat"  -> /adapters/chat          slot 1: "chat"   unpinned, used at step 812 (LRU)
    "legal" -> /adapters/legal         slot 2: empty
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Slot:
    name: str | None = None
    pins: int = 0
    last_used: int = 0


@dataclass
class LoRASlots:
    """`acquire(name)` -> (slot, path to load into it, or None when it holds the adapter already),
    or None when every slot is pinned by other adapters (the sequence waits)."""

    max_loras: int
    adapters: dict[str, str] = field(default_factory=dict)  # name -> adapter folder
    loads: int = 0
    evictions: int = 0
    _slots: list[_Slot] = field(init=False)
    _clock: int = 0

    def __post_init__(self) -> None:
        self._slots = [_Slot() for _ in range(self.max_loras)]

    def slot_of(self, name: str) -> int | None:
        return next((i for i, s in enumerate(self._slots) if s.name == name), None)

    def acquire(self, name: str) -> tuple[int, str | None] | None:
        if name not in self.adapters:
            raise KeyError(name)
        self._clock += 1
        index = self.slot_of(name)
        load = None
        if index is None:
            free = [i for i, s in enumerate(self._slots) if s.pins == 0]
            if not free:
                return None
            index = min(free, key=lambda i: (self._slots[i].name is not None, self._slots[i].last_used))
            if self._slots[index].name is not None:
                self.evictions += 1
            self._slots[index].name = name
            self.loads += 1
            load = self.adapters[name]
        slot = self._slots[index]
        slot.pins += 1
        slot.last_used = self._clock
        return index, load

    def has_room(self, name: str) -> bool:
        """`acquire(name)` would give a slot now."""
        return self.slot_of(name) is not None or any(s.pins == 0 for s in self._slots)

    def pin(self, index: int) -> None:
        """One more sequence uses the adapter in slot `index` (a fork of a pinning sequence)."""
        self._slots[index].pins += 1

    def release(self, index: int) -> None:
        slot = self._slots[index]
        if slot.pins <= 0:
            raise ValueError(f"lora slot {index} is not pinned")
        slot.pins -= 1

    def add(self, name: str, path: str) -> None:
        self.adapters[name] = path

    def remove(self, name: str) -> int | None:
        """Forget adapter `name`; the slot it held (now empty) or None. ValueError while running
        sequences use it (unloading it would change their output mid-stream)."""
        index = self.slot_of(name)
        if index is not None and self._slots[index].pins:
            raise ValueError(f"lora adapter {name!r} is in use by {self._slots[index].pins} running sequences")
        self.adapters.pop(name, None)
        if index is not None:
            self._slots[index] = _Slot()
        return index

    def in_slots(self) -> list[str]:
        return sorted(s.name for s in self._slots if s.name is not None)

    def running(self) -> dict[str, int]:
        """Adapters that running sequences use, and how many sequences use each."""
        return {s.name: s.pins for s in self._slots if s.name is not None and s.pins}

    def check_invariants(self) -> None:
        names = [s.name for s in self._slots if s.name is not None]
        assert len(names) == len(set(names)), f"an adapter in two slots: {names}"
        for i, s in enumerate(self._slots):
            assert s.pins >= 0, f"slot {i} pinned {s.pins} times"
            assert s.name is not None or s.pins == 0, f"empty slot {i} pinned"
