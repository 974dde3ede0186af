"""Many LoRA adapters on one base model, batched in one step (Punica's idea).

A worker holds up to `slots` adapters at once. Each adapted linear keeps every slot's A and B
stacked, rank rows zero-padded to `max_rank`:

    a  [slots * parts * max_rank, in]     rows (s, p, k): slot s, fused part p (q/k/v, gate/up), rank k
    b  [slots * parts * max_rank, out]    the same rows; row (s, p, k) is non-zero only in part p's columns

and adds to the base output, for all rows of the step at once,

    delta = ((x a^T) * mask) b            mask [T, slots * parts * max_rank]: 1 where the row's slot is s

so a step with rows of five adapters and of the base model makes the same two matmuls as one with
a single adapter: no loop over adapters or rows (a base row's mask is all zero). One kernel call
does it instead where there is one (each row reads only its own adapter, a batched GEMV): C on a
CPU (kernels/cpu/lora.c, measured faster at 1 to 32 rows by bench/lora.py), Triton on CUDA
(kernels/lora.py); $PAGEMESH_LORA_KERNEL=torch keeps the GEMMs.
Scaling (alpha / r)
is folded into b at load. Under tensor parallelism b is sharded with the base weight's output rows
(column-parallel) or a with its input columns (row-parallel: each rank's delta is a partial sum,
added before the all-reduce, which sums it with the base output's).

`LoRABatch` says which slot each row of the step uses; the runner sets it before each forward and
every adapted linear of the model reads it.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from pagemesh.common.lora import ADAPTER_WEIGHTS, TARGETS, AdapterError, AdapterSpec
from pagemesh.workers.model.layers import ColumnParallelLinear, RowParallelLinear

# HF module name -> (the decoder layer's linear that computes it, its part of a fused linear)
_SITES = {
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
_PEFT_PREFIX = "base_model.model."
# each adapted linear of a decoder layer and the HF modules it computes, in part order
_LINEARS = [
    (block, name, [m for m, site in _SITES.items() if site[:2] == (block, name)])
    for block, name in dict.fromkeys(site[:2] for site in _SITES.values())
]


class LoRABatch:
    """Which adapter slot each row of this step's token batch uses (-1: the base model)."""

    def __init__(self, slots: int, kernel: str | None = None):
        self.slots = slots
        # "c" (kernels/cpu/lora.c) or "triton" (kernels/lora.py): each row's delta from its own
        # adapter in one call; None: the masked GEMMs
        self.kernel = kernel
        self.row_slots: torch.Tensor | None = None  # [T] int64, or None: no row uses an adapter
        self._masks: dict[int, torch.Tensor] = {}
        self._segments: tuple | None = None

    def set_rows(self, row_slots: torch.Tensor | None) -> None:
        if row_slots is not None and not bool((row_slots >= 0).any()):
            row_slots = None
        self.row_slots, self._masks, self._segments = row_slots, {}, None

    def add(
        self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, width: int, part_cols: torch.Tensor
    ) -> torch.Tensor:
        """y += every row's delta, in place, by this step's kernel ("c" or "triton")."""
        if self.kernel == "triton":
            import pagemesh.kernels.lora

            return pagemesh.kernels.lora.lora_add_(y, x, a, b, self.row_slots, width)
        import pagemesh.kernels.cpu

        if self._segments is None:  # once a step: the rows grouped by slot, for every linear
            self._segments = pagemesh.kernels.cpu.lora_segments(self.row_slots)
        return pagemesh.kernels.cpu.lora_add_grouped_(y, x, a, b, self._segments, width, part_cols)

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots * width]: row t's `width` columns of its slot are 1, all others 0."""
        mask = self._masks.get(width)
        if mask is None:
            slots = torch.arange(self.slots, device=self.row_slots.device)
            one_hot = (self.row_slots[:, None] == slots[None, :]).to(dtype)
            mask = self._masks[width] = one_hot.repeat_interleave(width, dim=1)
        return mask


