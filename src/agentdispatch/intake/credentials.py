"""Connector credentials at rest: sealed with AES-GCM under
``AGENT_DISPATCH_INTAKE_KEY``, or a ``file:`` reference read when needed."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

SEALED = "enc:v1:"
FILE_REF = "file:"


class CredentialError(ValueError):
    """Credentials cannot be sealed or opened (the message names no secret)."""


def _key(master: str | None) -> bytes:
    if not master:
        raise CredentialError("set AGENT_DISPATCH_INTAKE_KEY (64 hex characters) or pass a file: reference")
    try:
        key = bytes.fromhex(master)
    except ValueError:
        raise CredentialError("AGENT_DISPATCH_INTAKE_KEY must be 64 hex characters") from None
    if len(key) != 32:
        raise CredentialError("AGENT_DISPATCH_INTAKE_KEY must be 64 hex characters")
    return key


def seal(master: str | None, installation_id: str, secrets: dict[str, str]) -> str:
    """Encrypt ``secrets``, bound to the installation id (AES-256-GCM)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(12)
    blob = AESGCM(_key(master)).encrypt(nonce, json.dumps(secrets).encode(), installation_id.encode())
    return SEALED + base64.b64encode(nonce + blob).decode()


def open_credentials(master: str | None, installation_id: str, stored: str) -> dict[str, Any]:
    """The plaintext credentials of one installation."""
    if stored.startswith(FILE_REF):
        try:
            data = json.loads(Path(stored[len(FILE_REF) :]).read_text())
        except (OSError, ValueError):
            raise CredentialError("the credential reference cannot be read") from None
        if not isinstance(data, dict):
            raise CredentialError("the credential reference is not a JSON object")
        return data
    if not stored.startswith(SEALED):
        raise CredentialError("unknown credential format")
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    raw = base64.b64decode(stored[len(SEALED) :])
    try:
        plain = AESGCM(_key(master)).decrypt(raw[:12], raw[12:], installation_id.encode())
    except InvalidTag:
        raise CredentialError("credentials do not open with AGENT_DISPATCH_INTAKE_KEY") from None
    data = json.loads(plain)
    assert isinstance(data, dict)
    return data
