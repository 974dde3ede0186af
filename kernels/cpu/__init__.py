"""CPU kernels in C (the `pagemesh_cpu` library: norm.c, activation.c, rotary.c, kv_write.c,
attention.c, attention_fp8.c, amx_linear.c, sampling.c; build.SOURCES), for the model runner's CPU path.

The Triton kernels next door are the GPU path; on a CPU, Triton only interprets. These do the
same jobs in compiled C with OpenMP (sharing torch's OpenMP threads), on fp32 or bf16 tensors:

    add_rms_norm(x, residual, weight, eps) -> (out, residual)   residual updated in place
    silu_and_mul(x) -> out
    rotary_(q, k, positions, cos_sin_cache) -> (q, k)            in place
    write_kv(k, v, kv_layer, slot_mapping) -> None               into the pages
    paged_attention(q, kv_layer, block_tables, seq_lens, query_start_loc, scale, *, window, softcap) -> out
    amx_pack(w) -> packed; amx_linear(x, packed, bias) -> x W^T (+ b)   bf16, where the CPU has AMX
    argmax_rows(logits) -> first maximum per row                      greedy sampling

`available()` builds the library on first use (a second or two with gcc) and says whether it
loaded; callers fall back to torch when it did not. Shapes and strides are checked here, before
the C code, which trusts them.
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagemesh.kernels.cpu import build

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lib: ctypes.PyDLL | None = None  # _library's, once available() has loaded it

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "pm_add_rms_norm": [_P, _P, _P, _P, _I64, _I64, _F, _I32],
    "pm_silu_and_mul": [_P, _P, _I64, _I64, _I32],
    "pm_rotary": [_P, _I64, _P, _I64, _I64, _I32, _I32, _I32, _P, _P, _I32],
    "pm_write_kv": [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _I32, _I32],
    "pm_paged_attention": [_P, _I64, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _F, _I32, _F, _I32],
    "pm_amx_pack": [_P, _P, _I64, _I64],
    "pm_amx_linear": [_P, _P, _P, _P, _I32, _I64, _I64, _I64],
    "pm_argmax_rows": [_P, _I64, _I64, _I64, _P],
    "pm_lora_add": [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I32, _I32],
    "pm_paged_attention_fp8": [_P, _I64, _P, _P, _P, _I64, _P, _P, *[_I32] * 5, _F, _I32, _F, _P, _I32, _I32],
    "pm_write_kv_fp8": [_P, _I64, _P, _I64, _I64, _I32, _I32, _P, _P, _I32, _P, _I32, _I32],
}
_library = build.Library(build.SOURCES, _SIGNATURES, build.LIBRARY_NAME)
FP8_DTYPES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}  # an fp8 KV pool's formats (FP8_E4M3, FP8_E5M2)
_amx: bool | None = None


def available() -> bool:
    """Build and load the library once; False (with `load_error()`) where that fails or
    PAGEMESH_CPU_KERNELS=0."""
    global _lib
    _lib = _library.load()
    return _lib is not None


def load_error() -> str | None:
    return _library.error


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def _code(t: torch.Tensor) -> int:
    if t.dtype not in _DTYPES:
        raise TypeError(f"CPU kernels take float32 or bfloat16, not {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError("CPU kernels take CPU tensors")
    return _DTYPES[t.dtype]


def _rows(t: torch.Tensor, name: str) -> int:
    """Row stride of a [rows, ...] tensor whose rows are each contiguous."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            raise ValueError(f"{name}: each row must be contiguous")
        expected *= size
    return t.stride(0)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    dt = _code(x)
    if not x.is_contiguous() or (residual is not None and (not residual.is_contiguous() or residual.shape != x.shape)):
        raise ValueError("add_rms_norm: x and residual must be contiguous and of one shape")
    if weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError("add_rms_norm: weight must be [hidden] in x's dtype")
    cols = x.shape[-1]
    out = torch.empty_like(x)
    _lib.pm_add_rms_norm(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        out.data_ptr(),
        weight.data_ptr(),
        x.numel() // cols,
        cols,
        eps,
        dt,
    )
    return out, (x if residual is None else residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    dt = _code(x)
    if not x.is_contiguous() or x.shape[-1] % 2:
        raise ValueError("silu_and_mul: x must be contiguous with an even last dimension")
    cols = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], cols)
    _lib.pm_silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // (2 * cols), cols, dt)
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """q [T, H, D], k [T, KVH, D] (rows may be strided, heads contiguous), rotated in place."""
    dt = _code(q)
    tokens, heads, dim = q.shape
    if k.dtype != q.dtype or k.shape[0] != tokens or k.shape[2] != dim:
        raise ValueError("rotary_: q and k must share dtype, token count and head_dim")
    if positions.dtype != torch.int64 or positions.shape != (tokens,) or not positions.is_contiguous():
        raise ValueError("rotary_: positions must be a contiguous int64 [T]")
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous() or cos_sin_cache.shape[1] != dim:
        raise ValueError("rotary_: cos_sin_cache must be a contiguous fp32 [max_pos, head_dim]")
    _lib.pm_rotary(
        q.data_ptr(),
        _rows(q, "q"),
        k.data_ptr(),
        _rows(k, "k"),
        tokens,
        heads,
        k.shape[1],
        dim,
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        dt,
    )
    return q, k


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """k, v [T, KVH, D] into kv_layer [pages, 2, page_size, KVH, D] at slot_mapping (int64 [T]).
    An fp8 layer takes its `kv_scales` [2, KVH] fp32: k / scale, saturated, rounded to nearest
    (torch's conversion, the same bytes as workers/engine/kv_quant.quantize), copied as bytes."""
    if kv_layer.dtype in FP8_DTYPES:
        return _write_kv_fp8(k, v, kv_layer, slot_mapping, kv_scales)
    dt = _code(k)
    if v.dtype != k.dtype or kv_layer.dtype != k.dtype or v.shape != k.shape or kv_layer.shape[-2:] != k.shape[1:]:
        raise ValueError("write_kv: k, v and the KV layer must agree in dtype and [kv_heads, head_dim]")
    if not kv_layer.is_contiguous() or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("write_kv: contiguous KV layer and int64 slot mapping required")
    _lib.pm_write_kv(
        k.data_ptr(),
        _rows(k, "k"),
        v.data_ptr(),
        _rows(v, "v"),
        k.shape[0],
        k.shape[1] * k.shape[2],
        kv_layer.data_ptr(),
        slot_mapping.data_ptr(),
        kv_layer.shape[2],
        dt,
    )


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] (sequence s's rows query_start_loc[s]:[s+1], the last of
    them its newest token) over the pages of block_tables [S, max_pages] (int32); seq_lens
    (int32 [S]) counts each sequence's tokens including this step's. Returns [T, H, D].
    An fp8 layer (FP8_DTYPES) is read with its `kv_scales` [2, KVH] fp32 (K's, V's).
    `window` W: a query at position p sees keys p - W < j <= p, and no page wholly before that is
    read; `softcap` c: scores become c * tanh(scores / c) before the softmax."""
    dt = _code(q)
    tokens, heads, dim = q.shape
    num_kv_heads = kv_layer.shape[-2]
    fp8 = kv_layer.dtype in FP8_DTYPES
    if fp8 and (kv_scales is None or kv_scales.dtype != torch.float32 or kv_scales.shape != (2, num_kv_heads)):
        raise ValueError(f"paged_attention: an fp8 KV layer needs kv_scales fp32 [2, {num_kv_heads}]")
    if not fp8 and kv_layer.dtype != q.dtype:
        raise ValueError("paged_attention: q and the KV layer must agree in dtype")
    if kv_layer.shape[-1] != dim or heads % num_kv_heads or not kv_layer.is_contiguous():
        raise ValueError("paged_attention: q and a contiguous KV layer must agree in head_dim")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"paged_attention: {name} must be contiguous int32")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("paged_attention: one block table row and seq_len per sequence, S+1 query starts")
    if int(query_start_loc[-1]) != tokens:
        raise ValueError("paged_attention: query_start_loc[-1] must equal the number of query rows")
    if (window is not None and window < 1) or (softcap is not None and softcap <= 0):
        raise ValueError(f"paged_attention: window {window} and softcap {softcap} must be positive")
    variant = (window or 0, softcap or 0.0)
    out = q.new_empty(tokens, heads, dim)
    if fp8:
        kv_scales = kv_scales.contiguous()
        _lib.pm_paged_attention_fp8(
            q.data_ptr(),
            _rows(q, "q"),
            out.data_ptr(),
            kv_layer.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            query_start_loc.data_ptr(),
            num_seqs,
            heads,
            num_kv_heads,
            dim,
            kv_layer.shape[2],
            scale,
            *variant,
            kv_scales.data_ptr(),
            FP8_DTYPES[kv_layer.dtype],
            dt,
        )
        return out
    _lib.pm_paged_attention(
        q.data_ptr(),
        _rows(q, "q"),
        out.data_ptr(),
        kv_layer.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        num_seqs,
        heads,
        num_kv_heads,
        dim,
        kv_layer.shape[2],
        scale,
        *variant,
        dt,
    )
    return out


def _write_kv_fp8(k, v, kv_layer, slot_mapping, kv_scales) -> None:
    num_kv_heads = kv_layer.shape[-2]
    if kv_scales is None or kv_scales.dtype != torch.float32 or kv_scales.shape != (2, num_kv_heads):
        raise ValueError(f"write_kv: an fp8 KV layer needs kv_scales fp32 [2, {num_kv_heads}]")
    if v.shape != k.shape or kv_layer.shape[-2:] != k.shape[1:] or not kv_layer.is_contiguous():
        raise ValueError("write_kv: k, v and a contiguous KV layer must agree in [kv_heads, head_dim]")
    if v.dtype != k.dtype or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("write_kv: k and v of one dtype, and an int64 contiguous slot mapping")
    kv_scales = kv_scales.contiguous()
    _lib.pm_write_kv_fp8(
        k.data_ptr(),
        _rows(k, "k"),
        v.data_ptr(),
        _rows(v, "v"),
        k.shape[0],
        k.shape[1],
        k.shape[2],
        kv_layer.data_ptr(),
        slot_mapping.data_ptr(),
        kv_layer.shape[2],
        kv_scales.data_ptr(),
        FP8_DTYPES[kv_layer.dtype],
        _code(k),
    )


def write_kv_fp8_reference(k, v, kv_layer, slot_mapping, kv_scales) -> None:
    """What pm_write_kv_fp8 writes, in torch (the bytes of workers/engine/kv_quant.quantize): its
    tests' reference."""
    page_size, limit = kv_layer.shape[2], torch.finfo(kv_layer.dtype).max
    rows = slot_mapping // page_size * (2 * page_size) + slot_mapping % page_size  # K rows of [pages*2*S, KVH, D]
    flat = kv_layer.view(torch.uint8).view(-1, *k.shape[1:])
    for half, x in ((0, k), (1, v)):
        fp8 = (x.float() / kv_scales[half][:, None]).clamp_(-limit, limit).to(kv_layer.dtype)
        flat.index_copy_(0, rows + half * page_size, fp8.view(torch.uint8))