class LoRAWeights(nn.Module):
    """Every slot's A and B of one linear (module docstring); `add_to(y, x)` adds the delta."""

    def __init__(self, batch: LoRABatch, in_features: int, part_sizes: list[int], max_rank: int, dtype: torch.dtype):
        super().__init__()
        self.batch, self.part_sizes, self.max_rank = batch, part_sizes, max_rank
        self.width = len(part_sizes) * max_rank  # a slot's rows
        rows = batch.slots * self.width
        self.a = nn.Parameter(torch.zeros(rows, in_features, dtype=dtype), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(rows, sum(part_sizes), dtype=dtype), requires_grad=False)
        # where each fused part's columns start and end (the kernel reads a part's B rows there only)
        self.part_cols = torch.tensor([0, *itertools.accumulate(part_sizes)], dtype=torch.int64)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.batch.row_slots is None:
            return y
        if self.batch.kernel is not None and y.is_contiguous():
            return self.batch.add(y, x.contiguous(), self.a, self.b, self.width, self.part_cols)
        h = (x.to(self.a.dtype) @ self.a.T) * self.batch.mask(self.width, self.a.dtype)
        return y + (h @ self.b).to(y.dtype)

    def clear(self, slot: int) -> None:
        rows = slice(slot * self.width, (slot + 1) * self.width)
        self.a.data[rows].zero_()
        self.b.data[rows].zero_()

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a [r, in] and b [out_of_part, r] (this rank's shards, scaled) into slot `slot`, part `part`."""
        first = slot * self.width + part * self.max_rank
        column = sum(self.part_sizes[:part])
        r = a.shape[0]
        self.a.data[first : first + r].copy_(a)
        self.b.data[first : first + r, column : column + b.shape[0]].copy_(b.T)


def attach_lora(model: nn.Module, slots: int, max_rank: int) -> LoRABatch:
    """Give every decoder layer's adapted linears room for `slots` adapters of rank at most
    `max_rank` (all empty: a row with a slot computes the base model until one is loaded)."""
    dtype = model.dtype if model.dtype in (torch.float32, torch.bfloat16) else torch.float32
    batch = LoRABatch(slots, kernel=_kernel(model, dtype))
    for layer in model.layers:
        for block, name, modules in _LINEARS:
            linear = getattr(getattr(layer, block), name, None)
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                continue  # not adapted here (a mixture-of-experts block's experts: an adapter naming them is refused)
            full_in, _ = _full_shape(model.config, modules[0])
            if hasattr(linear, "local_sizes"):  # column-parallel: the output is sharded (by part)
                linear.lora = LoRAWeights(batch, full_in, list(linear.local_sizes), max_rank, dtype)
            else:  # row-parallel: the input is sharded
                _, local_in = linear.tp.shard(full_in, "input")
                _, full_out = _full_shape(model.config, modules[0])
                linear.lora = LoRAWeights(batch, local_in, [full_out], max_rank, dtype)
    model.lora_batch = batch
    return batch


def read_adapter_tensors(spec: AdapterSpec) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(spec.path) / ADAPTER_WEIGHTS), device="cpu")


