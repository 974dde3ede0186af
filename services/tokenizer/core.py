"""The tokenizer service without sockets: admit requests, turn token batches into text.

    GenerateRequest ──admit()──▶ ScheduleRequest (to the scheduler) | RequestFailed (to the gateway)
    TokenDeltaBatch ──on_tokens()──▶ one TextDeltaBatch per gateway + AbortRequests (stop strings,
                                     and tokens of requests this process does not know)
    RequestFailed / AbortRequest ──▶ the request's state is dropped
    scheduler restarted ──unstarted()──▶ the ScheduleRequests no worker said it holds, to send again
    MigrateRequest ──on_migrate()──▶ the ScheduleRequest again, with the ids its client has had
                                     (resume) | RequestFailed (to the gateway) if it cannot move
    EmbedRequest ──admit_embedding()──▶ ScheduleRequest(pooling) | RequestFailed; its request lives
                                     here until its EmbeddingBatch passes (`on_embeddings`), so
                                     failures, migration and scheduler restarts treat it as any other
    TokenizeRequest / DetokenizeRequest ──tokenize() / detokenize()──▶ the answer (no state)

Request migration: when the scheduler loses the worker(s) generating a request, this process sends
it again with every token id it has streamed; the next worker recomputes them and generates on,
and the detokenizer and stop-string state here simply carry on, so the client sees one unbroken
stream. Late tokens from a lost worker (one that was only silent) are dropped, until that worker
id starts the request again (a process restarted under the id, chosen for the resumed request).

A stream can also move here from another tokenizer replica that was lost (gateway/mesh.py): its
GenerateRequest carries, per choice, the ids and the text its client has had; admit() rebuilds the
choices' state from them and schedules the request as a migration (services/tokenizer/resume.py).

State per request: one IncrementalDetokenizer per choice. A choice is finished when a stop string
matched or its worker reported a finish_reason; the request's state goes when every choice is
finished. If stop strings finished choices the worker is still generating, the request is aborted
at the scheduler (aborts are per request, so only once every choice is done).

Tokens of a request this process does not know, from a worker still generating it, are an orphan's:
the request was lost with a restart (of this tokenizer, or of the scheduler before it placed the
request's retry). They are aborted at the worker that sent them, at most once per
ORPHAN_ABORT_INTERVAL_S per request (late tokens after an abort cost one more abort message).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import jinja2

from pagemesh.common.messages import (
    AbortRequest,
    DetokenizeRequest,
    DetokenizeResult,
    EmbeddingBatch,
    EmbedRequest,
    GenerateRequest,
    ImageInput,
    MigrateRequest,
    RequestFailed,
    ScheduleRequest,
    TextDelta,
    TextDeltaBatch,
    TokenDeltaBatch,
    TokenizeRequest,
    TokenizeResult,
)
from pagemesh.common.sampling import SamplingParams
from pagemesh.common.tokenizer import IncrementalDetokenizer, Tokenizer
from pagemesh.services.tokenizer.images import ImagePrompts
from pagemesh.services.tokenizer.resume import continued_text, restore_choice, resume_state

ORPHAN_ABORT_INTERVAL_S = 1.0  # between aborts of one unknown request whose tokens keep coming
MAX_ORPHANS_REMEMBERED = 4096


@dataclass
class _Choice:
    detokenizer: IncrementalDetokenizer
    completion_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)  # every token id streamed (a migration resends them)
    finished: bool = False  # no more text goes out for this choice
    worker_finished: bool = False  # the worker said it stopped generating it
    pending: str = ""  # a choice moved here (services/tokenizer/resume.py): text its client is still owed
    skip: int = 0  # ... or characters of its next text the client already has


@dataclass
class _Request:
    reply_to: str
    prompt_tokens: int
    choices: list[_Choice]
    started: bool = False  # a worker has it (its first delta came: output or the start marker)
    prompt_ids: list[int] | None = None  # kept when prompt logprobs are asked for (sent with them)
    schedule: ScheduleRequest | None = None  # until it started: sent again if the scheduler restarts
    first: ScheduleRequest | None = None  # as admitted: the base of a migration's resend
    migrations: int = 0
    lost_workers: set[str] = field(default_factory=set)  # workers whose tokens for it are stale
    stop_ids: frozenset[int] | None = None  # special tokens kept in its text: the ends not to write


@dataclass(frozen=True)
class TokenOutputs:
    """What one TokenDeltaBatch produced: text for each gateway (by reply_to address) and the
    requests to abort at the scheduler."""

    batches: dict[str, TextDeltaBatch] = field(default_factory=dict)
    aborts: list[AbortRequest] = field(default_factory=list)


class TokenizerCore:
    """Request state of one tokenizer replica. `reply_to` is this replica's output address, where
    workers push token batches."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, reply_to: str, images: ImagePrompts | None = None):
        """`images`: where the model takes images (None: a request with images is refused)."""
        self.tokenizer = tokenizer
        self.images = images
        self.max_model_len = max_model_len
        self.reply_to = reply_to
        self._requests: dict[str, _Request] = {}
        self._orphans_aborted: OrderedDict[str, float] = OrderedDict()  # request id -> when

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    # ---- requests in

    def admit(self, request: GenerateRequest) -> ScheduleRequest | RequestFailed:
        """Tokenize and check a request; on success keep its state and return what to schedule."""
        field_name = "messages" if request.messages is not None else "prompt"
        try:
            self.tokenizer.check_ids(request.sampling.stop_token_ids, "stop_token_ids")
            self.tokenizer.check_ids([i for i, _ in request.sampling.logit_bias], "logit_bias")
            prompt_ids, images = self._prompt_ids(request)
        except ValueError as e:
            return _invalid(request.request_id, str(e), _param_of(str(e), field_name))
        except jinja2.TemplateError as e:  # the chat template refused the conversation
            return _invalid(request.request_id, f"messages: {e}", "messages")
        if not prompt_ids:
            return _invalid(request.request_id, f"{field_name}: the prompt is empty", field_name)
        if request.request_id in self._requests:
            return _invalid(request.request_id, "request_id: already in progress", None)

        sampling = request.sampling
        prompt_len, limit = len(prompt_ids), self.max_model_len
        if sampling.max_tokens is None:  # as many as the context leaves
            if prompt_len >= limit:
                return self._too_long(request.request_id, field_name, prompt_len, None)
            room = limit - prompt_len
            sampling = dataclasses.replace(sampling, max_tokens=room, min_tokens=min(sampling.min_tokens, room))
        elif prompt_len + sampling.max_tokens > limit:
            return self._too_long(request.request_id, field_name, prompt_len, sampling.max_tokens)

        choices = [
            _Choice(
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    stop=sampling.stop,
                    skip_special_tokens=request.skip_special_tokens,
                    include_stop_str_in_output=request.include_stop_str_in_output,
                )
            )
            for _ in range(sampling.n)
        ]
        schedule = ScheduleRequest(
            request_id=request.request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            reply_to=self.reply_to,
            arrival_time=request.arrival_time,
            images=images,
        )
        first = schedule
        if request.resume:  # moved here from a lost tokenizer replica: continue where its client is
            for had in request.resume:
                restore_choice(choices[had.index], had)
            if any(c.output_ids for c in choices):  # else it starts as a new request
                schedule = dataclasses.replace(schedule, resume=resume_state(choices, migrations=1))
        # special tokens kept in the text: the end token is not written
        stop_ids = None if request.skip_special_tokens else self.tokenizer.eos_token_ids | set(sampling.stop_token_ids)
        self._requests[request.request_id] = _Request(
            request.reply_to,
            prompt_len,
            choices,
            prompt_ids=prompt_ids if sampling.prompt_logprobs is not None else None,
            schedule=schedule,
            first=first,
            stop_ids=stop_ids,
        )
        return schedule

    def _prompt_ids(self, request: GenerateRequest) -> tuple[list[int], list[ImageInput]]:
        """The prompt's ids and its images (placed: services/tokenizer/images.py)."""
        if request.prompt_text is not None:
            return self.tokenizer.encode(request.prompt_text), []
        if request.prompt_token_ids is not None:
            self.tokenizer.check_ids(request.prompt_token_ids, "prompt")
            return list(request.prompt_token_ids), []
        tools = json.loads(request.tools) if request.tools is not None else None
        kwargs = json.loads(request.chat_template_kwargs) if request.chat_template_kwargs is not None else None
        messages = [_with_tool_calls(m) for m in request.messages]
        if not request.images:
            return self.tokenizer.encode_chat(messages, tools=tools, template_kwargs=kwargs), []
        if self.images is None:
            raise ValueError("messages: this model does not take images (image_url parts)")
        messages = self.images.render(messages, len(request.images))
        ids = self.tokenizer.encode_chat(messages, tools=tools, template_kwargs=kwargs)
        return self.images.place(ids, request.images)

    def _too_long(self, request_id: str, field_name: str, prompt_len: int, max_tokens: int | None) -> RequestFailed:
        where = "messages" if field_name == "messages" else "prompt"
        head = f"This model's maximum context length is {self.max_model_len} tokens. However, "
        if max_tokens is None:
            message = f"{head}your {where} resulted in {prompt_len} tokens. Please reduce the length of the {where}."
        else:
            message = (
                f"{head}you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                f"{where}, {max_tokens} in the completion). Please reduce the length of the "
                f"{where} or completion."
            )
        return RequestFailed(
            request_id=request_id,
            status=400,
            error_type="invalid_request_error",
            message=message,
            param=field_name,
            code="context_length_exceeded",
        )

    def admit_embedding(self, request: EmbedRequest) -> ScheduleRequest | RequestFailed:
        """Tokenize and check one input of an embeddings request: not empty, inside the context
        length (the whole prompt runs; nothing is generated after it)."""
        rid = request.request_id
        try:
            if request.prompt_text is not None:
                prompt_ids = self.tokenizer.encode(request.prompt_text, request.add_special_tokens)
            else:
                self.tokenizer.check_ids(request.prompt_token_ids, "input")
                prompt_ids = list(request.prompt_token_ids)
        except ValueError as e:
            return _invalid(rid, str(e), _param_of(str(e), "input"))
        if not prompt_ids:
            return _invalid(rid, "input: the input is empty", "input")
        if rid in self._requests:
            return _invalid(rid, "request_id: already in progress", None)
        if len(prompt_ids) > self.max_model_len:
            return RequestFailed(
                request_id=rid,
                status=400,
                error_type="invalid_request_error",
                message=f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"input resulted in {len(prompt_ids)} tokens. Please reduce the length of the input.",
                param="input",
                code="context_length_exceeded",
            )
        schedule = ScheduleRequest(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            sampling=SamplingParams(temperature=0.0, max_tokens=1, priority=request.priority),
            reply_to=self.reply_to,
            arrival_time=request.arrival_time,
            pooling=request.pooling,
        )
        self._requests[rid] = _Request(request.reply_to, len(prompt_ids), [], schedule=schedule, first=schedule)
        return schedule

    def tokenize(self, request: TokenizeRequest) -> TokenizeResult | RequestFailed:
        """A prompt's or chat messages' token ids (and strings); nothing is kept."""
        rid = request.request_id
        try:
            if request.prompt_text is not None:
                ids = self.tokenizer.encode(request.prompt_text, request.add_special_tokens)
            else:
                messages = [_with_tool_calls(m) for m in request.messages]  # as a chat request's
                tools = json.loads(request.tools) if request.tools is not None else None
                kwargs = json.loads(request.chat_template_kwargs) if request.chat_template_kwargs is not None else None
                text = self.tokenizer.apply_chat_template(messages, request.add_generation_prompt, tools, kwargs)
                ids = self.tokenizer.encode(text, request.add_special_tokens)
        except ValueError as e:
            default = "messages" if request.messages is not None else "prompt"
            return _invalid(rid, str(e), _param_of(str(e), default))
        except jinja2.TemplateError as e:
            return _invalid(rid, f"messages: {e}", "messages")
        strs = self.tokenizer.token_strings(ids) if request.return_token_strs else None
        return TokenizeResult(request_id=rid, token_ids=ids, max_model_len=self.max_model_len, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResult | RequestFailed:
        """The text of token ids, special tokens spelled out (as vLLM's /detokenize)."""
        try:
            text = self.tokenizer.decode(request.token_ids, skip_special_tokens=False)
        except ValueError as e:  # an id outside the vocabulary
            return _invalid(request.request_id, f"tokens: {str(e).partition(': ')[2]}", "tokens")
        return DetokenizeResult(request_id=request.request_id, text=text)

    # ---- tokens in

    def on_embeddings(self, batch: EmbeddingBatch) -> dict[str, EmbeddingBatch]:
        """A worker's finished embeddings, regrouped by gateway; each request ends here. Those of
        requests this process does not know (ended meanwhile), or from a worker it moved away
        from, go nowhere."""
        by_gateway: dict[str, EmbeddingBatch] = {}
        for embedding in batch.embeddings:
            request = self._requests.get(embedding.request_id)
            if request is None or batch.worker_id in request.lost_workers:
                continue
            del self._requests[embedding.request_id]
            out = by_gateway.setdefault(request.reply_to, EmbeddingBatch(worker_id=batch.worker_id, embeddings=[]))
            out.embeddings.append(embedding)
        return by_gateway

    def on_tokens(self, batch: TokenDeltaBatch, now: float | None = None) -> TokenOutputs:
        """Detokenize a worker's batch. Deltas of unknown requests go to no gateway; the worker is
        told to stop the request if it is still generating it (see the module's docstring)."""
        out = TokenOutputs()
        by_gateway: dict[str, list[TextDelta]] = {}
        for started in batch.started:
            request = self._requests.get(started.request_id)
            if request is not None:
                request.started, request.schedule = True, None
                request.lost_workers.discard(batch.worker_id)  # a new placement there: its tokens count
            elif self._may_abort_orphan(started.request_id, now):
                out.aborts.append(
                    AbortRequest(
                        request_id=started.request_id, reason="unknown to the tokenizer", worker_id=batch.worker_id
                    )
                )
        for delta in batch.deltas:
            request = self._requests.get(delta.request_id)
            if request is None:
                if delta.finish_reason is None and self._may_abort_orphan(delta.request_id, now):
                    out.aborts.append(
                        AbortRequest(
                            request_id=delta.request_id, reason="unknown to the tokenizer", worker_id=batch.worker_id
                        )
                    )
                continue
            if not 0 <= delta.index < len(request.choices) or batch.worker_id in request.lost_workers:
                continue  # (late tokens of a worker it moved away from: the scheduler aborted it there)
            request.started, request.schedule = True, None
            if not delta.token_ids and delta.finish_reason is None and delta.prompt_logprobs is None:
                continue  # a step gave this choice nothing
            choice = request.choices[delta.index]
            if delta.finish_reason is not None:
                choice.worker_finished = True
            if choice.finished:
                continue
            ids = delta.token_ids
            if request.stop_ids is not None and delta.finish_reason == "stop" and ids and ids[-1] in request.stop_ids:
                ids = ids[:-1]  # special tokens are kept in the text, but not the one that ended it
            text, stop = choice.detokenizer.add(ids)
            choice.completion_tokens += len(delta.token_ids)
            choice.output_ids += delta.token_ids
            finish_reason = None
            if stop is not None:
                finish_reason = "stop"
            elif delta.finish_reason is not None:
                text += choice.detokenizer.flush()
                finish_reason = delta.finish_reason
            text = continued_text(choice, text)
            choice.finished = finish_reason is not None
            by_gateway.setdefault(request.reply_to, []).append(
                TextDelta(
                    request_id=delta.request_id,
                    index=delta.index,
                    text=text,
                    token_ids=delta.token_ids,
                    logprobs=delta.logprobs,
                    finish_reason=finish_reason,
                    prompt_tokens=request.prompt_tokens,
                    completion_tokens=choice.completion_tokens,
                    queue_time_s=delta.queue_time_s,
                    prompt_token_ids=request.prompt_ids if delta.prompt_logprobs is not None else None,
                    prompt_logprobs=delta.prompt_logprobs,
                    cached_tokens=delta.num_cached_tokens,
                )
            )
            if choice.finished and all(c.finished for c in request.choices):
                del self._requests[delta.request_id]
                if not all(c.worker_finished for c in request.choices):
                    out.aborts.append(AbortRequest(request_id=delta.request_id, reason="stop string"))
        out.batches.update((address, TextDeltaBatch(deltas=deltas)) for address, deltas in by_gateway.items())
        return out

    def _may_abort_orphan(self, request_id: str, now: float | None) -> bool:
        now = time.monotonic() if now is None else now
        last = self._orphans_aborted.get(request_id)
        if last is not None and now - last < ORPHAN_ABORT_INTERVAL_S:
            return False
        self._orphans_aborted[request_id] = now
        self._orphans_aborted.move_to_end(request_id)
        if len(self._orphans_aborted) > MAX_ORPHANS_REMEMBERED:
            self._orphans_aborted.popitem(last=False)
        return True

    # ---- ends from elsewhere

    def on_failed(self, failed: RequestFailed) -> str | None:
        """The scheduler refused the request: drop it; return the gateway to tell (None if unknown)."""
        request = self._requests.pop(failed.request_id, None)
        return None if request is None else request.reply_to

    def on_migrate(self, msg: MigrateRequest) -> ScheduleRequest | tuple[str, RequestFailed] | None:
        """The request's worker is gone: what to send the scheduler to move it (the prompt and
        every id streamed so far), or the failure for its gateway (address, error) when it
        cannot move. One choice moves with its ids; several (n > 1) move each unfinished choice
        with its own ids (the finished ones stay done); several with nothing streamed yet,
        best_of and beams (nothing streams until they end) start over. None: the request ended
        meanwhile."""
        request = self._requests.get(msg.request_id)
        if request is None:
            return None
        if request.first is None:
            del self._requests[msg.request_id]
            return request.reply_to, _worker_failure(msg.request_id, msg.reason)
        request.migrations += 1
        request.lost_workers.update(msg.lost_worker_ids)
        resend = dataclasses.replace(request.first, resume=resume_state(request.choices, request.migrations))
        request.started, request.schedule = False, resend  # a scheduler restart sends it again, as a new one
        return resend

    def drop_gateway(self, reply_to: str) -> list[str]:
        """The gateway at `reply_to` is gone (services/tokenizer/gateway_liveness.py): forget its
        requests; their ids, to abort at the scheduler."""
        ids = [rid for rid, r in self._requests.items() if r.reply_to == reply_to]
        for rid in ids:
            del self._requests[rid]
        return ids

    def on_abort(self, request_id: str) -> bool:
        """The gateway gave up on the request (client gone): drop it; True if it was known."""
        return self._requests.pop(request_id, None) is not None

    def unstarted(self) -> list[ScheduleRequest]:
        """The scheduler was restarted: the requests no worker has said it holds may have been
        queued in the process that is gone. Their ScheduleRequests, to send again (the new
        scheduler ignores the ones it already has); the others are on workers."""
        return [r.schedule for r in self._requests.values() if r.schedule is not None]


def _with_tool_calls(message: dict[str, str]) -> dict:
    """A chat message as its template reads it: an assistant's tool calls (JSON on the wire) as a list."""
    if "tool_calls" not in message:
        return message
    return {**message, "tool_calls": json.loads(message["tool_calls"])}


def _param_of(message: str, default: str) -> str:
    """`"messages[0].role: required"` -> `"messages[0].role"`: errors name their field first."""
    head, sep, _ = message.partition(":")
    return head if sep and head and " " not in head else default


def _worker_failure(request_id: str, why: str) -> RequestFailed:
    return RequestFailed(
        request_id=request_id,
        status=503,
        error_type="server_error",
        message=f"Request failed: {why}; retry later.",
        param=None,
        code="worker_failure",
    )


def _invalid(request_id: str, message: str, param: str | None) -> RequestFailed:
    return RequestFailed(
        request_id=request_id, status=400, error_type="invalid_request_error", message=message, param=param, code=None
    )
