"""The HTTP gateway: jobs API, fleet topology, metrics, dashboard.

Build it with ``create_app(Services.open(settings))`` and serve it with any
ASGI server (``agentdispatch gateway`` runs uvicorn).
"""

from .app import create_app
from .services import Services

__all__ = ["Services", "create_app"]
