"""The aiohttp application: routes, the error middleware and the request handlers.

The handlers stay thin: parsing is `pagemesh.gateway.parsing`, bodies and chunks `pagemesh.gateway.responses`,
metrics `pagemesh.gateway.metrics`, sockets `pagemesh.gateway.mesh`. Life of a generation request:

    read body (<= max_body_bytes) -> parse -> check model -> open reply queue -> submit
    -> await the first reply (a RequestFailed here becomes the HTTP error status, also for streams)
    -> JSON body when all choices finish, or SSE chunks as deltas arrive, then `data: [DONE]`
    finally: if the request did not end (client gone, timeout, error) -> abort it in the mesh

A completion with a batch of prompts runs as one request in the mesh per prompt, all replying to
the same queue; their choices are numbered across the batch (prompt i has choices i*n..i*n+n-1).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from aiohttp import web

from pagemesh.common.messages import ImageRequest, ImageResult, RequestFailed, TextDelta, TokenizeRequest
from pagemesh.common.tokenizer import Tokenizer
from pagemesh.gateway import anthropic, openapi
from pagemesh.gateway.answers import Answer, openai_answer
from pagemesh.gateway.anthropic_answer import messages_answer
from pagemesh.gateway.audio import AudioRoute
from pagemesh.gateway.auth import API_KEY, ApiKeys, auth_middleware
from pagemesh.gateway.chat_output import chat_output_spec
from pagemesh.gateway.config import GatewayConfig
from pagemesh.gateway.drain import GatewayDrain
from pagemesh.gateway.embeddings import EmbeddingsRoute
from pagemesh.gateway.errors import ApiError, from_request_failed, http_error, internal, invalid
from pagemesh.gateway.images import image_response, parse_image_request
from pagemesh.gateway.limits import KeyLimits, estimate_prompt_tokens
from pagemesh.gateway.lora import LoRARoutes
from pagemesh.gateway.mesh import MeshClient, Reply
from pagemesh.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagemesh.gateway.metrics import GatewayMetrics, RequestTimer
from pagemesh.gateway.models import ModelRoutes
from pagemesh.gateway.openai_responses import parse_responses
from pagemesh.gateway.openai_responses_answer import responses_answer
from pagemesh.gateway.parsing import ParsedRequest, check_model, parse_chat, parse_completion, parse_json
from pagemesh.gateway.responses import ResponseBuilder, to_json
from pagemesh.gateway.status import RequestTrace, StatusPage
from pagemesh.gateway.structured_outputs import GrammarCheck
from pagemesh.gateway.tokens import TokenRoutes

log = structlog.get_logger()

STATUS_TIMEOUT_S = 1.0
STARTUP_POLL_S = 0.25  # how often a request that waits for a starting mesh asks again
RETRY_AFTER_S = 5  # what a 503 during start-up tells clients to wait


class RequestEnded(Exception):
    """The mesh ended the request with an error (a RequestFailed); nothing to abort."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


@dataclass
class _Call:
    """One generation request in flight."""

    request_id: str
    queue: asyncio.Queue[Reply]  # one for all of its requests in the mesh
    deadline: float
    builder: ResponseBuilder
    timer: RequestTimer
    offsets: dict[str, int]  # request in the mesh (one per prompt) -> index of its first choice
    trace: RequestTrace  # its timings for the status page's recent requests
    ended: bool = False
    failed: str | None = None  # the request in the mesh that ended it with an error
    submitted: set[str] = dataclasses.field(default_factory=set)  # requests sent into the mesh


