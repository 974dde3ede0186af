"""A stream moved to this tokenizer replica from a lost one (GenerateRequest.resume).

    gateway ──GenerateRequest(request_id=<new id>, resume=[ResumedText per choice])──▶ this replica
        admit(): the prompt is tokenized again (the same ids); each choice's detokenizer is fed the
        ids its client has had, so its stop-string and UTF-8 state is what the lost replica's was
        ──ScheduleRequest(resume=ResumeState)──▶ scheduler: a worker recomputes those ids and
        generates on, as after a worker's loss (services/tokenizer/core.py's on_migrate)

The text a rebuilt detokenizer gives for the ids is what the client has had, in the normal case:
then nothing more is sent for them. If it gives more (text the lost replica held back, e.g. the
start of a possible stop string), the rest goes out before the choice's next text (`pending`); if
it gives less, that many characters of the next text are not sent again (`skip`).

Pure logic: no sockets.
"""

from __future__ import annotations

from typing import Protocol

from pagemesh.common.messages import ResumedChoice, ResumedText, ResumeState


class Detokenizer(Protocol):
    def add(self, new_ids: list[int]) -> tuple[str, str | None]: ...


class ResumableChoice(Protocol):
    detokenizer: Detokenizer
    completion_tokens: int
    output_ids: list[int]
    finished: bool
    worker_finished: bool
    pending: str
    skip: int


def restore_choice(choice: ResumableChoice, had: ResumedText) -> None:
    """Bring a new choice to where its client is: its ids, its detokenizer's state, its count."""
    choice.output_ids = list(had.output_token_ids)
    choice.completion_tokens = len(had.output_token_ids)
    if had.finished:
        choice.finished = choice.worker_finished = True
        return
    text, _ = choice.detokenizer.add(choice.output_ids)
    choice.pending = text[had.text_chars :]
    choice.skip = max(had.text_chars - len(text), 0)


def continued_text(choice: ResumableChoice, text: str) -> str:
    """A choice's next text, after what a restored choice still owes its client (or has sent twice)."""
    if choice.pending:
        text, choice.pending = choice.pending + text, ""
    if choice.skip:
        dropped = min(choice.skip, len(text))
        text, choice.skip = text[dropped:], choice.skip - dropped
    return text


def resume_state(choices: list[ResumableChoice], migrations: int) -> ResumeState:
    """What the scheduler needs to continue a request's choices on another worker (a migration,
    or a move from another tokenizer): one choice moves with its ids; several (n > 1) move each
    unfinished choice with its own ids (the finished ones stay done) once one has streamed, and
    start over before (as best_of and beams, which stream nothing until they end)."""
    if len(choices) == 1:
        return ResumeState(output_token_ids=list(choices[0].output_ids), migrations=migrations)
    if not any(c.output_ids for c in choices):
        return ResumeState(output_token_ids=[], migrations=migrations)
    unfinished = [
        ResumedChoice(index=i, output_token_ids=list(c.output_ids)) for i, c in enumerate(choices) if not c.finished
    ]
    return ResumeState(output_token_ids=[], migrations=migrations, choices=unfinished)
