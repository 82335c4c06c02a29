"""Bearer tokens bound to one tenant: minting, hashing, checking, and the
rule that auth may only be off on a loopback address."""

from __future__ import annotations

import hashlib
import ipaddress
import re
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..stores.base import Tokens

if TYPE_CHECKING:
    # ``errors`` imports FastAPI: ``agentdispatch token create`` mints without it.
    from .errors import ApiError
    from .services import Services

_TOKEN = re.compile(r"^adt_[0-9a-f]{12}_[A-Za-z0-9_-]{20,100}$")
_TENANT = re.compile(r"^[A-Za-z0-9_.:@/+=-]{1,200}$")


class Caller:
    """Who is asking: a tenant, or ``None`` for the local operator (auth off).

    The token is looked up on first use of :attr:`tenant`, in the route's own
    worker thread: one thread-pool hop per request instead of two.
    """

    __slots__ = ("_lookup", "_tenant")

    def __init__(self, tenant: str | None = None, lookup: Callable[[], str | None] | None = None) -> None:
        self._tenant = tenant
        self._lookup = lookup

    @property
    def tenant(self) -> str | None:
        """The tenant every read and write of this request is scoped to."""
        if self._lookup is not None:
            self._tenant, self._lookup = self._lookup(), None
        return self._tenant

    def submit_tenant(self, requested: object) -> str:
        """The tenant a submission runs as: the token's, never another."""
        if self.tenant is None:
            return requested if isinstance(requested, str) and requested else "default"
        if requested not in (None, "", self.tenant):
            from .errors import ApiError

            raise ApiError(403, "tenant_forbidden", "this token may only submit for its own tenant")
        return self.tenant


def hash_token(token: str) -> str:
    """What the store keeps: tokens are 256-bit random, so one SHA-256 suffices."""
    return hashlib.sha256(token.encode()).hexdigest()


def mint(store: Tokens, tenant: str, label: str = "") -> tuple[str, str]:
    """Create a token for ``tenant``; returns ``(token_id, token)``. The token
    itself is shown once and never stored."""
    if not _TENANT.match(tenant):
        raise ValueError("tenant must be 1-200 characters of letters, digits and _.:@/+=-")
    token_id = secrets.token_hex(6)
    token = f"adt_{token_id}_{secrets.token_urlsafe(32)}"
    store.token_create(token_id, hash_token(token), tenant, label[:200])
    return token_id, token


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, auth: bool) -> None:
    """Refuse to serve without authentication anywhere but loopback."""
    if not auth and not is_loopback(host):
        raise ValueError(
            f"refusing to listen on {host} with authentication off; use --host 127.0.0.1 or drop --no-auth"
        )


def _unauthorized(message: str) -> ApiError:
    from .errors import ApiError

    return ApiError(401, "unauthorized", message, {"WWW-Authenticate": 'Bearer realm="agentdispatch"'})


def authenticate(services: Services, header: str | None) -> Caller:
    """Resolve an ``Authorization`` header to a :class:`Caller` or raise 401."""
    if not header:
        if services.auth:
            raise _unauthorized("a bearer token is required (agentdispatch token create --tenant T)")
        return Caller(tenant=None)
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not _TOKEN.match(token):
        raise _unauthorized("malformed Authorization header; expected 'Bearer adt_...'")
    digest = hash_token(token)

    def lookup() -> str:
        tenant = services.store.token_lookup(digest)
        if tenant is None:
            raise _unauthorized("unknown or revoked token")
        return tenant

    return Caller(lookup=lookup)
