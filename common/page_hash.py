"""The key of a prefix-cache page: part of the wire contract between workers and the scheduler.

    prompt ids ─▶ [page 0][page 1][page 2] ...
    key(page i) = blake2b(key(page i-1) ‖ token ids of page i), cut to HASH_BITS bits

Equal keys mean equal whole prefixes. The key is stable across processes and machines
(blake2b, not Python's `hash`): a worker's block manager publishes the keys of the pages it
caches, and the scheduler computes the same keys from a prompt to know who holds its prefix.
Standard library only.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

HASH_BITS = 62  # page keys are in [0, 2**62): non-negative, and they fit msgpack and the codec
_HASH_MASK = (1 << HASH_BITS) - 1
_NO_PARENT = (1 << HASH_BITS).to_bytes(8, "little")  # outside the key range: the first page


def chain_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Key of a full page: blake2b over the parent page's key and this page's token ids, cut to
    62 bits. The same in every process and on every machine."""
    tokens = array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    parent = _NO_PARENT if parent_hash is None else parent_hash.to_bytes(8, "little")
    digest = hashlib.blake2b(parent + tokens.tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _HASH_MASK


def root_hash(label: str) -> int:
    """The parent key of the first page of a sequence computed under something besides its
    tokens (a LoRA adapter, by its content digest): its pages never share keys with the base
    model's or another adapter's, so the prefix cache never serves one the other's KV."""
    digest = hashlib.blake2b(b"root:" + label.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _HASH_MASK


def prefix_page_hashes(token_ids: Sequence[int], page_size: int, root: int | None = None) -> list[int]:
    """Keys of the pages `match_prefix` could hit for this prompt, in order: every full page
    except one that would leave no token to compute (`root`: see root_hash)."""
    keys: list[int] = []
    parent: int | None = root
    for i in range((len(token_ids) - 1) // page_size):
        parent = chain_hash(parent, token_ids[i * page_size : (i + 1) * page_size])
        keys.append(parent)
    return keys