def amx_available() -> bool:
    """Whether amx_linear can run: the library was built with AMX (the CPU has AMX-BF16) and
    Linux granted this process the tile registers."""
    global _amx
    if _amx is None:
        _amx = available() and os.environ.get("PAGEMESH_AMX", "1") != "0" and bool(_lib.pm_amx_init())
    return _amx


def amx_pack(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 (N % 16 == 0, K % 32 == 0) in the tile layout amx_linear reads."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[0] % 16 or w.shape[1] % 32:
        raise ValueError("amx_pack: W must be bf16 [N, K] with N % 16 == 0 and K % 32 == 0")
    if not amx_available():
        raise RuntimeError("amx_pack: no AMX on this CPU or process")
    w = w.contiguous()
    n, k = w.shape
    packed = w.new_empty(n // 16, k // 32, 16, 32)
    _lib.pm_amx_pack(w.data_ptr(), packed.data_ptr(), n, k)
    return packed


def amx_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x [M, K] W^T (+ bias) in bf16 with fp32 sums, W as amx_pack left it. out_dtype float32:
    the same bf16 values, widened (as `.float()` of the bf16 result, without the second pass)."""
    nb, kb = packed.shape[0], packed.shape[1]
    n, k = nb * 16, kb * 32
    if x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"amx_linear: x must be bf16 [M, {k}]")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"amx_linear: bias must be a contiguous bf16 [{n}]")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("amx_linear: out_dtype is bfloat16 or float32")
    x = x.contiguous()
    out = x.new_empty(x.shape[0], n, dtype=out_dtype)
    _lib.pm_amx_linear(
        x.data_ptr(),
        packed.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        int(out_dtype == torch.float32),
        x.shape[0],
        n,
        k,
    )
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row of a float32 [R, V] (rows may be strided; a row holding NaN
    gives its first NaN), as `x.max(dim=-1).indices`, in one pass. int64 [R]."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
        raise ValueError("argmax_rows: x must be float32 [R, V] with V > 0 and contiguous rows")
    if not available():
        raise RuntimeError(f"argmax_rows: {load_error()}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib.pm_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def lora_add_(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, width: int
) -> torch.Tensor:
    """y += each row's LoRA delta, in place (lora.c): row r under slot slots[r] (-1: none) adds
    (x[r] a_s^T) b_s, a_s and b_s being rows s*width .. (s+1)*width-1 of a [slots*width, in] and
    b [slots*width, out]. x and y contiguous [rows, in] and [rows, out] of one dtype; a and b of one.
    (`lora_segments(slots)` groups the rows by slot; a caller with many linears per step passes
    its result to `lora_add_grouped_` instead, once computed.)"""
    return lora_add_grouped_(y, x, a, b, lora_segments(slots), width)


def lora_segments(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's adapter rows grouped by slot: (rows in slot order, segment starts, segment slots);
    rows with slot -1 are in none."""
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError("lora_segments: slots must be int64 [R]")
    order = torch.argsort(slots, stable=True)
    order = order[slots[order] >= 0].contiguous()
    seg_slots, counts = torch.unique_consecutive(slots[order], return_counts=True)
    starts = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    return order, starts, seg_slots.contiguous()


def lora_add_grouped_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    segments: tuple,
    width: int,
    part_cols: torch.Tensor | None = None,
) -> torch.Tensor:
    """`lora_add_` with the rows already grouped (`lora_segments`). `part_cols` (int64 [parts + 1]):
    a fused linear's parts, each slot's rows in parts of width / parts rows whose B is non-zero only
    in that part's columns part_cols[p] .. part_cols[p + 1] (None: one part, every column)."""
    order, starts, seg_slots = segments
    if part_cols is None:
        part_cols = torch.tensor([0, y.shape[1]], dtype=torch.int64)
    parts = len(part_cols) - 1
    if parts < 1 or width % parts or int(part_cols[-1]) != y.shape[1] or part_cols.dtype != torch.int64:
        raise ValueError("lora_add_: part_cols must be int64 [parts + 1] ending at y's width, parts dividing width")
    rows, fan_in = x.shape
    if y.shape[0] != rows or a.shape[1] != fan_in or b.shape[0] != a.shape[0] or b.shape[1] != y.shape[1]:
        raise ValueError("lora_add_: shapes must be y [R, out], x [R, in], a [S*W, in], b [S*W, out]")
    if width < 1 or a.shape[0] % width or not all(t.is_contiguous() for t in (x, y, a, b)):
        raise ValueError("lora_add_: contiguous tensors, a's rows a whole number of slots of `width`")
    if x.dtype != y.dtype or a.dtype != b.dtype:
        raise ValueError("lora_add_: x and y of one dtype, a and b of one")
    if len(seg_slots) and int(seg_slots[-1]) >= a.shape[0] // width:
        raise ValueError("lora_add_: a slot beyond a's")
    if not available():
        raise RuntimeError(f"lora_add_: {load_error()}")
    _lib.pm_lora_add(
        x.data_ptr(), y.data_ptr(), a.data_ptr(), b.data_ptr(), order.data_ptr(), starts.data_ptr(),
        seg_slots.data_ptr(), len(seg_slots), fan_in, y.shape[1], width, width // parts, part_cols.data_ptr(),
        _code(x), _code(a),
    )  # fmt: skip
    return y
