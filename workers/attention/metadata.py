"""Where one step's tokens are in the paged KV pool: `AttentionMetadata`, built once per step by
the engine (`AttentionMetadata.build`, workers/engine/model_runner.py) and read by the model
(`ForwardContext.metadata`, workers/model/) and by every attention backend (workers/engine/backend.py,
fp8_attention.py), which hand its tensors to the kernels. It sits below both the model and the
engine, so neither has to import the other for it.

Per layer the pool is `kv[page, 2, slot, kv_head, head_dim]` (docs/design.md §3). Viewed flat as
`[page * 2 * page_size + (0 | page_size) + slot, kv_head, head_dim]`, the K of the token in slot
`o` of page `p` is row `p*2*S + o` and its V is `page_size` rows further. The CPU path's gather
indices (`write_index`, `decode_pages`, `prefills`) are computed here once per step and reused by
every layer.

Batch order: the scheduler puts decodes (one query token each) first, prefill chunks follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class PrefillSlice:
    query_start: int
    query_len: int
    key_index: torch.Tensor  # [L] flat K rows of the sequence's whole context
    mask: torch.Tensor | None  # [q_len, L] bool, None when the chunk is the whole context


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys are, for one step."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset
    query_start_loc: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32, context length after this step
    block_tables: torch.Tensor  # [S, max_pages] int32, 0-padded
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes sequences have query length 1
    page_size: int
    # CPU path: flat row indices, computed once per step
    write_index: torch.Tensor | None = None  # [T] K rows to write
    decode_pages: torch.Tensor | None = None  # [num_decodes, max_pages] page ids (0-padded)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_pages * page_size] bool
    prefills: list[PrefillSlice] | None = None
    _decode_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # decode_mask_for's

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        page_size: int,
        device: torch.device,
        for_cpu: bool,
        decode_gather: bool = True,
    ) -> AttentionMetadata:
        """for_cpu: build the prefill slices (and, with decode_gather, the row indices of the
        torch decode path); the GPU kernels and the C decode kernel read block tables.

        The host-side indices are numpy array operations (a Python step per sequence only to copy
        its block table): this runs every step, ~0.5 ms at 128 sequences x 250 pages here."""
        num_seqs = len(query_lens)
        qlens = np.asarray(query_lens, dtype=np.int64)
        slens = np.asarray(seq_lens, dtype=np.int64)
        longer = np.flatnonzero(qlens != 1)
        num_decodes = int(longer[0]) if len(longer) else num_seqs
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(qlens, out=starts[1:])
        table = np.zeros((num_seqs, max(len(t) for t in block_tables)), dtype=np.int32)
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = t
        # token j of sequence s (rows starts[s]..) sits at position seq_len - q_len + j
        seq_of_token = np.repeat(np.arange(num_seqs), qlens)
        positions = np.arange(starts[-1]) + np.repeat(slens - qlens - starts[:-1], qlens)
        pages = table[seq_of_token, positions // page_size].astype(np.int64)
        md = cls(
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(pages * page_size + positions % page_size),
            query_start_loc=torch.from_numpy(starts.astype(np.int32)),
            seq_lens=torch.from_numpy(slens.astype(np.int32)),
            block_tables=torch.from_numpy(table),
            max_query_len=int(qlens.max()),
            max_seq_len=int(slens.max()),
            num_decodes=num_decodes,
            page_size=page_size,
        )
        if for_cpu:
            md._build_cpu_indices(query_lens, seq_lens, torch.from_numpy(pages), decode_gather)
        return md.to(device)

    def _build_cpu_indices(
        self, query_lens: list[int], seq_lens: list[int], token_pages: torch.Tensor, decode_gather: bool
    ) -> None:
        size = self.page_size
        table = self.block_tables.to(torch.int64)
        if decode_gather:  # the torch path's K/V writes (the C kernels write by slot_mapping)
            self.write_index = token_pages * 2 * size + self.positions % size
        if self.num_decodes and decode_gather:
            lens = self.seq_lens[: self.num_decodes].to(torch.int64)
            num_pages = -(-int(lens.max()) // size)
            self.decode_pages = table[: self.num_decodes, :num_pages]
            pos = torch.arange(num_pages * size, dtype=torch.int64)
            self.decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :]
        self.prefills = []
        for s in range(self.num_decodes, len(query_lens)):
            q, length = query_lens[s], seq_lens[s]
            pos = torch.arange(length, dtype=torch.int64)
            key_index = table[s, pos // size] * 2 * size + pos % size
            mask = None
            if length != q:  # attends to earlier pages: causal with an offset
                mask = pos[None, :] <= (length - q + torch.arange(q))[:, None]
            start = int(self.query_start_loc[s])
            self.prefills.append(PrefillSlice(start, q, key_index, mask))

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """`decode_mask` for a layer of sliding `window` (None: a full-attention layer's, the mask
        itself): a decode at position p = seq_len - 1 sees keys p - window < j <= p. Built once per
        window and step."""
        if window is None or self.decode_mask is None:
            return self.decode_mask
        mask = self._decode_masks.get(window)
        if mask is None:
            lens = self.seq_lens[: self.num_decodes].to(torch.int64)
            pos = torch.arange(self.decode_mask.shape[-1], dtype=torch.int64)
            mask = self.decode_mask & (pos[None, :] >= (lens - window)[:, None])[:, None, None, :]
            self._decode_masks[window] = mask
        return mask

    def to(self, device: torch.device) -> AttentionMetadata:
        if device.type == "cpu":
            return self
        for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        return self
