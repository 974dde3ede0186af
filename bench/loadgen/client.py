"""One streamed request to an OpenAI-compatible server (aiohttp), read as server-sent events."""

from __future__ import annotations

import json
import time

import aiohttp

from pagemesh.bench.loadgen.stream import RequestResult, StreamAccumulator


def new_session(*, fresh_connection: bool, timeout_s: float) -> aiohttp.ClientSession:
    """`fresh_connection` opens one TCP connection per request (llama-server drops reused ones)."""
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh_connection)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s), read_bufsize=1 << 20
    )


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict,
    result: RequestResult,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """POST `payload` with stream on; fills and returns `result` (errors are recorded, not raised)."""
    result.start = time.perf_counter()
    accumulator = StreamAccumulator(result)
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                result.error = f"HTTP {response.status}: {body}"
            else:
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event: lines
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    accumulator.feed(json.loads(data), time.perf_counter())
    except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return accumulator.finish(time.perf_counter())
