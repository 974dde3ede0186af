"""The aiohttp runner of the gateway: requests aiohttp refuses before any handler runs (a header
line over the limit, too many headers, a malformed request line) get OpenAI's error shape too.

aiohttp answers those from `RequestHandler.handle_error` with a text/plain page, outside every
middleware. `GatewayRunner` makes its server build connection handlers whose `handle_error`
writes the JSON error instead: 431 for a request line or header over `max_header_bytes`
(`--max-header-bytes`) or too many headers, 400 for the rest of what cannot be parsed.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from pagemesh.gateway.errors import ApiError, internal
from pagemesh.gateway.responses import to_json

MAX_HEADERS = 128  # header lines in one request (aiohttp's default)


class _JsonErrorHandler(RequestHandler):
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message=None):
        response = super().handle_error(request, status, exc, message)  # logs it; raises if output began
        error = _error_for(status, exc)
        json_response = web.Response(
            status=error.status, body=to_json(error.body()), content_type="application/json", headers=error.headers
        )
        if not response.keep_alive:
            json_response.force_close()
        return json_response


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose server answers unparsable requests in the OpenAI shape, with the
    request line and header limits set: `GatewayRunner(app, max_header_bytes=8190, ...)`."""

    def __init__(self, app: web.Application, *, max_header_bytes: int = 8190, **kwargs):
        kwargs.setdefault("max_line_size", max_header_bytes)
        kwargs.setdefault("max_field_size", max_header_bytes)
        kwargs.setdefault("max_headers", MAX_HEADERS)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The same server with one method replaced (the class adds no state): aiohttp has no
        # public hook for the handler class. tests/unit/test_gateway_limits.py pins the result.
        server.__class__ = _JsonErrorServer
        return server


def _error_for(status: int, exc: BaseException | None) -> ApiError:
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the limit"
        return ApiError(
            431,
            f"request header fields too large: a header line (or the request line) is longer than {limit} bytes",
            "invalid_request_error",
            None,
            "request_header_fields_too_large",
        )
    if isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc):
        return ApiError(
            431,
            f"request header fields too large: more than {MAX_HEADERS} headers",
            "invalid_request_error",
            None,
            "request_header_fields_too_large",
        )
    if status < 500:
        return ApiError(status, f"malformed HTTP request: {exc}"[:300], "invalid_request_error", None, "bad_request")
    return internal()
