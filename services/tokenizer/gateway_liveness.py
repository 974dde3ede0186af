"""Which gateways still ping this tokenizer. Pure logic.

Every gateway pings its tokenizer each second with its reply address (`Ping.address`). A gateway
that stopped (killed, its host gone) leaves requests behind that no client reads any more; once
its pings have been missing for GATEWAY_TIMEOUT_S, the tokenizer drops them and asks the scheduler
to abort them, so that their workers stop generating and free their pages. A gateway restarted
at the same address pings again at once: it aborts what the old process left on its own (each
reply for a request it does not know, gateway/mesh.py)."""

from __future__ import annotations

# Ten pings missed, several times a ping's worst delay on a loaded machine: a false alarm would
# end live streams, a late one only wastes some steps.
GATEWAY_TIMEOUT_S = 15.0


class GatewayLiveness:
    def __init__(self, timeout_s: float = GATEWAY_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._last_seen: dict[str, float] = {}  # reply address -> monotonic time of its last ping

    def seen(self, address: str, now: float) -> None:
        self._last_seen[address] = now

    def gone(self, now: float) -> list[str]:
        """The addresses whose pings stopped more than the timeout ago; forgotten from here on
        (a ping brings one back)."""
        lost = [a for a, t in self._last_seen.items() if now - t > self.timeout_s]
        for address in lost:
            del self._last_seen[address]
        return lost
