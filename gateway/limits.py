"""Per-key admission limits: requests in flight, and tokens per minute. Pure logic, with the clock
injected (tests drive it by hand).

Tokens per minute are a token bucket per key that may go into debt:

    capacity = L tokens, refilled at L/60 tokens a second
    admit:   refused while the bucket is empty or in debt (level <= 0); else the request's
             estimate (what is known before the mesh runs it: its prompt) is taken at once
    finish:  the estimate is replaced by what the request really used (prompt + completion
             tokens); a request that produced nothing gives its estimate back

What a request will generate is not known at admission (chat's default max_tokens is the rest of
the context), so it is charged when known, and the debt it leaves holds the key's next requests
back until the bucket refills: over a minute the key gets L tokens, give or take one request's
worth. The concurrency limit bounds how much can be in flight unreconciled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagemesh.gateway.errors import ApiError

WINDOW_S = 60.0
CONCURRENCY_RETRY_AFTER_S = 1  # a slot frees when some request ends: no better guess


class RateLimited(ApiError):
    """429 rate_limit_error with Retry-After (whole seconds, at least 1)."""

    def __init__(self, message: str, retry_after_s: float):
        seconds = max(1, math.ceil(retry_after_s))
        super().__init__(429, message, "rate_limit_error", None, "rate_limit_exceeded", {"Retry-After": str(seconds)})
        self.retry_after_s = seconds


@dataclass
class _Bucket:
    level: float
    stamp: float
    in_flight: int = 0


@dataclass
class Admission:
    """A request let in under `key`; `finish(used_tokens)` exactly once when it ends."""

    limits: KeyLimits
    key: str
    estimate: int
    done: bool = field(default=False, repr=False)

    def finish(self, used_tokens: int) -> None:
        if not self.done:
            self.done = True
            self.limits._finish(self, used_tokens)


class KeyLimits:
    """`max_concurrent` requests in flight and `tokens_per_minute` per key (None = no limit)."""

    def __init__(
        self,
        max_concurrent: int | None = None,
        tokens_per_minute: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        if tokens_per_minute is not None and tokens_per_minute < 1:
            raise ValueError("tokens_per_minute must be at least 1")
        self.max_concurrent, self.tokens_per_minute, self.clock = max_concurrent, tokens_per_minute, clock
        self._buckets: dict[str, _Bucket] = {}  # one per configured key (or the anonymous one): bounded

    def admit(self, key: str, estimate: int | None) -> Admission:
        """Let a request in (taking its estimated tokens) or raise RateLimited. `estimate` None:
        the request uses no tokens (images), only the concurrency limit applies."""
        bucket = self._bucket(key)
        if self.max_concurrent is not None and bucket.in_flight >= self.max_concurrent:
            raise RateLimited(
                f"Rate limit reached: at most {self.max_concurrent} requests in flight per API key.",
                CONCURRENCY_RETRY_AFTER_S,
            )
        if self.tokens_per_minute is not None and estimate is not None:
            if bucket.level <= 0:
                wait = (1 - bucket.level) / self._rate
                raise RateLimited(
                    f"Rate limit reached: at most {self.tokens_per_minute} tokens per minute per API key "
                    f"(prompt and completion); this key is over it, try again in {math.ceil(wait)} s.",
                    wait,
                )
            bucket.level -= estimate
        bucket.in_flight += 1
        return Admission(self, key, estimate or 0)

    def level(self, key: str) -> float:
        """Tokens the key may still start with now (negative: its debt)."""
        return self._bucket(key).level

    def in_flight(self, key: str) -> int:
        return self._bucket(key).in_flight

    @property
    def _rate(self) -> float:
        return self.tokens_per_minute / WINDOW_S

    def _bucket(self, key: str) -> _Bucket:
        now = self.clock()
        capacity = float(self.tokens_per_minute or 0)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(capacity, now)
        elif self.tokens_per_minute is not None:
            bucket.level = min(capacity, bucket.level + (now - bucket.stamp) * self._rate)
        bucket.stamp = now
        return bucket

    def _finish(self, admission: Admission, used_tokens: int) -> None:
        bucket = self._bucket(admission.key)
        bucket.in_flight -= 1
        if self.tokens_per_minute is not None:
            bucket.level = min(float(self.tokens_per_minute), bucket.level - (used_tokens - admission.estimate))


def estimate_prompt_tokens(prompts, messages) -> int:
    """Tokens of the prompt as far as the gateway knows them without tokenizing: exact for token
    ids, about one per four characters for text (the usual English rate)."""
    chars = 0
    tokens = 0
    for text, ids in prompts:
        if ids is not None:
            tokens += len(ids)
        else:
            chars += len(text)
    for message in messages or ():
        chars += len(message.get("content", "")) + len(message.get("tool_calls", ""))
    return tokens + math.ceil(chars / 4)