class Gateway:
    """Handlers over one MeshClient; `app()` builds the aiohttp application."""

    def __init__(
        self,
        config: GatewayConfig,
        mesh: MeshClient,
        tokenizer: Tokenizer,
        metrics: GatewayMetrics,
        drain: GatewayDrain | None = None,
    ):
        self.config, self.mesh, self.tokenizer, self.metrics = config, mesh, tokenizer, metrics
        self.drain = drain
        self.started = int(time.time())
        self.status_page = StatusPage(lambda: mesh.status(STATUS_TIMEOUT_S), config.served_model)
        self.keys = ApiKeys(config.api_keys)
        self.grammar_check = GrammarCheck(tokenizer)
        self.limits = KeyLimits(config.max_concurrent_requests_per_key, config.max_tokens_per_minute_per_key)
        self.serving = config.startup_wait <= 0  # the mesh was ready once (or the check is off)
        self.tokens = TokenRoutes(config, mesh, self.limits)  # /tokenize, /detokenize (gateway/tokens.py)
        self.embeddings = EmbeddingsRoute(config, mesh, self.limits, self._until_serving)
        self.audio = AudioRoute(config, mesh, self.limits, metrics)  # /v1/audio/transcriptions (gateway/audio.py)
        self.loras = LoRARoutes(config, mesh, self.started)  # adapters: `model`, /v1/models, (un)load routes
        self.models = ModelRoutes(config, mesh, self.loras, self.started)  # /v1/models

    def app(self) -> web.Application:
        limit = self.config.max_body_bytes
        authenticate = auth_middleware(self.keys, self.config.metrics_require_key)
        middlewares = [_error_middleware(limit), authenticate] + ([self.drain.middleware()] if self.drain else [])
        app = web.Application(client_max_size=limit, middlewares=middlewares)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/images/generations", self.images_generations)
        app.router.add_post("/v1/audio/transcriptions", self.audio.handle)
        app.router.add_post("/v1/embeddings", self.embeddings.handle)
        app.router.add_post("/tokenize", self.tokens.tokenize)
        app.router.add_post("/detokenize", self.tokens.detokenize)
        app.router.add_post("/v1/load_lora_adapter", self.loras.load)
        app.router.add_post("/v1/unload_lora_adapter", self.loras.unload)
        app.router.add_get("/v1/models", self.models.list)
        app.router.add_get("/v1/models/{model:.+}", self.models.one)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/", self.status_page.page)
        app.router.add_get("/status", self.status_page.status)
        app.router.add_get("/version", openapi.version)
        app.router.add_get("/openapi.json", openapi.document)
        app.router.add_get("/docs", openapi.docs_page)
        return app

    # ---- generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API, run as a chat completion (gateway/anthropic.py)."""
        return await self._generate(request, anthropic.parse_messages, messages_answer)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's count_tokens: the prompt a Messages request would have, rendered by the
        chat template and counted in the tokenizer process (one TokenizeRequest, no worker)."""
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise _too_large(self.config.max_body_bytes)
        parsed = anthropic.parse_count_tokens(parse_json(await request.read()))
        check_model(parsed, self.config.model_names)
        count = TokenizeRequest(
            request_id=f"tok-{uuid.uuid4().hex}",
            reply_to=self.mesh.reply_to,
            prompt_text=None,
            messages=parsed.messages,
            add_special_tokens=False,  # as a chat request's prompt: the template writes its own
            tools=parsed.chat_options.tools_json() if parsed.chat_options else None,
            chat_template_kwargs=parsed.chat_options.template_kwargs_json() if parsed.chat_options else None,
        )
        admission = self.limits.admit(request[API_KEY], None)  # concurrency only: nothing is generated
        try:
            result = await self.mesh.call(count, self.config.request_timeout)
        finally:
            admission.finish(0)
        return web.json_response({"input_tokens": len(result.token_ids)})

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API, stateless, run as a chat completion (gateway/openai_responses.py)."""
        return await self._generate(request, parse_responses, responses_answer)

    async def _generate(
        self,
        request: web.Request,
        parse: Callable[[dict], ParsedRequest],
        answer_of: Callable[[dict, ParsedRequest], Answer] = openai_answer,
    ) -> web.StreamResponse:
        arrival = time.monotonic()
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise _too_large(self.config.max_body_bytes)
        body = parse_json(await request.read())
        parsed = parse(body)
        answer = answer_of(body, parsed)
        parsed = await self.loras.resolve(parsed)  # the base model's names, or a LoRA adapter's (404 else)
        model = parsed.sampling.lora or self.config.served_model  # what the answer reports, as vLLM
        chat_output = chat_output_spec(parsed, self.config)  # reasoning and tool calls in a chat answer
        await self.grammar_check.check(parsed)  # structured outputs: the grammar compiles, or a 400
        await self._until_serving()

        request_id = f"cmpl-{uuid.uuid4().hex}"
        keep_special = chat_output is not None and chat_output.keep_special_tokens
        images = self.config.media.load(parsed.image_urls) if parsed.image_urls else None  # gateway/media.py
        requests = parsed.to_generate_requests(
            request_id, model, self.mesh.reply_to, time.time(), skip_special_tokens=not keep_special, images=images
        )
        n = parsed.sampling.n
        builder = ResponseBuilder(
            kind=parsed.kind,
            request_id=request_id,
            model=model,
            created=int(time.time()),
            n=n * len(requests),
            logprobs=parsed.logprobs,
            include_usage=parsed.include_usage,
            token_text=self.tokenizer.token_text,
            choices_per_prompt=n,
            echo=self._echo(parsed),
            chat_output=chat_output,
        )
        offsets = {r.request_id: i * n for i, r in enumerate(requests)}
        admission = self.limits.admit(request[API_KEY], estimate_prompt_tokens(parsed.prompts, parsed.messages))
        call = _Call(
            request_id,
            self.mesh.open(list(offsets)),
            arrival + self.config.request_timeout,
            builder,
            self.metrics.request(arrival),
            offsets,
            self.status_page.trace(request_id, parsed.kind, arrival),
        )
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            abort_reason = "gateway error"
            try:
                for r in requests:
                    await self.mesh.submit(r)
                    call.submitted.add(r.request_id)
                first = await self._next(call)  # errors before any output keep their HTTP status
                if parsed.stream:
                    return await self._stream(request, call, first, answer)
                self._apply(call, first)
                while not call.ended:
                    self._apply(call, await self._next(call))
                log.info(
                    "request done",
                    kind=parsed.kind,
                    completion_tokens=builder.completion_tokens,
                    seconds=round(time.monotonic() - arrival, 4),
                )
                return web.Response(body=to_json(answer.response(builder)), content_type="application/json")
            except RequestEnded as e:
                self.status_page.finished(call.trace, time.monotonic(), e.error.code or e.error.type)
                raise e.error from None
            except asyncio.CancelledError:
                abort_reason = "client disconnected"
                raise
            except ConnectionResetError:  # the client closed its connection while its stream was written
                abort_reason = "client disconnected"
                log.info("client left mid-stream")
                # never sent: aiohttp drops a response to a closed connection quietly (raising
                # would log an error with a traceback for a client that simply left)
                return web.Response(status=499)
            except ApiError as e:
                abort_reason = e.code or e.message
                raise
            finally:
                # stopped early: the client left, a timeout, or one prompt of a batch failed
                unended = [
                    r
                    for r, start in offsets.items()
                    if r in call.submitted and r != call.failed and not builder.choices_finished(start, n)
                ]
                if unended:
                    if call.failed is not None:
                        abort_reason = "another prompt of the batch failed"
                    log.info("aborting request", reason=abort_reason, parts=len(unended))
                    self.metrics.aborted(_abort_slug(abort_reason))
                    for r in unended:
                        self.mesh.abort(r, abort_reason)
                for r in offsets:
                    self.mesh.discard(r)
                admission.finish(builder.prompt_tokens + builder.completion_tokens)

    async def images_generations(self, request: web.Request) -> web.Response:
        """One image request in the mesh for all `n` images; JSON when they are done."""
        try:
            return await self._images(request)
        except ApiError as e:
            self.metrics.image_request(e.status)
            raise

    async def _images(self, request: web.Request) -> web.Response:
        arrival = time.monotonic()
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise _too_large(self.config.max_body_bytes)
        model, params = parse_image_request(parse_json(await request.read()))
        admission = self.limits.admit(request[API_KEY], None)  # images: concurrency only, no tokens
        request_id = f"img-{uuid.uuid4().hex}"
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                request_msg = ImageRequest(
                    request_id=request_id,
                    model=model,
                    params=params,
                    reply_to=self.mesh.reply_to,
                    arrival_time=time.time(),
                )
                reply = await self.mesh.call_direct(request_msg, arrival, self.config.request_timeout)
                if isinstance(reply, RequestFailed):
                    log.info("image request failed", status=reply.status, error=reply.message)
                    raise from_request_failed(reply)
                assert isinstance(reply, ImageResult), reply
                log.info("image request done", images=len(reply.images), steps=reply.steps)
                blocks = (reply.blocks_computed, reply.blocks_skipped)
                self.metrics.image_request(200, time.monotonic() - arrival, len(reply.images), reply.steps, blocks)
                body = image_response(reply, int(time.time()))
                return web.Response(body=to_json(body), content_type="application/json")
            finally:
                admission.finish(0)

    async def _until_serving(self) -> None:
        """Until the mesh has been ready once (tokenizer answering, the scheduler's needed roles
        live), a request waits for it up to `startup_wait` s, then gets 503 with Retry-After.
        After that, failures are the mesh's to report (a lost worker, a restarted tokenizer)."""
        deadline = time.monotonic() + self.config.startup_wait
        while not self.serving:
            if self.mesh.tokenizer_known:
                status = await self.mesh.status(STATUS_TIMEOUT_S)
                if status is not None and status.ready:
                    self.serving = True
                    log.info("mesh ready: serving requests")
                    return
            if time.monotonic() >= deadline:
                raise ApiError(
                    503,
                    f"Service unavailable: the mesh is still starting; retry in {RETRY_AFTER_S} s.",
                    "server_error",
                    None,
                    "service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            await asyncio.sleep(STARTUP_POLL_S)

    def _echo(self, parsed: ParsedRequest) -> list[str] | None:
        """With echo: each prompt's text (a prompt of token ids decoded)."""
        if not parsed.echo:
            return None
        try:
            return [text if text is not None else self.tokenizer.decode(ids) for text, ids in parsed.prompts]
        except ValueError as e:  # an id outside the vocabulary
            raise invalid(f"prompt: {str(e).partition(': ')[2]}", "prompt") from None

    async def _next(self, call: _Call) -> tuple[float, list[TextDelta]]:
        remaining = call.deadline - time.monotonic()
        try:
            now, item = await asyncio.wait_for(call.queue.get(), max(remaining, 0.0))
        except TimeoutError:
            raise ApiError(
                504, f"request timed out after {self.config.request_timeout:g} s", "server_error", None, "timeout"
            ) from None
        if isinstance(item, RequestFailed):
            call.ended, call.failed = True, item.request_id
            log.info("request failed", status=item.status, error=item.message)
            raise RequestEnded(from_request_failed(item))
        if len(call.offsets) > 1:  # a batch of prompts: number the choices across the batch
            item = [dataclasses.replace(d, index=call.offsets[d.request_id] + d.index) for d in item]
        return now, item

    def _apply(self, call: _Call, reply: tuple[float, list[TextDelta]]) -> list[dict]:
        """Feed one reply to the builder and the timer; return its stream chunks. Sets
        `call.ended` once every choice has finished."""
        now, deltas = reply
        chunks = []
        for delta in deltas:
            call.timer.on_delta(delta, now)
            call.trace.on_delta(delta, now)
            chunk = call.builder.add(delta)
            if chunk is not None:
                chunks.append(chunk)
        if call.builder.finished:
            call.ended = True
            call.timer.on_finished(now)
            self.status_page.finished(call.trace, now)
        return chunks

    async def _stream(
        self, request: web.Request, call: _Call, first: tuple[float, list[TextDelta]], answer: Answer
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        builder = call.builder
        stream = answer.stream(builder)
        out = bytearray()
        try:
            chunks = self._apply(call, first)  # before the opening, which may name the prompt's length
            out += stream.start()
            while True:
                for chunk in chunks:
                    out += stream.chunk(chunk)
                if call.ended:
                    break
                if out:
                    await response.write(bytes(out))
                    out.clear()
                chunks = self._apply(call, await self._next(call))
            out += stream.end()
        except (RequestEnded, ApiError) as e:  # after the headers: report in the stream
            error = e.error if isinstance(e, RequestEnded) else e
            self.status_page.finished(call.trace, time.monotonic(), error.code or error.type)
            out += stream.error(error)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # the status line is sent: end the stream with an error event
            log.exception("unhandled error in stream")
            out += stream.error(internal())
        await response.write(bytes(out))
        await response.write_eof()
        log.info("request done", stream=True, completion_tokens=builder.completion_tokens, ended=call.ended)
        return response

    # ---- other endpoints

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def ready(self, request: web.Request) -> web.Response:
        status = await self.mesh.status(STATUS_TIMEOUT_S)
        if status is None:
            raise ApiError(503, "the scheduler did not answer", "service_unavailable", None, "not_ready")
        if not status.ready:
            raise ApiError(503, "the mesh has no workers ready", "service_unavailable", None, "not_ready")
        if not self.mesh.tokenizer_known:
            raise ApiError(503, "the tokenizer did not answer", "service_unavailable", None, "not_ready")
        return web.json_response({"ready": True, "workers": len(status.workers), "queued": status.queued})

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.metrics.update_cluster(await self.mesh.status(STATUS_TIMEOUT_S))
        self.metrics.tokenizer_moves(self.mesh.tokenizer_moves)
        return web.Response(body=self.metrics.render().encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})


def _abort_slug(reason: str) -> str:
    """A bounded label value for pagemesh_requests_aborted_total (reasons may be error texts)."""
    known = {"client disconnected": "client_disconnected", "timeout": "timeout"}
    return known.get(reason, "error")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body larger than {limit} bytes", "invalid_request_error", None, "request_too_large")


def _error_middleware(max_body_bytes: int):
    @web.middleware
    async def errors(request: web.Request, handler) -> web.StreamResponse:
        """Every error leaves as OpenAI's `{"error": {...}}` (Anthropic's shape under its
        /v1/messages) with its status; never a traceback."""
        try:
            return await handler(request)
        except ApiError as e:
            error = e
        except web.HTTPRequestEntityTooLarge:
            error = _too_large(max_body_bytes)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            error = http_error(e.status, f"{request.method} {request.path}: {e.reason}")
            if "Allow" in e.headers:
                error.headers["Allow"] = e.headers["Allow"]
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error", path=request.path)
            error = internal()
        body = anthropic.error_body(error) if anthropic.owns(request.path) else error.body()
        headers = error.headers
        return web.Response(status=error.status, body=to_json(body), content_type="application/json", headers=headers)

    return errors
