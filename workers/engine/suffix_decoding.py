"""SuffixDecoding (Oliaro et al., arXiv:2411.04975; vLLM's `method: "suffix"`): model-free drafts from
the longest suffix of the sequence found in (a) the sequence itself, prompt and output so far, and
(b) a global cache of this server's recent outputs. Our own small version of the idea:

    global cache   a trie of every substring (up to `max_depth` tokens) of the last
                   `max_cached_requests` finished outputs, each node counting its occurrences;
                   the oldest output is removed (its counts taken back) when the cache is full
    per request    the sequence's own earlier occurrences of its suffix, found by `bytes.rfind`
                   (as the n-gram method does) instead of a per-request trie: up to `MAX_VOTES`
                   of the most recent occurrences vote on the continuation
    a draft        from the longest matched suffix, follow the most frequent continuation (ties:
                   the most recent), its probability count(child) / count(parent) multiplied
                   along the way; stop below `min_token_prob`, at `max_spec_factor` x the match
                   length, or at the number asked for. Of the two sources the draft with the
                   larger score (the sum of its tokens' probabilities) wins, as in ArcticInference;
                   at equal scores, the longer match (one occurrence gives probability 1 whatever
                   its length: a 2-token echo in the sequence must not beat a 20-token match of
                   an earlier output).

Pure Python (no torch, no zmq).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

MAX_VOTES = 8  # occurrences of the suffix in the sequence itself that vote on its continuation
MAX_NODES = 1 << 19  # the global trie's size bound besides the request count (~100 bytes a node)
Draft = tuple[list[int], float, int]  # (tokens, score, length of the suffix matched)


class _Node:
    __slots__ = ("children", "count", "last")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.last = 0  # the insertion serial of its latest occurrence (recency breaks ties)


class SuffixCache:
    """The global cache of recent outputs."""

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 10000, max_nodes: int = MAX_NODES) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_nodes = max_nodes
        self.root = _Node()
        self.outputs: deque[tuple[int, ...]] = deque()
        self.num_nodes = 0
        self.serial = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Cache one finished output, evicting the oldest ones past either bound."""
        if self.max_cached_requests <= 0 or not tokens:
            return
        tokens = tuple(tokens)
        self.serial += 1
        self._update(tokens, +1)
        self.outputs.append(tokens)
        while len(self.outputs) > self.max_cached_requests or (self.num_nodes > self.max_nodes and self.outputs):
            self._update(self.outputs.popleft(), -1)

    def _update(self, tokens: tuple[int, ...], delta: int) -> None:
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start : start + self.max_depth]:
                child = node.children.get(t)
                if child is None:
                    if delta < 0:
                        break
                    child = node.children[t] = _Node()
                    self.num_nodes += 1
                child.count += delta
                if delta > 0:
                    child.last = self.serial
                elif child.count <= 0:
                    del node.children[t]
                    self.num_nodes -= _size(child)
                    break
                node = child

    def match(self, context: Sequence[int], room: int = 1) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` that occurs in the cache followed by
        something, and its length; (None, 0) if none does. At most max_depth - `room` long, so
        that `room` tokens can follow it in a trie cut at max_depth."""
        lo, hi = 0, min(len(context), max(1, self.max_depth - room))
        while lo < hi:  # the longest suffix present: if m tokens are, m - 1 are (binary search)
            mid = (lo + hi + 1) // 2
            if self._walk(context[len(context) - mid :]) is None:
                hi = mid - 1
            else:
                lo = mid
        for m in range(lo, 0, -1):
            node = self._walk(context[len(context) - m :])
            if node.children:
                return node, m
        return None, 0

    def _walk(self, tokens: Sequence[int]) -> _Node | None:
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def draft(self, context: Sequence[int], k: int, max_spec_factor: float, min_prob: float) -> Draft:
        """(tokens, score, match length) following the most frequent continuation of the matched suffix."""
        node, m = self.match(context, room=k)
        if node is None:
            return [], 0.0, 0
        limit = min(k, int(max_spec_factor * m + 1e-6))
        out, score, prob = [], 0.0, 1.0
        while len(out) < limit and node.children:
            token, child = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].last))
            prob *= child.count / sum(c.count for c in node.children.values())
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node = child
        return out, score, m


def _size(node: _Node) -> int:
    return 1 + sum(_size(c) for c in node.children.values())


def draft_from_sequence(
    tokens: Sequence[int], k: int, max_depth: int, max_spec_factor: float, min_prob: float
) -> Draft:
    """(tokens, score, match length) from the sequence's own earlier occurrences of its longest repeated suffix
    (at most `max_depth` - 1 tokens long): the `MAX_VOTES` most recent occurrences vote position by
    position; the winners' share is the token's probability (ties: the most recent)."""
    length = len(tokens)
    if k < 1 or length < 2:
        return [], 0.0, 0
    data = array("i", tokens).tobytes()
    lo, hi = 0, min(max_depth - 1, length - 1)
    while lo < hi:  # the longest suffix that occurred before: if m tokens did, m - 1 did (binary search)
        mid = (lo + hi + 1) // 2
        if earlier_occurrences(data, length, mid, 1):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return [], 0.0, 0
    starts = earlier_occurrences(data, length, lo, MAX_VOTES)
    return *_vote(tokens, starts, min(k, int(max_spec_factor * lo + 1e-6)), min_prob), lo


def earlier_occurrences(data: bytes, length: int, m: int, most: int) -> list[int]:
    """Token index after each of the `most` latest earlier occurrences of the last `m` of the
    `length` tokens packed 4 bytes each in `data` (`array("i", tokens).tobytes()`: `bytes.rfind`
    searches at C speed on long contexts; a byte match straddling two ids is skipped), latest
    first. An occurrence ends before the last token, so at least one token follows it."""
    pattern = data[(length - m) * 4 :]
    starts: list[int] = []
    end = (length - 1) * 4  # the occurrence ends before the last token
    while len(starts) < most:
        pos = data.rfind(pattern, 0, end)
        if pos < 0:
            break
        if pos % 4 == 0:
            starts.append(pos // 4 + m)
        end = pos + len(pattern) - 1
    return starts


def _vote(tokens: Sequence[int], starts: list[int], limit: int, min_prob: float) -> tuple[list[int], float]:
    out, score, prob = [], 0.0, 1.0
    alive = starts
    for j in range(limit):
        counts: dict[int, int] = {}
        for s in alive:
            if s + j < len(tokens):
                counts[tokens[s + j]] = counts.get(tokens[s + j], 0) + 1
        if not counts:
            break
        best = max(counts.values())
        token = next(tokens[s + j] for s in alive if s + j < len(tokens) and counts[tokens[s + j]] == best)
        prob *= best / sum(counts.values())
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        alive = [s for s in alive if s + j < len(tokens) and tokens[s + j] == token]
    return out, score
