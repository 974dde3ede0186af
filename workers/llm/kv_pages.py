"""Moving a request's KV pages between workers: pack on the prefill side, check and write on the
decode side. The wire format is `KVPagesHeader` + one tensor frame per layer (common.protocol).

    prefill pool kv[L, P, 2, S, H, D] --index_select(pages)--> [L, n, 2, S, H, D] --frames-->
    decode pool  kv[L, P', 2, S, H, D] <--copy into its own freshly allocated pages--

An fp8 pool's pages travel as fp8 with the sender's scales in the header. The receiver converts
what differs from its own pool (another dtype, other scales: `kv_quant.convert_pages`), so a
bf16 prefill worker can feed an fp8 decode worker and the other way round.

Only the pages the decode worker lacks travel: the scheduler says how many leading prompt pages
it holds (`skip_pages`), and the header's `page_indices` are the logical pages sent, always the
tail [skip, total) of the prompt's pages.
"""

from __future__ import annotations

import torch

from common.messages import KVPagesHeader
from workers.engine.engine import PrefillResult
from workers.engine.kv_quant import convert_pages, is_fp8

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def pack_pages(
    kv_cache: torch.Tensor, result: PrefillResult, skip_pages: int = 0, kv_scales: torch.Tensor | None = None
) -> tuple[KVPagesHeader, list[torch.Tensor]]:
    """One contiguous CPU tensor per layer holding the request's prompt pages from `skip_pages`
    on, and the header. At least the last page is always sent. An fp8 pool passes its
    `kv_scales` [layers, 2, KVH]: they go in the header."""
    total = len(result.block_table)
    skip = max(0, min(skip_pages, total - 1))
    index = torch.tensor(result.block_table[skip:], dtype=torch.int64, device=kv_cache.device)
    pages = kv_cache.index_select(1, index).cpu()  # [L, n, 2, S, H, D], one copy
    header = KVPagesHeader(
        request_id=result.request_id,
        seq_index=0,
        num_tokens=len(result.prompt_token_ids),
        layer_start=0,
        layer_end=kv_cache.shape[0],
        num_pages=total - skip,
        dtype=DTYPE_NAMES[kv_cache.dtype],
        page_shape=list(kv_cache.shape[2:]),
        checksum=0,  # filled in by encode_tensor_frames
        first_token_ids=list(result.first_token_ids),
        last=True,
        page_indices=list(range(skip, total)),
        kv_scales=[] if kv_scales is None else kv_scales.flatten().tolist(),
    )
    return header, list(pages.unbind(0))


def check_header(header: KVPagesHeader, kv_cache: torch.Tensor, prompt_len: int) -> int:
    """Raise ValueError unless the pages fit this worker's pool exactly. Returns how many leading
    prompt pages the header skips (the receiver must hold them already)."""
    layers, _, *page_shape = kv_cache.shape
    page_size = page_shape[1]
    if (header.layer_start, header.layer_end) != (0, layers):
        raise ValueError(f"kv: layers [{header.layer_start}, {header.layer_end}) but the model has {layers}")
    if header.page_shape != page_shape:
        raise ValueError(f"kv: page shape {header.page_shape}, this pool's is {page_shape}")
    if header.dtype not in DTYPES_BY_NAME:  # any other is converted on write (write_pages)
        raise ValueError(f"kv: dtype {header.dtype}, this pool takes {sorted(DTYPES_BY_NAME)}")
    total = -(-prompt_len // page_size)
    if header.num_tokens != prompt_len or not 1 <= header.num_pages <= total:
        raise ValueError(f"kv: {header.num_pages} pages for {header.num_tokens} tokens, the prompt has {prompt_len}")
    skip = total - header.num_pages
    if header.page_indices != list(range(skip, total)):
        raise ValueError(f"kv: pages must be the prompt's last {header.num_pages} of {total}, in order")
    return skip


def write_pages(
    kv_cache: torch.Tensor,
    block_table: list[int],
    layers: list[torch.Tensor],
    sent_scales: list[float] | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Copy received pages into the pool at `block_table` (one copy per layer), converted first
    where the sender's dtype or `sent_scales` (the header's) differ from this pool's (`kv_scales`
    [layers, 2, KVH] for an fp8 pool)."""
    index = torch.tensor(block_table, dtype=torch.int64, device=kv_cache.device)
    heads = kv_cache.shape[-2]
    sent = torch.tensor(sent_scales).view(len(layers), 2, heads) if sent_scales else None
    fp8 = is_fp8(kv_cache.dtype)
    for layer, pages in enumerate(layers):
        own = None if kv_scales is None else kv_scales[layer]
        pages = convert_pages(pages, None if sent is None else sent[layer], kv_cache.dtype, own)
        pages = pages.to(kv_cache.device, non_blocking=True)
        if fp8:  # torch has no fp8 index_copy_ on a CPU: the same bytes
            kv_cache[layer].view(torch.uint8).index_copy_(0, index, pages.view(torch.uint8))
        else:
            kv_cache[layer].index_copy_(0, index, pages)
