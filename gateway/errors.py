"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagemesh.common.messages import RequestFailed


@dataclass
class ApiError(Exception):
    """Raised anywhere in request handling; the app turns it into the JSON error response."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400 for a bad field; `message` starts with the field's name."""
    return ApiError(400, message, "invalid_request_error", param, code)


def from_value_error(error: ValueError, rename: dict[str, str] | None = None) -> ApiError:
    """`ValueError("top_p: must be in (0, 1]")` -> 400 with param "top_p" (renamed if asked)."""
    message = str(error)
    head, sep, rest = message.partition(":")
    param = head if sep and head and " " not in head else None
    if param and rename and param in rename:
        param = rename[param]
        message = f"{param}:{rest}"
    return invalid(message, param)


def from_request_failed(failed: RequestFailed, retry_after_s: int = 1) -> ApiError:
    headers = {"Retry-After": str(retry_after_s)} if failed.status == 503 else {}
    return ApiError(failed.status, failed.message, failed.error_type, failed.param, failed.code, headers)


def http_error(status: int, reason: str) -> ApiError:
    """Errors aiohttp itself raises (unknown route, wrong method, body too large)."""
    kind = {
        404: ("not_found_error", "not_found"),
        405: ("invalid_request_error", "method_not_allowed"),
        413: ("invalid_request_error", "request_too_large"),
    }.get(status)
    if kind is None:
        kind = ("invalid_request_error", None) if status < 500 else ("server_error", None)
    return ApiError(status, reason, kind[0], None, kind[1])


def internal() -> ApiError:
    """500 without details: the cause goes to the log, never to the client."""
    return ApiError(500, "internal server error", "server_error", None, "internal_error")