def check_adapter(model: nn.Module, spec: AdapterSpec, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """AdapterError unless the adapter's tensors fit this model (what load_adapter would refuse)."""
    _parts(model, spec, read_adapter_tensors(spec) if tensors is None else tensors)


def _kernel(model: nn.Module, dtype: torch.dtype) -> str | None:
    """The batched kernel for the model's device: on a CPU the C one (measured faster than the
    masked GEMMs at 1 to 32 rows: bench/lora.py kernels), on CUDA the Triton one; None (the masked
    GEMMs) without a C compiler, or with $PAGEMESH_LORA_KERNEL=torch."""
    if os.environ.get("PAGEMESH_LORA_KERNEL") == "torch":
        return None
    if next(model.parameters()).device.type == "cuda":
        return "triton"
    import pagemesh.kernels.cpu

    usable = pagemesh.kernels.cpu.available() and pagemesh.kernels.cpu.supports(dtype)
    return "c" if usable else None


def load_adapter(
    model: nn.Module, slot: int, spec: AdapterSpec, tensors: dict[str, torch.Tensor] | None = None
) -> None:
    """The adapter `spec` (its `tensors`, else read from its folder) into `slot` of a model
    `attach_lora` prepared, replacing what the slot held. AdapterError (nothing changed) when its
    tensors do not fit this model: a missing or unexpected tensor, a shape of another base model."""
    # checked whole before any slot is touched
    parts = _parts(model, spec, read_adapter_tensors(spec) if tensors is None else tensors)
    clear_slot(model, slot)
    for linear, part, a, b in parts:
        linear.lora.set_part(slot, part, a, b)


def clear_slot(model: nn.Module, slot: int) -> None:
    for layer in model.layers:
        for block, name, _ in _LINEARS:
            linear = getattr(getattr(layer, block), name, None)
            if getattr(linear, "lora", None) is not None:
                linear.lora.clear(slot)


def _parts(model: nn.Module, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> list:
    """(linear, part, a shard, scaled b shard) for every targeted module of this stage's layers."""
    expected: set[str] = set()
    out = []
    cfg = model.config
    for i, layer in enumerate(model.layers):
        index = model.layer_range.start + i
        for module in TARGETS:
            block, name, part = _SITES[module]
            key = f"{_PEFT_PREFIX}model.layers.{index}.{block}.{module}"
            if module not in spec.modules:
                continue
            expected |= {key + ".lora_A.weight", key + ".lora_B.weight"}
            a, b = tensors.get(key + ".lora_A.weight"), tensors.get(key + ".lora_B.weight")
            if a is None or b is None:
                raise AdapterError(f"lora: the adapter lacks {key}.lora_A/lora_B, which its target_modules name")
            linear = getattr(getattr(layer, block), name, None)
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                raise AdapterError(f"lora: {module} of layer {index} is not a linear pagemesh adapts (an MoE block)")
            rank = spec.rank_of(module)
            full_in, full_out = _full_shape(cfg, module)
            if tuple(a.shape) != (rank, full_in) or tuple(b.shape) != (full_out, rank):
                raise AdapterError(
                    f"lora: {key} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base model needs "
                    f"({rank}, {full_in}) and ({full_out}, {rank}): an adapter of another base model"
                )
            b = b.float() * spec.scaling_of(module)
            if hasattr(linear, "local_sizes"):
                start, size = linear.tp.shard(linear.output_sizes[part], "output")
                b = b[start : start + size]
            else:
                _, local = linear.tp.shard(full_in, "input")
                a = a[:, linear.in_start : linear.in_start + local]
            out.append((linear, part, a, b))
    stray = sorted(k for k in tensors if k not in expected and not _other_stage(k, model))
    if stray:
        raise AdapterError(f"lora: the adapter has tensors pagemesh does not serve, e.g. {stray[:2]}")
    return out


def _other_stage(key: str, model: nn.Module) -> bool:
    """A pipeline stage reads only its own layers' tensors; another stage's are not stray."""
    prefix = f"{_PEFT_PREFIX}model.layers."
    if not key.startswith(prefix):
        return False
    index = key[len(prefix) :].split(".", 1)[0]
    return index.isdigit() and int(index) not in model.layer_range and int(index) < model.config.num_layers


def _full_shape(cfg, module: str) -> tuple[int, int]:
    """(in, out) of an HF module of the whole (unsharded) model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (cfg.hidden_size, q),
        "k_proj": (cfg.hidden_size, kv),
        "v_proj": (cfg.hidden_size, kv),
        "o_proj": (q, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }[module]


class ServedAdapters:
    """The model runner's side: the model's slots (`attach_lora`), the adapters a step loads
    into them, and which slot each of its rows uses. Adapters read from disk stay in host memory,
    the `max_cpu_loras` most recently loaded, so that one evicted from its slot and wanted again
    is copied back, not read again."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int):
        self.model, self.max_rank, self.max_cpu_loras = model, max_rank, max_cpu_loras
        self.batch = attach_lora(model, max_loras, max_rank)
        self._host: OrderedDict[str, tuple[AdapterSpec, dict[str, torch.Tensor]]] = OrderedDict()

    def prepare(self, lora_loads: list, lora_rows: list[int], device: torch.device) -> bool:
        """Before a step's forward pass: load its adapters into their slots, tell the linears
        each row's slot. Whether any row uses an adapter."""
        for slot, path in lora_loads:
            spec, tensors = self._read(path)
            load_adapter(self.model, slot, spec, tensors)
        rows = torch.tensor(lora_rows, dtype=torch.int64).to(device) if lora_rows else None
        self.batch.set_rows(rows)
        return self.batch.row_slots is not None

    def _read(self, path: str) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
        from pagemesh.common.lora import read_adapter_spec

        held = self._host.pop(path, None)
        if held is None:
            spec = read_adapter_spec(path, self.max_rank)
            held = (spec, read_adapter_tensors(spec))
        self._host[path] = held
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return held
