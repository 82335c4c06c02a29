"""Log set-up for the worker and gateway processes, and the turn context
stamped on every record logged while a turn runs.

``AGENT_DISPATCH_LOG_FORMAT=json`` writes one JSON object per line
(python-json-logger) with ``job_id``, ``session_id``, ``tenant``, ``attempt``
and ``epoch`` where a turn is in context; ``text`` (the default) keeps the
plain lines.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Any

#: The turn fields a record carries while its turn is the context's.
FIELDS = ("job_id", "session_id", "tenant", "attempt", "epoch")
_TURN: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("agentdispatch_turn", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
JSON_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


@contextlib.contextmanager
def turn_context(**fields: Any) -> Iterator[None]:
    """Stamp ``fields`` (job_id, session_id, ...) on records logged inside."""
    token = _TURN.set({k: v for k, v in fields.items() if v is not None})
    try:
        yield
    finally:
        _TURN.reset(token)


class TurnFields(logging.Filter):
    """Copies the current turn's fields onto each record (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's terminal-colour copy of the message has no place in a log line.
        record.__dict__.pop("color_message", None)
        for k, v in (_TURN.get() or {}).items():
            if not hasattr(record, k):
                setattr(record, k, v)
        return True


def logging_config(fmt: str, level: str = "INFO") -> dict[str, Any]:
    """A :func:`logging.config.dictConfig` document for ``fmt`` (``text`` or
    ``json``); uvicorn takes the same document as its ``log_config``."""
    if fmt == "json":
        formatter: dict[str, Any] = {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": JSON_FORMAT,
            "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
            "datefmt": "%Y-%m-%dT%H:%M:%S%z",
            "timestamp": False,
        }
    else:
        formatter = {"format": TEXT_FORMAT, "datefmt": "%Y-%m-%dT%H:%M:%S%z"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"turn": {"()": TurnFields}},
        "formatters": {"main": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "main",
                "filters": ["turn"],
            }
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        # uvicorn's loggers propagate to the root handler: one format for all.
        "loggers": {name: {"handlers": [], "propagate": True} for name in ("uvicorn", "uvicorn.error")},
    }


def configure(fmt: str, level: str = "INFO") -> None:
    """Install :func:`logging_config` for this process."""
    import logging.config

    logging.config.dictConfig(logging_config(fmt, level))
