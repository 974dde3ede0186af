"""Where a request runs: a prefill and a decode worker (disaggregated) or one mixed worker.
Pure Python: the policy sees worker loads and cached prefixes, not sockets.

Among the workers of a pool that can take the request (below their concurrency cap, room for
its pages), `--placement` picks:
  prefix       the highest  prefix_weight * cached_fraction - load_weight * load / max_running
               (cached_fraction: share of the prompt's reusable pages the worker holds), ties
               to the least loaded; the default
  load         the least loaded (fewest requests, then most free pages)
  round-robin  the next worker by id after the one picked last
Whatever the policy, pages the chosen decode worker holds are not transferred (`skip_pages`).

An embedding request (`ScheduleRequest.pooling`) runs its prompt only: it goes to one worker that
prefills (a prefill or a mixed worker, `embedding_workers`), picked by the same policy, and needs
no decode worker.

A prefill and a decode worker pair only when they have the same parallel shape (tensor-parallel
size, pipeline stages: `WorkerInfo.parallel_shape`): KV pages go rank i -> rank i, each rank
holding its share of the KV heads of its stage's layers, and are not resharded (resharding would
split or merge every page's heads, or regroup the layers, on the way, for a pairing `pagemesh up`
never makes; compose users scale pools of one shape). `pairing_problem` says why no pair exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagemesh.services.scheduler.prefix_index import PromptPages
from pagemesh.services.scheduler.registry import WorkerInfo

PLACEMENTS = ("prefix", "load", "round-robin")


@dataclass(frozen=True)
class PlacementPolicy:
    """`mode` is one of PLACEMENTS; the weights matter for `prefix` only. With the defaults a
    worker holding the whole prompt wins until it runs a quarter of its `max_running` more
    requests than one holding none."""

    mode: str = "prefix"
    prefix_weight: float = 1.0
    load_weight: float = 4.0

    def __post_init__(self) -> None:
        if self.mode not in PLACEMENTS:
            raise ValueError(f"placement: must be one of {PLACEMENTS}")
        if self.prefix_weight < 0 or self.load_weight < 0:
            raise ValueError("prefix_weight, load_weight: must be >= 0")


@dataclass(frozen=True)
class Placement:
    prefill: WorkerInfo | None  # None for a mixed placement
    worker: WorkerInfo  # the decode (or mixed) worker
    skip_pages: int = 0  # disaggregated: leading prompt pages `worker` holds, not transferred


def pages_for(prompt_len: int, max_tokens: int, page_size: int) -> int:
    return -(-(prompt_len + max_tokens) // page_size)


def too_large_for_every_pool(
    prefill: list[WorkerInfo],
    decode: list[WorkerInfo],
    mixed: list[WorkerInfo],
    prompt_len: int,
    decode_alone: bool = False,
) -> str | None:
    """Why a prompt of `prompt_len` tokens could never be placed: no mixed worker's whole KV pool
    holds its pages and one more token's, nor a decode worker's with a prefill worker's holding the
    prompt (`decode_alone`, a migrated request, or no live prefill worker: a decode worker's pool
    is enough). None if some placement could take it once free, or no worker is known yet, or none
    that decodes (a lone decode worker lost and coming back: no pool to judge by; the queue's own
    rules refuse or hold it). Such a request would otherwise wait at the head of the queue for ever."""

    def fits(workers: list[WorkerInfo], extra: int) -> bool:
        return any(pages_for(prompt_len, extra, w.page_size) <= w.total_pages for w in workers)

    everyone = prefill + decode + mixed
    if (
        not (decode or mixed)
        or fits(mixed, 1)
        or (fits(decode, 1) and (decode_alone or not prefill or fits(prefill, 0)))
    ):
        return None
    largest = max(everyone, key=lambda w: w.total_pages * w.page_size)
    return (
        f"prompt: {prompt_len} tokens and one more do not fit any worker's KV pool (the largest holds "
        f"{largest.total_pages} pages of {largest.page_size} tokens)"
    )


def embedding_workers(prefill: list[WorkerInfo], mixed: list[WorkerInfo]) -> list[WorkerInfo]:
    """The workers an embedding request can run on: those that prefill, of one pipeline stage
    (with several, the pooled hidden state is on the last stage, and only logits travel back)."""
    return [w for w in prefill + mixed if w.pipeline_stages == 1]


def can_take(worker: WorkerInfo, pages_needed: int) -> bool:
    """Room for one more request: below its concurrency cap, and the prompt's pages fit."""
    return worker.load < worker.max_running and pages_needed <= worker.free_pages


