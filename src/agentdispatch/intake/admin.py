"""Installations, agents and routes: what ``agentdispatch intake`` manages."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from .base import IntakeStore
from .credentials import FILE_REF, seal

CONNECTORS = ("slack", "telegram", "twilio")
DEFAULT_API = {
    "slack": "https://slack.com/api",
    "telegram": "https://api.telegram.org",
    "twilio": "https://api.twilio.com",
}
#: Which credentials each connector needs.
NEEDS = {"slack": ("signing_secret", "bot_token"), "telegram": ("secret_token", "bot_token"), "twilio": ("auth_token",)}
#: What :func:`listing` lists.
LISTINGS: tuple[Literal["installations", "agents", "routes", "receipts"], ...] = (
    "installations",
    "agents",
    "routes",
    "receipts",
)
_SAFE = re.compile(r"^[A-Za-z0-9_.:+@-]{1,200}$")


def installation_id(connector: str, external_id: str) -> str:
    """The stable id of an installation."""
    return "inst-" + hashlib.sha256(f"{connector}\0{external_id}".encode()).hexdigest()[:16]


def install(
    istore: IntakeStore,
    *,
    connector: str,
    external_id: str,
    route_key: str,
    tenant: str,
    master_key: str | None,
    secrets: dict[str, str] | None = None,
    reference: str | None = None,
    bot_user_id: str = "",
    api_base: str = "",
    public_url: str = "",
) -> str:
    """Create or update an installation; credentials are sealed or a ``file:`` reference."""
    if connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {', '.join(CONNECTORS)}")
    for value in (external_id, route_key, tenant):
        if not _SAFE.match(value):
            raise ValueError("ids and tenant: 1-200 of A-Z a-z 0-9 _ . : + @ -")
    inst_id = installation_id(connector, external_id)
    if reference is not None:
        if not reference.startswith(FILE_REF):
            raise ValueError("a credential reference looks like file:/path/to/credentials.json")
        stored = reference
    else:
        missing = [k for k in NEEDS[connector] if not (secrets or {}).get(k)]
        if missing:
            raise ValueError(f"missing credentials: {', '.join(missing)}")
        stored = seal(master_key, inst_id, dict(secrets or {}))
    istore.install(
        {
            "id": inst_id,
            "connector": connector,
            "external_id": external_id,
            "route_key": route_key,
            "tenant": tenant,
            "credentials": stored,
            "bot_user_id": bot_user_id,
            "api_base": (api_base or DEFAULT_API[connector]).rstrip("/"),
            "public_url": public_url.rstrip("/"),
        }
    )
    return inst_id


def set_installation_status(istore: IntakeStore, inst_id: str, status: str) -> bool:
    """Stop or restart an installation; False when unknown."""
    return istore.set_installation_status(inst_id, status)


def set_agent(istore: IntakeStore, name: str, *, enabled: bool) -> None:
    """Create an agent or change whether it is enabled."""
    if not _SAFE.match(name):
        raise ValueError("agent names: 1-200 of A-Z a-z 0-9 _ . : + @ -")
    istore.set_agent(name, enabled=enabled)


def set_route(istore: IntakeStore, inst_id: str, channel: str, agent: str | None) -> None:
    """Route a channel (``*``: every channel) of an installation to an agent; None removes it."""
    istore.set_route(inst_id, channel, agent)


def listing(istore: IntakeStore, what: str) -> list[dict[str, Any]]:
    """``installations``, ``agents``, ``routes`` or ``receipts`` (states), content-free."""
    for known in LISTINGS:
        if what == known:
            return istore.listing(known)
    raise ValueError(f"what must be one of {', '.join(LISTINGS)}")


#: Messages a conversation read returns at most.
MAX_MESSAGES = 1000


def messages(
    istore: IntakeStore, inst_id: str, conversation: str, *, tenant: str | None, limit: int = 100
) -> list[dict[str, Any]] | None:
    """The newest ``limit`` captured messages of a conversation, oldest first
    (coalesced and steered ones included); None when the installation is
    unknown or belongs to another tenant (``tenant`` None: the operator)."""
    if not 1 <= limit <= MAX_MESSAGES:
        raise ValueError(f"limit must be 1-{MAX_MESSAGES}")
    inst = istore.installation(inst_id)
    if inst is None or (tenant is not None and inst["tenant"] != tenant):
        return None
    rows = istore.history(inst_id, conversation, limit)
    return [{"role": r["role"], "sender": r["sender"], "text": r["text"], "at": float(r["at"])} for r in reversed(rows)]
