"""Server logs: one handler on stderr for every ``tokenmill.*`` logger and uvicorn's, as text or
JSON lines.

``tokenmill serve --log-level info|debug|warning|error --log-format text|json`` sets them in
the API process and, through :data:`LEVEL_ENV` / :data:`FORMAT_ENV`, in the engine core
processes it starts (:func:`configure_from_env`). A JSON line carries ``time`` (UTC ISO 8601),
``level``, ``logger``, ``message``, ``pid`` and, when the record has them, the request's
``request_id``, ``trace_id``, ``tenant`` and the access log's ``method``, ``path``,
``status``, ``duration_ms``. The access log (``--access-log``) is the ``tokenmill.access``
logger: one INFO line per completion request once it is recorded.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sys

__all__ = [
    "FORMATS",
    "FORMAT_ENV",
    "LEVELS",
    "LEVEL_ENV",
    "JsonFormatter",
    "configure",
    "configure_from_env",
]

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
LEVEL_ENV = "TOKENMILL_LOG_LEVEL"
FORMAT_ENV = "TOKENMILL_LOG_FORMAT"

#: record attributes a JSON line carries when present (``logger.info(..., extra={...})``)
CONTEXT_FIELDS = ("request_id", "trace_id", "tenant", "method", "path", "status", "duration_ms")

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HANDLER_NAME = "tokenmill"


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring for its keys)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str = "info", fmt: str = "text", *, export: bool = True) -> None:
    """Install the handler on the ``tokenmill`` logger (replacing an earlier one) at ``level``.

    ``export``: also set :data:`LEVEL_ENV` / :data:`FORMAT_ENV` so engine core processes
    started from here log the same way.

    Raises:
        ValueError: an unknown level or format (one line).
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
    # uvicorn's own lines (an invalid HTTP request, a lifespan error) in the same format: the
    # server starts uvicorn without a logging config of its own (``log_config=None``)
    for name in ("tokenmill", "uvicorn"):
        logger = logging.getLogger(name)
        for h in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
            logger.removeHandler(h)
        logger.addHandler(handler)
        logger.propagate = False
    logging.getLogger("tokenmill").setLevel(level.upper())
    if export:
        os.environ[LEVEL_ENV], os.environ[FORMAT_ENV] = level, fmt


def configure_from_env() -> None:
    """In a process the server started (an engine core): the server's level and format, if it
    exported them; nothing otherwise."""
    level, fmt = os.environ.get(LEVEL_ENV), os.environ.get(FORMAT_ENV)
    if level in LEVELS and fmt in FORMATS:
        configure(level, fmt, export=False)
