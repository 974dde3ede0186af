"""One streamed response, read chunk by chunk, into a `RequestResult`.

TTFT is the time of the first chunk that carries output (text, or tokens counted by the server);
each later such chunk adds the gap since the previous one to the inter-token latencies, split
evenly over the tokens it carries when their number is known (per-chunk `usage`, `token_ids`, or
logprobs entries), so a server that sends several tokens per chunk is not credited with one long
gap for many tokens. Output tokens come from the final `usage` when the server sends one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """What one request measured. Times in seconds; `output_tokens` None until known."""

    prompt_len: int = 0
    output_len: int = 0  # requested max_tokens
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at send
    ttft: float = 0.0
    latency: float = 0.0  # end-to-end
    itl: list[float] = field(default_factory=list)
    text: str = ""
    output_tokens: int | None = None
    server_prompt_tokens: int | None = None
    chunks: int = 0  # chunks that carried output


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _choice_token_count(choice: dict) -> int | None:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        for key in ("content", "tokens"):  # chat, then legacy completions
            if isinstance(logprobs.get(key), list):
                return len(logprobs[key])
    return None


class StreamAccumulator:
    """Feed each decoded `data:` payload with its arrival time; `finish` gives the result."""

    def __init__(self, result: RequestResult):
        self.result = result
        self._last_output_at: float | None = None
        self._usage_seen = False
        self._usage_tokens = 0  # completion_tokens of the latest usage seen

    def feed(self, payload: dict, now: float) -> None:
        result = self.result
        if "error" in payload and not payload.get("choices"):
            error = payload["error"]
            result.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        choices = payload.get("choices") or []
        text = "".join(_choice_text(c) for c in choices)
        counts = [_choice_token_count(c) for c in choices]
        tokens = sum(c for c in counts if c is not None) if any(c is not None for c in counts) else None
        usage = payload.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            completion = int(usage["completion_tokens"])
            # Continuous usage (on every chunk): the delta is this chunk's count. A usage seen for
            # the first time is only the total (e.g. llama-server's last chunk), never a count.
            if choices and tokens is None and self._usage_seen:
                tokens = completion - self._usage_tokens
            self._usage_seen = True
            self._usage_tokens = completion
            result.output_tokens = completion
            if usage.get("prompt_tokens") is not None:
                result.server_prompt_tokens = int(usage["prompt_tokens"])
        if not text and not tokens:
            return
        result.text += text
        result.chunks += 1
        if self._last_output_at is None:
            result.ttft = now - result.start
        else:
            count = max(1, tokens or 1)
            result.itl.extend([(now - self._last_output_at) / count] * count)
        self._last_output_at = now

    def finish(self, now: float) -> RequestResult:
        result = self.result
        result.latency = now - result.start
        if not result.error and result.chunks == 0:
            result.error = "the stream carried no output"
        result.success = not result.error
        return result
