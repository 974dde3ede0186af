"""structlog set-up shared by every process: one record per line on stderr, for people or machines.

Formats: `console` (aligned, readable: `time [level] event  key=value ...`), the default when
stderr is a terminal; `json` (one JSON object per line), the default otherwise, e.g. under
compose or a log collector. `PAGEMESH_LOG_FORMAT` or `pagemesh <command> --log-format` chooses.

Each record carries `timestamp` (ISO 8601, UTC), `level`, `event`, the process's `service` and
`name` (its worker id, replica name, ...), anything bound with `structlog.contextvars`
(e.g. `request_id`) and the logger's own bound values. Standard-library log records (aiohttp,
asyncio) go through the same renderer.

Every line leaves in one write, under one lock shared by structlog and the standard library:
structlog's PrintLogger wrote the text and its newline in two writes under its own lock, so a
stdlib record from another thread (the engine's compute thread, asyncio's) could land between
them, putting two JSON objects on one line.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from typing import IO

import structlog

_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}
FORMATS = ("console", "json")
FORMAT_ENV = "PAGEMESH_LOG_FORMAT"
COLOR_ENV = "PAGEMESH_LOG_COLOR"


class LineSink:
    """Writes whole lines to a binary stream: one write and flush per line, under one lock."""

    def __init__(self, stream: IO):
        self._stream, self._lock = stream, threading.Lock()
        self._binary = not isinstance(stream, io.TextIOBase)

    def write_line(self, text: str) -> None:
        line = text + "\n"
        data = line.encode("utf-8", "backslashreplace") if self._binary else line
        with self._lock:
            self._stream.write(data)
            self._stream.flush()


class _SinkLogger:
    """The structlog logger over a LineSink (every level method writes the rendered line)."""

    def __init__(self, sink: LineSink):
        self._sink = sink

    def msg(self, message: str) -> None:
        self._sink.write_line(message)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


class _SinkHandler(logging.Handler):
    """Standard-library records, formatted by structlog's ProcessorFormatter, into the sink."""

    def __init__(self, sink: LineSink):
        super().__init__()
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._sink.write_line(self.format(record))
        except Exception:
            self.handleError(record)


def log_format(requested: str | None = None, stream: IO | None = None) -> str:
    """`requested` (or $PAGEMESH_LOG_FORMAT), else console on a terminal and json elsewhere: with
    no `stream`, console only when stdout and stderr are both terminals (`pagemesh up > file`
    writes JSON)."""
    fmt = (requested or os.environ.get(FORMAT_ENV) or "").strip().lower()
    if not fmt:
        streams = [stream] if stream is not None else [sys.stdout, sys.stderr]
        return "console" if all(_is_terminal(s) for s in streams) else "json"
    if fmt not in FORMATS:
        raise ValueError(f"log format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def log_colors(stream: IO | None = None) -> bool:
    """Colour in console lines: $PAGEMESH_LOG_COLOR (1 or 0: `pagemesh up` sets it for its
    children, whose stderr is a pipe to it), else a terminal that takes colour (no NO_COLOR,
    TERM not dumb)."""
    forced = os.environ.get(COLOR_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    no_color = "NO_COLOR" in os.environ or os.environ.get("TERM") == "dumb"
    return _is_terminal(stream or sys.stderr) and not no_color


def _is_terminal(stream: IO | None) -> bool:
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def configure_logging(service: str, name: str, level: str = "INFO", fmt: str | None = None) -> None:
    """Route structlog and stdlib logging to stderr lines; call once at process start."""
    try:
        threshold = _LEVELS[level.upper()]
    except KeyError:
        raise ValueError(f"log level: must be one of {', '.join(_LEVELS)}, got {level!r}") from None
    fmt = log_format(fmt)

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
    if fmt == "json":
        render = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        render = [structlog.dev.ConsoleRenderer(colors=log_colors(), sort_keys=False)]
    sink = LineSink(getattr(sys.stderr, "buffer", None) or sys.stderr)
    structlog.configure(
        processors=[*shared, *render],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=lambda *_: _SinkLogger(sink),
        cache_logger_on_first_use=False,
    )

    handler = _SinkHandler(sink)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(threshold)
