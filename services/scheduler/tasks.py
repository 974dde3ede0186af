"""What the scheduler sends the workers it placed an LLM request on. Pure Python.

mixed worker, or a request whose choices are picked at its end (beams, best_of > n)
    ──▶ GenerateTask to the one worker (prompt and decode in one engine: no handoff)
a prefill and a decode worker
    ──▶ DecodeTask to the decode worker first (it expects the pages), then PrefillTask
        to the prefill worker, both naming the leading pages the decode worker holds
"""

from __future__ import annotations

from pagemesh.common.messages import DecodeTask, GenerateTask, PrefillTask, ScheduleRequest
from pagemesh.services.scheduler.placement import Placement


def llm_tasks(
    req: ScheduleRequest, placement: Placement, queued: float, resumed: list[int]
) -> list[tuple[str, GenerateTask | DecodeTask | PrefillTask]]:
    """(worker id, task) pairs, in send order; two of them exactly when the KV is handed off.
    `queued`: seconds it waited in the scheduler; `resumed`: the tokens a migrated request made."""
    worker, prefill = placement.worker, placement.prefill
    if prefill is None or not req.sampling.streams:
        task = GenerateTask(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            reply_to=req.reply_to,
            queued_s=queued,
            output_token_ids=resumed,
            pooling=req.pooling,
            images=req.images,
        )
        return [(worker.worker_id, task)]
    decode = DecodeTask(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=req.sampling,
        reply_to=req.reply_to,
        prefill_worker_id=prefill.worker_id,
        skip_pages=placement.skip_pages,
        images=req.images,
    )
    prefill_task = PrefillTask(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=req.sampling,
        reply_to=req.reply_to,
        decode_worker_id=worker.worker_id,
        decode_kv_endpoint=worker.kv_endpoint,
        queued_s=queued,
        skip_pages=placement.skip_pages,
        images=req.images,
    )
    return [(worker.worker_id, decode), (prefill.worker_id, prefill_task)]
