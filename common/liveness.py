"""Telling a restarted peer from the same one.

A gateway pings its tokenizer, and a tokenizer its scheduler, every PING_INTERVAL_S. Each process
answers with a `Pong` carrying an instance id drawn when it started. When the id changes, the peer
was restarted and has forgotten every request the old process held: the requester ends those
itself instead of waiting for replies that will never come.
"""

from __future__ import annotations

import asyncio
import uuid

from pagemesh.common.messages import Ping

PING_INTERVAL_S = 1.0


def new_instance() -> str:
    """A process's instance id: random per start."""
    return uuid.uuid4().hex


class PeerInstance:
    """The instance ids one peer answers with."""

    def __init__(self) -> None:
        self.instance: str | None = None

    def restarted(self, instance: str) -> bool:
        """Record an answer; True when it comes from another process than the previous answer."""
        previous, self.instance = self.instance, instance
        return previous is not None and previous != instance


async def ping_forever(socket, sender: str, address: str | None = None, interval: float = PING_INTERVAL_S) -> None:
    """Send Ping(sender, address) on `socket` (anything with an async `send`) every `interval` seconds."""
    while True:
        await socket.send(Ping(sender=sender, address=address))
        await asyncio.sleep(interval)
