"""The prefill→decode handoff of KV pages: one module per side, each the one owner of its side's
page lifecycle, and each through the engine's handoff API only (workers/engine/kv_handoff.py).

    prefill side (handoff_out.HandoffOut)             decode side (handoff_in.HandoffIn)
    PrefillTask ─expect(endpoint, skip)               DecodeTask ─task(): engine.pin_prefix_pages
    prefill done ─send(): engine.export_prefilled       (the `skip_pages` leading prompt pages)
       ─pack─▶ KVPagesHeader + frames ══════════════▶ pages(): header + frames arrive
                                                        both halves here ─▶ engine.import_pages:
    ack ◀─────────────────────── KVPagesAck ◀────────── pages into new ones, start decoding
    acknowledged(): engine.release_prefilled;          (or refuse: engine.free_pages the pinned)
      done(HANDED_OFF | KV_REJECTED)
    deadline passed: release, done(KV_TIMEOUT)        deadline passed: free pinned, done(KV_TIMEOUT)

The scheduler tells both sides how many leading prompt pages the decode worker holds
(`skip_pages`): the decode side pins them when its task comes (eviction cannot take them), the
prefill side sends only the rest, and the import builds the block table from the pinned pages
plus the received ones (or refuses if they are gone). Tensor- and pipeline-parallel workers send
one `KVPagesHeader` per rank (rank r's KV heads of its stage's layers, for the decode worker's
rank r); the decode side imports once every tp rank's parts cover all the layers, and both
engines' rank 0 relays its followers' shards (workers/engine/kv_relay.py). Shapes (tp, pp) must
match: the scheduler never pairs workers of different shapes, and a mismatched transfer is
refused (KV_REJECTED), never resharded. A rank that dies mid-transfer takes its worker down
(tensor_parallel.FollowerRanks); the other side's deadline frees what it held (KV_TIMEOUT).
Every method runs in the shell's engine loop, between steps; the socket loops only post commands.
"""

from __future__ import annotations

from pagemesh.workers.llm.handoff_in import HandoffIn
from pagemesh.workers.llm.handoff_out import HandoffOut

__all__ = ["HandoffIn", "HandoffOut"]
