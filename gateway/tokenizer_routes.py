"""Which tokenizer replica each request goes through, and what its client has had: so a stream
whose tokenizer is lost goes on through another one (gateway/mesh.py does the sending).

    submit ──pick()──▶ the live replica with the fewest requests ──Route(request, link)
    TextDelta ──Route.record──▶ per choice: the token ids, the characters of text, finished
    replica lost ──Route.moved()──▶ the request again under a new id, with `resume` (one
                                    ResumedText per choice), for another replica

A moved request goes by a new id (`<id>~<n>`), so nothing still on its way under the old one (the
lost replica's last text, its worker's tokens) can be taken for the new stream's; the gateway
aborts the old id at the scheduler and maps replies under the new id back to the request's own.

A replica is lost when its instance changes (it was restarted: it forgot its requests) or when it
has not answered pings for TOKENIZER_SILENT_S while another replica answers (a replica that is
only slow, with no other to go to, keeps its requests). Pure logic: no sockets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagemesh.common.liveness import PeerInstance
from pagemesh.common.messages import (
    DetokenizeRequest,
    EmbedRequest,
    GenerateRequest,
    ResumedText,
    TextDelta,
    TokenizeRequest,
)

TOKENIZER_SILENT_S = 5.0  # a replica that answered no ping for this long is lost, if another answers
MAX_TOKENIZER_MOVES = 3  # a request moved this often (its replicas keep dying) fails instead

TokenizerRequest = GenerateRequest | EmbedRequest | TokenizeRequest | DetokenizeRequest


@dataclass(eq=False)
class TokenizerLink:
    """One tokenizer replica as this gateway sees it. `socket`: its Dealer (anything with an
    async `send`)."""

    address: str
    socket: object
    peer: PeerInstance = field(default_factory=PeerInstance)
    last_pong: float | None = None  # monotonic time of its last answer; None: it never answered
    live: bool = False  # it answered, and not too long ago
    requests: set[str] = field(default_factory=set)  # own ids of the requests that go through it

    def answered(self, instance: str, now: float) -> bool:
        """Record a Pong; True when it comes from a new process (the old one forgot its requests)."""
        self.last_pong, self.live = now, True
        return self.peer.restarted(instance)

    def silent(self, now: float) -> bool:
        """Live until now, but no answer for TOKENIZER_SILENT_S."""
        return self.live and self.last_pong is not None and now - self.last_pong > TOKENIZER_SILENT_S


def pick(links: list[TokenizerLink], avoid: TokenizerLink | None = None) -> TokenizerLink | None:
    """The live replica with the fewest requests, other than `avoid` if another is live; None if
    none is live."""
    live = [link for link in links if link.live]
    others = [link for link in live if link is not avoid]
    candidates = others or live
    return min(candidates, key=lambda link: len(link.requests)) if candidates else None


@dataclass
class _ChoiceHad:
    ids: list[int] = field(default_factory=list)
    chars: int = 0
    finished: bool = False


class Route:
    """One request's way through the tokenizers: where it goes now, under which id, and what its
    client has had of each choice."""

    def __init__(self, request: TokenizerRequest, link: TokenizerLink | None):
        self.request = request
        self.link = link
        self.current_id = request.request_id
        self.moves = 0
        self._choices: dict[int, _ChoiceHad] = {}

    @property
    def own_id(self) -> str:
        return self.request.request_id

    def record(self, deltas: list[TextDelta]) -> None:
        """Text that reaches the request's queue (its client's): counted per choice."""
        for delta in deltas:
            had = self._choices.setdefault(delta.index, _ChoiceHad())
            had.ids += delta.token_ids
            had.chars += len(delta.text)
            had.finished = had.finished or delta.finish_reason is not None

    def moved(self) -> TokenizerRequest:
        """The request for another replica: a new id, and what each choice's client has had."""
        self.moves += 1
        self.current_id = f"{self.own_id}~{self.moves}"
        if not isinstance(self.request, GenerateRequest):  # nothing streams: it simply starts again
            return dataclasses.replace(self.request, request_id=self.current_id)
        resume = [
            ResumedText(index=i, output_token_ids=list(had.ids), text_chars=had.chars, finished=had.finished)
            for i, had in sorted(self._choices.items())
        ]
        return dataclasses.replace(self.request, request_id=self.current_id, resume=resume)
