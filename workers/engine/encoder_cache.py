"""The encoder step's plan: which images a step needs, which the runner must encode first, and
which it may forget. Pure Python (no torch): the runner holds the embeddings, this decides.

    step chunks ──needed──▶ images whose placeholders some chunk runs   (deduplicated by digest)
                  │
    EncoderCache ─┤ held (LRU, by digest) ──▶ nothing to do: a hit
                  └ not held ──▶ encode (one batched encoder call before the forward pass)
                    over the row budget ──▶ drop the least recently used (never one this step needs)

Every rank of a tensor-parallel worker applies the same plan (it travels in the ModelInput),
so their caches stay the same. The same image in ten requests is encoded once while it is held;
a prefix-cache hit over all of an image's placeholders needs no encoding at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagemesh.common.messages import ImageInput

DEFAULT_ENCODER_CACHE_ROWS = 16384  # embedding rows held (LLaVA-1.5: 28 images; digits-vlm: 1024)


class EncoderCache:
    """Which images' embeddings the runner holds, in least-recently-used order, within `capacity`
    rows (an image larger than that is still encoded for the step that needs it; capacity 0: no
    cache, each step encodes the images it needs). Counts what it did: `encoded` images, `hits`
    (an image needed and already held)."""

    def __init__(self, capacity: int = DEFAULT_ENCODER_CACHE_ROWS):
        self.capacity = capacity
        self._held: OrderedDict[str, int] = OrderedDict()  # digest -> rows
        self.encoded = 0
        self.hits = 0

    @property
    def rows(self) -> int:
        return sum(self._held.values())

    def __contains__(self, digest: str) -> bool:
        return digest in self._held

    def plan(self, needed: Iterable[ImageInput]) -> tuple[list[ImageInput], list[str]]:
        """(images to encode before this step, digests to forget first). Each needed image is
        held after the step; others go, oldest first, while the rows exceed the capacity."""
        if self.capacity == 0:  # no cache: rows live for their step only, a later step encodes again
            drop = list(self._held)
            self._held.clear()
            encode = list({i.digest: i for i in needed}.values())
            self._held.update((i.digest, i.length) for i in encode)
            self.encoded += len(encode)
            return encode, drop
        encode: list[ImageInput] = []
        keep: set[str] = set()
        for image in needed:
            if image.digest in keep:
                continue
            keep.add(image.digest)
            if image.digest in self._held:
                self._held.move_to_end(image.digest)
                self.hits += 1
            else:
                encode.append(image)
                self._held[image.digest] = image.length
                self.encoded += 1
        drop: list[str] = []
        total = self.rows
        for digest in list(self._held):
            if total <= self.capacity:
                break
            if digest not in keep:
                total -= self._held.pop(digest)
                drop.append(digest)
        return encode, drop

    def hold(self, digest: str, rows: int) -> list[str]:
        """Rows that came encoded (from an encoder worker) are held like encoded ones; returns
        the digests dropped to make room (never this one)."""
        self._held[digest] = rows
        self._held.move_to_end(digest)
        drop: list[str] = []
        total = self.rows
        for held in list(self._held):
            if total <= self.capacity:
                break
            if held != digest:
                total -= self._held.pop(held)
                drop.append(held)
        return drop

    def clear(self) -> list[str]:
        """Forget everything (the runner drops what it holds)."""
        dropped = list(self._held)
        self._held.clear()
        return dropped
