"""The one place that chooses what runs the math on this device: `select_backend(device, dtype)`.

    CUDA  -> Triton attention and ops (`kernels/`); dense linears; torch sampling on the GPU
    CPU   -> the C kernels of `pagemesh.kernels.cpu` for attention, ops and greedy argmax where they build
             and run the dtype (else plain torch, with a warning); bf16 linear weights repacked
             once, into AMX tiles too where the CPU grants AMX

Environment switches (read by `pagemesh.kernels.cpu`): PAGEMESH_CPU_KERNELS=0 takes the torch path,
PAGEMESH_AMX=0 keeps the linears on oneDNN. The runner, the model (through `ForwardContext`) and
the sampler take the chosen `Backend`; none of them asks the device again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagemesh.workers.engine.attention import paged_attention_torch, prefill_attention_torch, write_kv_torch
from pagemesh.workers.model.llama import AttentionBackend
from pagemesh.workers.model.ops import CpuKernelOps, ModelOps, TorchOps, TritonOps

log = logging.getLogger(__name__)  # stdlib: the engine imports without the mesh's packages


class TorchAttentionBackend:
    """The CPU path without a C compiler: gather pages with index ops, attend with torch SDPA."""

    builds_cpu_indices = True
    decode_gather = True

    def write_kv(self, k, v, kv_layer, md):
        write_kv_torch(k, v, kv_layer, md)

    def attend(self, q, kv_layer, md, scale, k=None, v=None, *, window=None, softcap=None):
        return paged_attention_torch(q, kv_layer, md, scale, k, v, window=window, softcap=softcap)


class CpuKernelAttentionBackend:
    """The CPU path: the C kernels of `pagemesh.kernels.cpu` write K/V into their slots and attend the
    decodes reading pages in place; prefill chunks (long query runs, where a matmul-based SDPA
    wins) gather their pages and use torch SDPA."""

    builds_cpu_indices = True
    decode_gather = False
    # write_kv and the decodes' attend are pagemesh.kernels.cpu's, nothing around them: the model's
    # DecodeLayers (workers/model/decode_layers.py) may call them inside its one C call instead
    cpu_decode_kernels = True

    def __init__(self, batch_invariant: bool = False) -> None:
        import pagemesh.kernels.cpu

        self.kernels = pagemesh.kernels.cpu
        # every query row through the decode kernel, prefill chunks too: a row's reduction over
        # its keys is then the same whatever else the step holds (docs/perf/batch_invariance.md)
        self.batch_invariant = batch_invariant

    def write_kv(self, k, v, kv_layer, md):
        self.kernels.write_kv(k, v, kv_layer, md.slot_mapping)

    def attend(self, q, kv_layer, md, scale, k=None, v=None, *, window=None, softcap=None):
        nd = md.num_decodes
        variant = {"window": window, "softcap": softcap}
        if nd == q.shape[0] or self.batch_invariant:
            return self.kernels.paged_attention(
                q, kv_layer, md.block_tables, md.seq_lens, md.query_start_loc, scale, **variant
            )
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.kernels.paged_attention(
                q[:nd], kv_layer, md.block_tables[:nd], md.seq_lens[:nd], md.query_start_loc[: nd + 1], scale, **variant
            )
        prefill_attention_torch(q, kv_layer, md, scale, out, k, v, **variant)
        return out


class TritonAttentionBackend:
    """The GPU path: the Triton kernels of `kernels/` read pages through block tables."""

    builds_cpu_indices = False
    decode_gather = False

    def __init__(self) -> None:
        import pagemesh.kernels

        self.kernels = pagemesh.kernels

    def write_kv(self, k, v, kv_layer, md):
        self.kernels.write_kv(k, v, kv_layer, md.slot_mapping)

    def attend(self, q, kv_layer, md, scale, k=None, v=None, *, window=None, softcap=None):  # K/V from the pages
        return self.kernels.paged_attention(
            q,
            kv_layer,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            scale,
            md.max_query_len,
            md.max_seq_len,
            window=window,
            softcap=softcap,
        )


@dataclass(frozen=True)
class Backend:
    """What runs one engine's math, chosen once. `attention` and `ops` go into every
    `ForwardContext`; `pack_linears` / `amx` say how the runner repacks the linear weights;
    `first_max` is the sampler's greedy pick."""

    device: torch.device
    dtype: torch.dtype
    attention: AttentionBackend
    ops: ModelOps
    pack_linears: bool = False  # CPU: repack bf16 linear weights once (workers.model.layers)
    amx: bool = False  # ... into AMX tiles as well
    cpu_argmax: bool = False  # greedy rows of fp32 host logits through pagemesh.kernels.cpu.argmax_rows
    batch_invariant: bool = False  # every row's numbers independent of the batch (docs/perf/batch_invariance.md)

    def first_max(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum, as argmax. On a CPU the C kernel does it in one pass
        (0.1 ms on [32, 49152] here); torch's max().indices is 0.4 ms, argmax 1.1 ms."""
        if self.cpu_argmax and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            import pagemesh.kernels.cpu

            return pagemesh.kernels.cpu.argmax_rows(logits)
        return logits.max(dim=-1).indices


def cpu_kernels_usable(dtype: torch.dtype) -> bool:
    """Whether the C kernels run this dtype here (building them on first call)."""
    import pagemesh.kernels.cpu

    return pagemesh.kernels.cpu.supports(dtype) and pagemesh.kernels.cpu.available()


def select_backend(device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> Backend:
    """The backend for a model of `dtype` on `device` (see the module docstring). `batch_invariant`:
    attention whose rows do not depend on the batch (the C kernels on a CPU; ValueError where
    this device has no such path)."""
    if device.type == "cuda":
        if batch_invariant:
            raise ValueError("batch_invariant: only on a CPU for now (the Triton kernels split reductions by batch)")
        return Backend(device, dtype, TritonAttentionBackend(), TritonOps())
    import pagemesh.kernels.cpu

    if cpu_kernels_usable(dtype):
        attention, ops = CpuKernelAttentionBackend(batch_invariant), CpuKernelOps()
    elif batch_invariant:
        reason = pagemesh.kernels.cpu.load_error() or f"no C kernels for {dtype}"
        raise ValueError(f"batch_invariant: needs the C attention kernels ({reason})")
    else:
        reason = pagemesh.kernels.cpu.load_error() or f"no C kernels for {dtype}"
        log.warning("cpu_kernels_unavailable (%s): attention falls back to torch SDPA over gathered pages", reason)
        attention, ops = TorchAttentionBackend(), TorchOps()
    return Backend(
        device,
        dtype,
        attention,
        ops,
        pack_linears=dtype == torch.bfloat16,
        amx=dtype == torch.bfloat16 and pagemesh.kernels.cpu.amx_available(),
        cpu_argmax=pagemesh.kernels.cpu.available(),
        batch_invariant=batch_invariant,
    )
