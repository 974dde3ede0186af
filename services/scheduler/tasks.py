"""What the scheduler sends the workers it placed an LLM request on. Pure Python.

mixed worker, or a request whose choices are picked at its end (beams, best_of > n)
    ──▶ GenerateTask to the one worker (prompt and decode in one engine: no handoff)
a prefill and a decode worker
    ──▶ DecodeTask to the decode worker first (it expects the pages), then PrefillTask
        to the prefill worker, both naming the leading pages the decode worker holds
an image prompt, with encoder workers (--encoder N) and a prompt worker that takes their rows
    ──▶ EncodeTask to the least loaded encoder worker first, naming the prompt worker's
        embeds endpoint; the prompt's task says which encoder worker sends its images' rows
"""

from __future__ import annotations

import dataclasses

from pagemesh.common.messages import DecodeTask, EncodeTask, GenerateTask, PrefillTask, ScheduleRequest
from pagemesh.services.scheduler.placement import Placement
from pagemesh.services.scheduler.registry import WorkerInfo


def llm_tasks(
    req: ScheduleRequest, placement: Placement, queued: float, resumed: list[int], kept_id: str = ""
) -> list[tuple[str, GenerateTask | DecodeTask | PrefillTask]]:
    """(worker id, task) pairs, in send order; two of them exactly when the KV is handed off.
    `queued`: seconds it waited in the scheduler; `resumed`: the tokens a migrated request made;
    `kept_id`: the id its keeper kept its pages under, where not its own (AbortRequest.moved_to)."""
    worker, prefill = placement.worker, placement.prefill
    if prefill is None or not req.sampling.streams:
        task = GenerateTask(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            reply_to=req.reply_to,
            queued_s=queued,
            output_token_ids=resumed,
            resumed_choices=req.resume.choices if req.resume is not None else [],
            pooling=req.pooling,
            images=req.images,
        )
        return [(worker.worker_id, task)]
    # an exact resume (tokens streamed before the loss) gets every kept page again (migration.py);
    # a request that moved before its first token is prefilled again as a new one
    exact = bool(resumed or (req.resume is not None and req.resume.choices))
    skip = 0 if exact else placement.skip_pages
    decode = DecodeTask(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=req.sampling,
        reply_to=req.reply_to,
        prefill_worker_id=prefill.worker_id,
        skip_pages=skip,
        images=req.images,
        output_token_ids=resumed,  # an exact resume (migration.py): decoded again as given
        resumed_choices=req.resume.choices if req.resume is not None else [],
    )
    prefill_task = PrefillTask(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=req.sampling,
        reply_to=req.reply_to,
        decode_worker_id=worker.worker_id,
        decode_kv_endpoint=worker.kv_endpoint,
        queued_s=queued,
        skip_pages=skip,
        images=req.images,
        resumed=exact,  # the kept pages sent again, no token reported
        kept_id=kept_id if exact else "",
    )
    return [(worker.worker_id, decode), (prefill.worker_id, prefill_task)]


def with_encoder(
    req: ScheduleRequest, tasks: list[tuple[str, object]], encoders: list[WorkerInfo], workers: dict[str, WorkerInfo]
) -> list[tuple[str, object]]:
    """`tasks` with an EncodeTask in front when an encoder worker can take the request's images:
    the prompt's worker (the last task's: the only one, or the prefill worker) must take image
    rows (`embeds_endpoint`); the least loaded encoder worker gets them (its count goes up until
    its next heartbeat). Unchanged without encoders or such a worker."""
    prompt_worker, task = tasks[-1]
    target = workers.get(prompt_worker)
    if not encoders or target is None or not target.embeds_endpoint:
        return tasks
    encoder = min(encoders, key=lambda w: (w.running + w.waiting, w.worker_id))
    encoder.waiting += 1
    encode = EncodeTask(
        request_id=req.request_id,
        images=req.images,
        target_worker_id=prompt_worker,
        target_endpoint=target.embeds_endpoint,
    )
    return [
        (encoder.worker_id, encode),
        *tasks[:-1],
        (prompt_worker, dataclasses.replace(task, encoder_id=encoder.worker_id)),
    ]
