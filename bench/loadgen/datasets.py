"""Benchmark workloads, made of real tokens of the model's tokenizer.

Every dataset yields `Conversation`s: `random` and `shared-prefix` ones have one turn,
`multi-turn` ones several, whose later prompts hold the earlier replies (known only at run time,
so the prompt of a turn is built by `build_prompt` from the replies received so far).

Random text is made from random token ids that are decoded and re-encoded until the pair is a
fixed point: `encode(decode(ids)) == ids`, so a server that tokenizes the text sees exactly the
intended number of tokens, and `--prompt-as-token-ids` sends those same ids.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pagemesh.common.tokenizer import Tokenizer

DATASETS = ("random", "shared-prefix", "multi-turn")
_MAX_TRIES = 50


@dataclass(frozen=True)
class Segment:
    """A piece of text and its token ids; `encode(text) == ids` (without BOS)."""

    text: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Turn:
    user: Segment
    output_len: int


@dataclass(frozen=True)
class Conversation:
    """`system` is the shared prefix (shared-prefix) or None; `chat` renders even a
    /v1/completions prompt through the chat template (multi-turn)."""

    turns: tuple[Turn, ...]
    system: Segment | None = None
    chat: bool = False


@dataclass(frozen=True)
class Prompt:
    """What one request sends: `messages` for /v1/chat/completions, else `text` or `ids`."""

    text: str | None
    ids: list[int] | None
    messages: list[dict] | None
    prompt_len: int


@dataclass(frozen=True)
class DatasetSpec:
    name: str = "random"
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 256
    turns: int = 3
    seed: int = 0

    def __post_init__(self):
        if self.name not in DATASETS:
            raise ValueError(f"dataset: one of {', '.join(DATASETS)}, got {self.name!r}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("random-range-ratio: must be in [0, 1)")
        if self.input_len < 1 or self.output_len < 1 or self.turns < 1 or self.prefix_len < 0:
            raise ValueError("input/output lengths and turns must be >= 1 (prefix length >= 0)")


def length_bounds(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths drawn around `mean`; never below 1."""
    return max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))


def random_segment(tokenizer: Tokenizer, length: int, rng: random.Random) -> Segment:
    """`length` real tokens whose text re-encodes to the same ids (specials never appear:
    decoding skips them, so the fixed point cannot hold one)."""
    for _ in range(_MAX_TRIES):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(length)]
        for _ in range(_MAX_TRIES):
            text = tokenizer.decode(ids)
            again = tokenizer.encode(text, add_special_tokens=False)
            if again == ids:
                return Segment(text, tuple(ids))
            # Keep what re-encoding made (a stable spelling), cut or refilled to the length.
            ids = again[:length] + [rng.randrange(tokenizer.vocab_size) for _ in range(length - len(again))]
    raise RuntimeError(f"could not make a stable random prompt of {length} tokens")


def conversations(spec: DatasetSpec, tokenizer: Tokenizer) -> Iterator[Conversation]:
    """An endless, seeded stream of conversations for `spec`."""
    rng = random.Random(spec.seed)
    in_low, in_high = length_bounds(spec.input_len, spec.range_ratio)
    out_low, out_high = length_bounds(spec.output_len, spec.range_ratio)

    def turn() -> Turn:
        return Turn(random_segment(tokenizer, rng.randint(in_low, in_high), rng), rng.randint(out_low, out_high))

    system = None
    if spec.name == "shared-prefix" and spec.prefix_len > 0:
        system = random_segment(tokenizer, spec.prefix_len, rng)
    while True:
        if spec.name == "multi-turn":
            yield Conversation(tuple(turn() for _ in range(spec.turns)), chat=True)
        else:
            yield Conversation((turn(),), system=system)


def chat_messages(conversation: Conversation, turn: int, replies: Sequence[str]) -> list[dict]:
    """The messages of request `turn`: the system prefix, earlier turns with their replies, this turn."""
    if len(replies) < turn:
        raise ValueError(f"turn {turn} needs the {turn} earlier replies, got {len(replies)}")
    messages = [{"role": "system", "content": conversation.system.text}] if conversation.system else []
    for earlier, reply in zip(conversation.turns[:turn], replies):
        messages += [{"role": "user", "content": earlier.user.text}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": conversation.turns[turn].user.text})
    return messages


def build_prompt(
    conversation: Conversation,
    turn: int,
    replies: Sequence[str],
    tokenizer: Tokenizer,
    *,
    chat_endpoint: bool,
    as_token_ids: bool,
) -> Prompt:
    """The prompt of request `turn` for the endpoint kind, with its length in tokens."""
    if chat_endpoint:
        if as_token_ids:
            raise ValueError("prompt-as-token-ids: only for /v1/completions")
        messages = chat_messages(conversation, turn, replies)
        return Prompt(None, None, messages, len(tokenizer.encode_chat(messages)))
    if conversation.chat:
        ids = tokenizer.encode_chat(chat_messages(conversation, turn, replies))
        text = tokenizer.apply_chat_template(chat_messages(conversation, turn, replies))
        return Prompt(None, ids, None, len(ids)) if as_token_ids else Prompt(text, None, None, len(ids))
    user = conversation.turns[turn].user
    if as_token_ids:
        ids = list(conversation.system.ids if conversation.system else ()) + list(user.ids)
        return Prompt(None, ids, None, len(ids))
    text = (conversation.system.text + "\n\n" if conversation.system else "") + user.text
    return Prompt(text, None, None, len(tokenizer.encode(text)))
