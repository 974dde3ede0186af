"""The scheduler's waiting rooms: per kind of worker, the requests admitted and waiting for one
(oldest first), and when a request no live worker can serve may wait rather than be refused.

    admitted ──▶ Queued ──▶ its kind's queue (an OrderedDict by request id) ──placed──▶ gone
    a lost worker's image or transcription ──put_first──▶ back at the head (it is the oldest)

Pure logic: no sockets, no clock.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

from pagemesh.common.messages import ImageRequest, ScheduleRequest, TranscriptionRequest, WorkerKind
from pagemesh.services.scheduler.prefix_index import PromptPages


@dataclass
class Queued:
    """A request admitted and waiting for a worker of its kind."""

    origin: bytes  # the identity of the peer that sent it (a tokenizer; the gateway for images and audio)
    request: ScheduleRequest | ImageRequest | TranscriptionRequest
    prompt: PromptPages | None  # LLM requests: the prompt's pages, for prefix-aware placement
    kind: WorkerKind
    enqueued_at: float
    model: str | None = None  # image and audio requests: the model asked for (None: the kind's default)
    restarts: int = 0  # image and audio requests: times placed again after their worker was lost


def put_first(queue: OrderedDict[str, Queued], entry: Queued) -> Queued:
    """Queue a lost worker's image or transcription again at the head, counting the restart."""
    entry = dataclasses.replace(entry, restarts=entry.restarts + 1)
    queue[entry.request.request_id] = entry
    queue.move_to_end(entry.request.request_id, last=False)
    return entry


def may_wait(now: float, started_at: float, startup_s: float, last_loss: float | None, return_wait_s: float) -> bool:
    """Requests no live worker can serve wait in the queue rather than being refused: within
    `startup_s` of the scheduler's start (workers may not have registered yet: a restarted
    scheduler), and within `return_wait_s` (--worker-return-wait) of a worker's loss (a supervisor
    or compose restarts it: the request waits for it, not a 503)."""
    if now - started_at <= startup_s:
        return True
    return return_wait_s > 0 and last_loss is not None and now - last_loss <= return_wait_s