def least_loaded_with_room(workers: list[WorkerInfo]) -> WorkerInfo | None:
    """For a kind whose worker runs the whole request (an image, a transcription): the worker
    with the lowest load / max_running below its cap, ties to the lower id; None if all are full."""
    candidates = [w for w in workers if w.load < w.max_running]
    return min(candidates, key=lambda w: (w.load / w.max_running, w.worker_id), default=None)


def load_key(worker: WorkerInfo) -> tuple:
    """Fewest requests, then most free pages, then id (deterministic)."""
    return (worker.load, -worker.free_pages, worker.worker_id)


def shapes_in_both(prefill: list[WorkerInfo], decode: list[WorkerInfo]) -> set[tuple[int, int]]:
    """The parallel shapes (tp, pp) that some prefill and some decode worker share."""
    return {w.parallel_shape for w in prefill} & {w.parallel_shape for w in decode}


def pairing_problem(prefill: list[WorkerInfo], decode: list[WorkerInfo]) -> str | None:
    """Why no prefill worker can hand its pages to a decode worker: both pools have workers but
    no two of one parallel shape. None when a pair exists or a pool is empty."""
    if not prefill or not decode or shapes_in_both(prefill, decode):
        return None

    def shapes(pool: list[WorkerInfo]) -> str:
        return ", ".join(f"tp {tp} x pp {pp}" for tp, pp in sorted({w.parallel_shape for w in pool}))

    return (
        f"no prefill and decode worker of one parallel shape (prefill: {shapes(prefill)}; "
        f"decode: {shapes(decode)}): KV pages go rank i to rank i and stage j to stage j, not resharded"
    )


def score(worker: WorkerInfo, prompt: PromptPages, policy: PlacementPolicy) -> float:
    """A worker that holds the prompt's LoRA adapter in a slot counts as if it held the whole
    prompt (LoRA affinity: a request there loads nothing and shares its step with its adapter's)."""
    cached = 1.0 if worker.holds_lora(prompt.lora) else prompt.cached_fraction(worker)
    return policy.prefix_weight * cached - policy.load_weight * worker.load / worker.max_running


class Placer:
    """Applies a PlacementPolicy; remembers the last pick per pool for round-robin."""

    def __init__(self, policy: PlacementPolicy = PlacementPolicy()):
        self.policy = policy
        self.last: dict[str, str] = {}  # pool -> worker id picked last

    def place(
        self, prefill: list[WorkerInfo], decode: list[WorkerInfo], mixed: list[WorkerInfo], prompt: PromptPages
    ) -> Placement | None:
        """Disaggregated when both pools have a worker with room, of one parallel shape, else
        mixed; None = none can take it now (the caller queues or rejects). The decode worker is
        picked first (its prefix cache decides what travels), then a prefill worker of its
        shape."""
        n = len(prompt.token_ids)
        if prefill and decode:
            ps = [w for w in prefill if can_take(w, pages_for(n, 0, w.page_size))]
            ds = [w for w in decode if can_take(w, pages_for(n, 1, w.page_size))]
            shapes = shapes_in_both(ps, ds)
            d = self._pick("decode", [w for w in ds if w.parallel_shape in shapes], prompt)
            p = self._pick("prefill", [w for w in ps if d is not None and w.parallel_shape == d.parallel_shape], prompt)
            if p is not None and d is not None:
                self.last["prefill"], self.last["decode"] = p.worker_id, d.worker_id
                return Placement(p, d, prompt.cached_pages(d))
        m = self._pick("mixed", [w for w in mixed if can_take(w, pages_for(n, 1, w.page_size))], prompt)
        if m is None:
            return None
        self.last["mixed"] = m.worker_id
        return Placement(None, m)

    def place_prefill_only(self, workers: list[WorkerInfo], prompt: PromptPages) -> Placement | None:
        """One worker of `workers` with room for the prompt's pages (an embedding request: no
        decode follows), by the policy; None = none can take it now."""
        n = len(prompt.token_ids)
        picked = self._pick("prefill_only", [w for w in workers if can_take(w, pages_for(n, 0, w.page_size))], prompt)
        if picked is None:
            return None
        self.last["prefill_only"] = picked.worker_id
        return Placement(None, picked)

    def _pick(self, pool: str, candidates: list[WorkerInfo], prompt: PromptPages) -> WorkerInfo | None:
        candidates = [w for w in candidates if w.serves_lora(prompt.lora)]
        if not candidates:
            return None
        if self.policy.mode == "load":
            return min(candidates, key=load_key)
        if self.policy.mode == "round-robin":
            ordered = sorted(candidates, key=lambda w: w.worker_id)
            last = self.last.get(pool, "")
            return next((w for w in ordered if w.worker_id > last), ordered[0])
        return min(candidates, key=lambda w: (-score(w, prompt, self.policy), *load_key(w)))
