"""The LLM worker's KV cache events publisher (--kv-events-config), as vLLM's ZmqEventPublisher.

    KVEventFeed.take() once per engine step ─▶ send(payload) ─▶ PUB socket [topic, seq, payload]
    (workers/engine/kv_event_feed.py: the payload the scheduler gets too)

Each message is three frames: the topic (UTF-8), the batch's sequence number (8 bytes, big
endian, from 0), the msgpack EventBatch. With a `replay_endpoint`, a ROUTER socket answers a
REQ client that sends a start sequence number (8 bytes, big endian) with every batch still held
from that number on (the last `buffer_steps`), each as [seq, payload], then [-1 (8 bytes,
signed), b""]; a thread of its own serves it, so an idle engine answers too. The sockets are
common/transport.py's (the only module with zmq sockets).
"""

from __future__ import annotations

import threading
from collections import deque

from pagemesh.common.transport import FramePublisher, FrameReplier
from pagemesh.workers.engine.kv_events import KVEventsConfig

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_POLL_MS = 100  # how often the replay thread looks whether it should stop


class KVEventsPublisher:
    """Publishes encoded event batches; `send` from the thread that steps the engine."""

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.topic = config.topic.encode()
        self.next_seq = 0
        self.held: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)  # for replays
        self._held_lock = threading.Lock()
        try:
            self.socket = FramePublisher(config.endpoint, config.hwm)
        except OSError as e:
            raise OSError(
                f"--kv-events-config: {e} (one endpoint per worker process: `pagemesh up` gives every LLM worker "
                "the same flag; start each with `pagemesh worker` and its own port)"
            ) from e
        self.replier = self._replay_thread = None
        self._stopping = threading.Event()
        if config.replay_endpoint is not None:
            try:
                self.replier = FrameReplier(config.replay_endpoint)
            except OSError as e:
                self.socket.close()
                raise OSError(f"--kv-events-config replay_endpoint: {e}") from e
            self._replay_thread = threading.Thread(target=self._serve_replays, name="kv-events-replay", daemon=True)
            self._replay_thread.start()

    @classmethod
    def for_config(cls, config: KVEventsConfig | None) -> KVEventsPublisher | None:
        """A publisher per --kv-events-config (None: events are not published)."""
        return cls(config) if config is not None and config.publishes else None

    def send(self, payload: bytes) -> int:
        """Publish one step's EventBatch (`payload`, encoded); its sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        self.socket.send([self.topic, seq.to_bytes(8, "big"), payload])
        if self.replier is not None:
            with self._held_lock:
                self.held.append((seq, payload))
        return seq

    def close(self) -> None:
        self._stopping.set()
        if self._replay_thread is not None:
            self._replay_thread.join()
            self.replier.close()
        self.socket.close()

    def _serve_replays(self) -> None:
        while not self._stopping.is_set():
            request = self.replier.next_request(REPLAY_POLL_MS)
            if request is None:
                continue
            identity, frames = request
            if len(frames) != 1 or len(frames[0]) != 8:
                continue  # not a start sequence number: nothing to answer
            start = int.from_bytes(frames[0], "big")
            with self._held_lock:
                held = [item for item in self.held if item[0] >= start]
            for seq, payload in held:
                self.replier.reply(identity, [seq.to_bytes(8, "big"), payload])
            self.replier.reply(identity, [END_OF_REPLAY, b""])
