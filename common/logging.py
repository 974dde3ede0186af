"""structlog set-up shared by every process: one JSON object per line on stderr.

Each line carries `timestamp` (ISO 8601, UTC), `level`, `event`, the process's `service` and
`name` (its worker id, replica name, ...), anything bound with `structlog.contextvars`
(e.g. `request_id`) and the logger's own bound values. Standard-library log records (aiohttp,
asyncio) go through the same renderer, so stderr holds JSON lines only.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


def configure_logging(service: str, name: str, level: str = "INFO") -> None:
    """Route structlog and stdlib logging to JSON lines on stderr; call once at process start."""
    try:
        threshold = _LEVELS[level.upper()]
    except KeyError:
        raise ValueError(f"log level: must be one of {', '.join(_LEVELS)}, got {level!r}") from None

    def add_process(_logger, _method, event: dict) -> dict:
        event.setdefault("service", service)
        event.setdefault("name", name)
        return event

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_process,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(threshold)
