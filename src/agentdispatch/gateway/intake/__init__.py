"""Durable intake: Slack, Telegram and Twilio webhooks recorded before the 200."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .janitor import Scrubber
    from .router import build_router

__all__ = ["Scrubber", "build_router"]

# Imported on first use: the ``intake`` CLI commands only need the store and
# admin modules, not the FastAPI router.
_LAZY = {"Scrubber": ".janitor", "build_router": ".router"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
