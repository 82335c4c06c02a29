"""The HTTP gateway: jobs API, fleet topology, metrics, dashboard.

Build it with ``create_app(Services.open(settings))`` and serve it with any
ASGI server (``agentdispatch gateway`` runs uvicorn).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .services import Services

__all__ = ["Services", "create_app"]

# Imported on first use: CLI commands that only need a submodule (tokens,
# intake installations) then start without loading FastAPI.
_LAZY = {"create_app": ".app", "Services": ".services"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
