"""Request migration: which requests may move to another worker when theirs is lost.

    worker lost ──▶ scheduler: cannot_migrate(placed)? ──yes──▶ RequestFailed (503 worker_failure)
                                                      └─no───▶ MigrateRequest ──▶ tokenizer
    tokenizer ──ScheduleRequest(resume: generated ids, migrations + 1)──▶ scheduler
    scheduler ──PrefillTask(resumed)──▶ the prefill worker that kept its pages: sends them again
              DecodeTask(output_token_ids)──▶ a decode worker: replays them, goes on
      (or, no keeper alive) GenerateTask(output_token_ids)──▶ a decode or mixed worker: recomputes

(An image or a transcription is not resumed: it starts over elsewhere, failures.py's `retry`.)
A request moves when it is an LLM request and has moved fewer than
`--max-migrations` times (a request that keeps killing its workers ends). Whether its state can
move is the tokenizer's call, which knows what was streamed: one choice moves with the ids its
client received; several choices (n > 1) each move with theirs (the finished ones stay done);
best_of and beams (nothing streamed until the end) start over. Pure logic.

An exact resume (handed off from a prefill worker that is still alive): the prefill
worker kept the prompt's pages it sent (workers/llm/handoff_out.py), so the request goes to a
decode worker paired with that prefill worker, which sends the same pages again, every one
(`skip_pages` 0: the new decode worker's cached copies may be other bits); the decode worker
decodes the generated tokens again one step each, as given (Sequence.replay; each unfinished
choice its own). Where the lost worker made them by plain decode steps (no speculation, no
preemption) and the keeper still had the pages, the K/V the new worker holds is the bits the lost
one held, so a greedy or seeded stream goes on as it would have (decode steps are
batch-invariant by default for the quantized default model: docs/perf/batch_invariance.md says
where they are not). Otherwise (no keeper alive, a mixed pool) it is recomputed whole where it
goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagemesh.common.messages import ResumedChoice, ScheduleRequest

if TYPE_CHECKING:
    from pagemesh.services.scheduler.registry import WorkerInfo


def migrations_of(request: ScheduleRequest) -> int:
    """How often the request has moved so far."""
    return request.resume.migrations if request.resume is not None else 0


def cannot_migrate(migrations: int | None, max_migrations: int) -> str | None:
    """Why a request that lost its worker cannot move, said after the loss's own why ("" when
    nothing need be added), or None: it moves."""
    if max_migrations == 0 or migrations is None:
        return ""  # migration is off, or not for this request (an image): the loss says it all
    if migrations >= max_migrations:
        return f" (the request has moved {migrations} times already; --max-migrations is {max_migrations})"
    return None


def resumed_output(request: ScheduleRequest) -> list[int]:
    """The tokens a migrated request of one choice generated before (empty: it starts from its
    prompt, or it has several choices: `resumed_choices`)."""
    return request.resume.output_token_ids if request.resume is not None else []


def resumed_choices(request: ScheduleRequest) -> list[ResumedChoice]:
    """Each unfinished choice of a migrated request of several choices, with its tokens."""
    return request.resume.choices if request.resume is not None else []


def longest_resumed(request: ScheduleRequest) -> int:
    """Tokens the longest choice of a migrated request recomputes after its prompt."""
    return max([len(resumed_output(request)), *(len(c.output_token_ids) for c in resumed_choices(request))])


def resume_pairs(
    request: ScheduleRequest, keeper: str | None, prefill: list[WorkerInfo], decode: list[WorkerInfo]
) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
    """The prefill and decode workers a migrated request may be placed on as a pair (both empty:
    on one decode or mixed worker, which recomputes it). With generated tokens (its one choice's,
    or each unfinished choice's): only the alive prefill worker that keeps its prompt's pages
    (`keeper`, by id), for an exact resume; without (it moved before its first token): any pair,
    prefilled again."""
    choices = resumed_choices(request)
    if choices and not all(c.output_token_ids for c in choices):
        return [], []  # a choice with nothing to replay: recomputed whole
    if resumed_output(request) or choices:
        kept = [w for w in prefill if w.worker_id == keeper]
        return (kept, decode) if kept else ([], [])
    return prefill, decode
