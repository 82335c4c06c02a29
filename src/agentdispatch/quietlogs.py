"""Keep client libraries' own log lines (which name hosts and ports) out of
user-facing output: they are demoted to DEBUG; our code reports the failure
itself, without endpoints or credentials."""

from __future__ import annotations

import logging


class _Demote(logging.Filter):
    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        record.levelno = logging.DEBUG
        record.levelname = "DEBUG"
        # Shown only to whoever turned DEBUG on for this logger.
        return self.logger.isEnabledFor(logging.DEBUG)


def demote(logger: logging.Logger) -> logging.Logger:
    """Demote every record of ``logger`` to DEBUG (idempotent); returns it."""
    if not any(isinstance(f, _Demote) for f in logger.filters):
        logger.addFilter(_Demote(logger))
    return logger
