"""Request migration: which requests may move to another worker when theirs is lost.

    worker lost ──▶ scheduler: cannot_migrate(placed)? ──yes──▶ RequestFailed (503 worker_failure)
                                                      └─no───▶ MigrateRequest ──▶ tokenizer
    tokenizer ──ScheduleRequest(resume: generated ids, migrations + 1)──▶ scheduler
    scheduler ──GenerateTask(output_token_ids)──▶ a decode or mixed worker: recomputes, goes on

(An image or a transcription is not resumed: it starts over elsewhere, failures.py's `retry`.)
A request moves when it is an LLM request and has moved fewer than
`--max-migrations` times (a request that keeps killing its workers ends). Whether its state can
move is the tokenizer's call, which knows what was streamed: one choice moves with the ids its
client received; several choices (n > 1) each move with theirs (the finished ones stay done);
best_of and beams (nothing streamed until the end) start over. Pure logic.
"""

from __future__ import annotations

from pagemesh.common.messages import ResumedChoice, ScheduleRequest


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
