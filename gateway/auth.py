"""API keys: which requests the gateway serves at all.

    Authorization: Bearer <key> ──ApiKeys.check──▶ the key (the limiter's bucket), or a 401
    x-api-key: <key>            ──┘ (Anthropic's header, read when there is no Bearer key)

Keys come from `--api-key` (repeatable), `--api-key-file` (one key per line; blank lines and
`#` comments skipped) and `PAGEMESH_API_KEY`. No keys configured = every request is served, as one
anonymous key. The comparison hashes both sides first, so every comparison takes the same time
whatever the key's length, and it goes over every configured key without stopping at a match.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from aiohttp import web

from pagemesh.gateway.errors import ApiError

ANONYMOUS = ""  # the key of every request when no keys are configured
API_KEY = web.RequestKey("api_key", str)  # request[API_KEY]: the key the request came with
MAX_KEY_LEN = 512


def key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key (it must fit in a header as one token), or None."""
    if not key:
        return "an API key must not be empty"
    if len(key) > MAX_KEY_LEN:
        return f"an API key must be at most {MAX_KEY_LEN} characters"
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        return "an API key must be printable ASCII without spaces"
    return None


def read_key_file(path: str | Path) -> list[str]:
    """The keys in a file, one per line; blank lines and lines starting with `#` are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


class ApiKeys:
    """The configured keys. `check(header)` returns the request's key or raises the 401."""

    def __init__(self, keys: tuple[str, ...]):
        self._digests = [_digest(k) for k in dict.fromkeys(keys)]
        self._keys = tuple(dict.fromkeys(keys))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None, x_api_key: str | None = None) -> str:
        """The key of `Authorization: Bearer KEY`, or else of Anthropic's `x-api-key: KEY`."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, given = (authorization or "").strip().partition(" ")
        given = given.strip() if scheme.lower() == "bearer" else ""
        if not given:
            given = (x_api_key or "").strip()
        if not given:
            raise _unauthorized(
                "You didn't provide an API key. Send it in the Authorization header: `Authorization: Bearer YOUR_KEY` "
                "(or as `x-api-key: YOUR_KEY`)."
            )
        digest = _digest(given)
        found = None
        for key, known in zip(self._keys, self._digests, strict=True):  # no early exit: same time for every key
            if hmac.compare_digest(digest, known):
                found = key
        if found is None:
            raise _unauthorized("Incorrect API key provided.")
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _unauthorized(message: str) -> ApiError:
    # OpenAI answers a bad key with 401 invalid_request_error / invalid_api_key; the openai client
    # raises AuthenticationError for any 401.
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


# Served without a key: orchestrators' probes and what people read to learn the API. Every other
# path (every /v1/* route, and the operational ones — /metrics, the status page `/` and its
# `/status` — unless --metrics-require-key) needs one: a path nobody listed is closed, not open.
# The status page is for a browser, which sends no Bearer header: like /metrics, it shows loads
# and timings, never a prompt or an answer.
OPEN_PATHS = frozenset({"/health", "/ready", "/version", "/openapi.json", "/docs"})
OPERATIONAL_PATHS = frozenset({"/metrics", "/", "/status"})


def auth_middleware(keys: ApiKeys, metrics_require_key: bool):
    """Checks the request's key before its handler runs unless its path is open, and leaves the
    key in `request[API_KEY]` (ANONYMOUS on open paths and when no keys are configured)."""
    open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS | OPERATIONAL_PATHS

    @web.middleware
    async def authenticate(request: web.Request, handler) -> web.StreamResponse:
        is_open = request.path in open_paths or not keys.enabled
        headers = request.headers
        request[API_KEY] = ANONYMOUS if is_open else keys.check(headers.get("Authorization"), headers.get("x-api-key"))
        return await handler(request)

    return authenticate
