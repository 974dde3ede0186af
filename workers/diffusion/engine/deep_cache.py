"""DeepCache inside a step batch: each request keeps its own cache of the U-Net's deep feature,
and each row decides for itself whether it runs the deep branch this step (the policies are
cache_policy.py's; a U-Net serves `none` and `interval:N`).

One forward over a batch whose rows come from requests with different policies, at different
steps (`rows` of a request are contiguous in the batch; the parts are the pipeline's
`deep_cache_forward`, a DeepCacheForward of pipelines/base.py):

    latents ──shallow_down (every row)──▶ shallow: embeddings, conv_in + down block 0's skips
                            │ interval rows: the step number decides (warm-up / cool-down compute)
                            ▼
         deep branch on the computing rows only (index_select ─▶ down 1.., mid, up ..-2 ─▶ index_copy)
                            │ computing rows with a cache: their feature stored
         reusing rows: the feature stored at their last computed step  ─▶ feature [B, C, h, w]
                            ▼
         shallow_up (every row): the last up block on feature + fresh skips ─▶ the model output

A request with policy none (or whose cache did not fit the worker's budget) computes the deep
branch on every row, beside the others. A computing row's feature is the deep branch's own
output, so interval 1 gives exactly the uncached numbers.

Blocks (what blocks_computed / blocks_skipped count): one row through one down, mid or up block.
A computing row runs all `num_blocks`; a reusing row runs `shallow_blocks` (down block 0 and the
last up block) and skips the rest.
"""

from __future__ import annotations

import torch

from pagemesh.workers.diffusion.engine.cache_policy import CacheKind, CachePolicy, RowState, decide
from pagemesh.workers.diffusion.engine.feature_cache import CachePart
from pagemesh.workers.diffusion.pipelines.base import DeepCacheForward

# The policies a U-Net's DeepCache serves: the signals of fbcache (block 0's residual) and
# teacache (block 0's modulated input) are a transformer's.
DEEP_CACHE_KINDS = (CacheKind.NONE, CacheKind.INTERVAL)
DEEP_CACHE_POLICIES = "'none' and 'interval:N' (DeepCache)"


class DeepRequestCache:
    """One request's DeepCache, a row per cond/uncond row of its images:

    feature [rows, C, h, w]  the deep branch's output at the row's last computed step
    states  RowState per row (the policy's bookkeeping)

    It stands where a RequestCache (feature_cache.py) does in a RunningJob and a CachePart."""

    def __init__(self, policy: CachePolicy, rows: int, feature_shape: tuple[int, ...], dtype, device):
        self.policy = policy
        self.feature = torch.zeros((rows, *feature_shape), dtype=dtype, device=device)
        self.states = [RowState() for _ in range(rows)]

    @staticmethod
    def bytes_needed(rows: int, feature_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        numel = 1
        for side in feature_shape:
            numel *= side
        return rows * numel * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.feature.numel() * self.feature.element_size()


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _decide_rows(part: CachePart) -> list[bool]:
    """Each row's decision (True: compute); a part without a cache computes every row."""
    cache = part.cache
    if cache is None:
        return [True] * part.rows
    return [decide(cache.policy, state, part.step, part.steps) for state in cache.states]


def deep_cached_forward(dc: DeepCacheForward, latents, timesteps, cond, parts: list[CachePart]) -> tuple:
    """The model output for every row, and the blocks each part computed (summed over its rows).
    Updates each part's cache (a DeepRequestCache) and row states."""
    shallow = dc.shallow_down(latents, timesteps, cond)
    computes = [_decide_rows(part) for part in parts]
    run = [part.offset + j for part, runs in zip(parts, computes) for j, c in enumerate(runs) if c]
    if len(run) == latents.shape[0]:
        feature = dc.deep(shallow)  # every row computes: no gather, the whole forward's numbers
    else:
        feature = None
        if run:
            index = _index(run, latents.device)
            computed = dc.deep(shallow, index)
            feature = computed.new_empty((latents.shape[0], *computed.shape[1:]))
            feature.index_copy_(0, index, computed)
        feature = _reuse_features(parts, computes, feature)
    _store_features(parts, computes, feature)
    computed = [
        sum(runs) * dc.num_blocks + (part.rows - sum(runs)) * dc.shallow_blocks for part, runs in zip(parts, computes)
    ]
    return dc.shallow_up(shallow, feature), computed


def _reuse_features(parts: list[CachePart], computes: list[list[bool]], feature) -> torch.Tensor:
    """`feature` with each reusing row's cached one in its place, in one scatter for the batch
    (`feature` None: no row computed; the batch is all cached features)."""
    reusing, cached = [], []
    for part, runs in zip(parts, computes):
        local = [j for j, c in enumerate(runs) if not c]
        if not local:
            continue
        reusing += [part.offset + j for j in local]
        whole = len(local) == part.rows
        stored = part.cache.feature
        cached.append(stored if whole else stored.index_select(0, _index(local, stored.device)))
    if feature is None:  # every row reuses, in batch order
        return torch.cat(cached)
    feature.index_copy_(0, _index(reusing, feature.device), torch.cat(cached))
    return feature


def _store_features(parts: list[CachePart], computes: list[list[bool]], feature) -> None:
    """Computing rows with a cache keep their deep feature of this step."""
    for part, runs in zip(parts, computes):
        cache = part.cache
        if cache is None or not any(runs):
            continue
        if all(runs):
            cache.feature.copy_(feature[part.offset : part.offset + part.rows])
        else:
            local = _index([j for j, c in enumerate(runs) if c], feature.device)
            cache.feature.index_copy_(0, local, feature.index_select(0, local + part.offset))
