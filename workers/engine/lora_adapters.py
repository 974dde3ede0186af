"""An engine's LoRA adapters: which it knows by name, which slot holds which, and what a
request for one is checked against. The torch side (slots' weights, a step's rows) is the
runner's `ServedAdapters` (workers/model/lora.py)."""

from __future__ import annotations

from pagemesh.common.lora import AdapterError, AdapterSpec, read_adapter_spec
from pagemesh.common.page_hash import root_hash
from pagemesh.workers.engine.lora_slots import LoRASlots


class EngineAdapters:
    """`add(name, path)` checks an adapter against the model (AdapterError naming what is wrong;
    nothing changes then) and makes it servable; `remove(name)` forgets it (ValueError while
    sequences run under it); `prefix_root(name)` keys its prefix-cache pages apart."""

    def __init__(self, model, max_loras: int, max_rank: int, modules: tuple[tuple[str, str], ...] = ()):
        self.model, self.max_rank = model, max_rank
        self.slots = LoRASlots(max_loras)
        self.specs: dict[str, AdapterSpec] = {}
        for name, path in modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> AdapterSpec:
        from pagemesh.workers.model.lora import check_adapter

        if name in self.specs:
            raise AdapterError(f"lora: an adapter named {name!r} is loaded already (unload it first)")
        spec = read_adapter_spec(path, self.max_rank)
        check_adapter(self.model, spec)
        self.specs[name] = spec
        self.slots.add(name, spec.path)
        return spec

    def remove(self, name: str) -> None:
        if name not in self.specs:
            raise AdapterError(f"lora: no adapter named {name!r} is loaded", missing=True)
        self.slots.remove(name)
        del self.specs[name]

    def check(self, name: str) -> None:
        if name not in self.specs:
            raise ValueError(f"lora: no adapter named {name!r} is loaded")

    def prefix_root(self, name: str) -> int:
        return root_hash("lora:" + self.specs[name].digest)


def lora_runner_args(config) -> tuple[int, int, int] | None:
    """The runner's `lora` argument of an EngineConfig: (max_loras, max_lora_rank, max_cpu_loras)."""
    if not config.enable_lora:
        return None
    return config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras
