"""How much of a prompt each worker already holds in its prefix cache, as the scheduler knows it.

    prompt ids ──prefix_page_hashes──▶ [k0, k1, k2, k3]        k2 stands for pages 0..2 (chained)
    worker.page_hashes  {k0, k1, k3, ...}  ──leading run──▶ 2 cached pages (k3 without k2 is no hit)

Workers report the keys they publish and evict as KV cache events (`KVEventBatch`, applied by
services/scheduler/kv_event_index.py: a key held in the pool or the offload tier counts); the
keys come from the block manager's own function, so a worker's keys and the scheduler's agree
for equal prefixes.
Pure Python: no torch, no sockets.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagemesh.common.page_hash import prefix_page_hashes
from pagemesh.services.scheduler.registry import WorkerInfo


class PromptPages:
    """One prompt's page keys, computed once per page size on first use."""

    def __init__(self, token_ids: Sequence[int], lora: str | None = None):
        self.token_ids = token_ids
        self.lora = lora  # its LoRA adapter: placed on workers that serve it, by preference one holding it
        self._keys: dict[int, list[int]] = {}

    def keys(self, page_size: int) -> list[int]:
        """Keys of the pages a worker's `match_prefix` could reuse (every full page but one
        that would leave no token to compute)."""
        keys = self._keys.get(page_size)
        if keys is None:
            keys = self._keys[page_size] = prefix_page_hashes(self.token_ids, page_size)
        return keys

    def cached_pages(self, worker: WorkerInfo) -> int:
        """Leading pages of this prompt that `worker` reported holding (none for an adapter's
        prompt: its pages' keys start from the adapter's digest, which the scheduler does not know)."""
        if not worker.page_hashes or self.lora is not None:
            return 0
        count = 0
        for key in self.keys(worker.page_size):
            if key not in worker.page_hashes:
                break
            count += 1
        return count

    def cached_fraction(self, worker: WorkerInfo) -> float:
        """Share of the reusable pages `worker` holds, in [0, 1]."""
        if not worker.page_hashes or self.lora is not None:
            return 0.0
        keys = self.keys(worker.page_size)
        return self.cached_pages(worker) / len(keys) if keys else 0.0
