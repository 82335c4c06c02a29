"""One typed Settings object: the only reader of ``os.environ``."""

from __future__ import annotations

import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigError
from .policy import LEASE_RTO_S


class Backend(StrEnum):
    """Where envelopes travel."""

    SQLITE = "sqlite"
    POSTGRES = "postgres"
    KAFKA = "kafka"


class LogFormat(StrEnum):
    """How log lines are written."""

    TEXT = "text"
    JSON = "json"


#: Fixed names (SPEC section 5).
KAFKA_TOPIC = "agent_turns"
KAFKA_GROUP = "agent-dispatch"
SQLITE_FILE = "agent_dispatch_queue.db"


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agentdispatch"


WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def check_worker_name(name: str) -> str:
    """``name`` if it can name a worker, else :class:`ValueError` saying why."""
    if not WORKER_NAME.fullmatch(name):
        raise ValueError(
            f"worker name {name!r} must be 1-63 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return name


class Settings(BaseSettings):
    """Every knob of agentdispatch, read from the environment and validated."""

    model_config = SettingsConfigDict(env_prefix="", case_sensitive=False, extra="ignore", populate_by_name=True)

    task_queue_backend: Backend | None = Field(default=None, alias="TASK_QUEUE_BACKEND")
    state_db_uri: str | None = Field(default=None, alias="STATE_DB_URI")
    #: Server-side prepared statements (off behind a pooler in transaction mode
    #: that drops them, PgBouncer before 1.21; the first loss turns them off).
    pg_prepared_statements: bool = Field(default=True, alias="AGENT_DISPATCH_PG_PREPARED_STATEMENTS")
    #: Seconds a PostgreSQL transaction waits for the server's answers before
    #: its connection is cut and the call fails (a paused or stuck server keeps
    #: a live link, which no TCP timeout ends); 0 waits for good.
    pg_answer_timeout_s: float = Field(default=30.0, ge=0, alias="AGENT_DISPATCH_PG_ANSWER_TIMEOUT_S")
    data_dir: Path = Field(default_factory=_default_data_dir, alias="AGENT_DISPATCH_DATA_DIR")
    kafka_bootstrap_servers: str | None = Field(default=None, alias="KAFKA_BOOTSTRAP_SERVERS")
    agent_turns_partitions: int = Field(default=6, ge=1, alias="AGENT_TURNS_PARTITIONS")
    max_depth: int = Field(default=100_000, ge=1, alias="AGENT_DISPATCH_MAX_DEPTH")
    claim_ttl_s: float = Field(default=120.0, gt=0, alias="AGENT_DISPATCH_CLAIM_TTL_S")
    renew_interval_s: float = Field(default=30.0, gt=0, alias="AGENT_DISPATCH_RENEW_INTERVAL_S")
    max_attempts: int = Field(default=5, ge=1, alias="AGENT_DISPATCH_MAX_ATTEMPTS")
    #: A worker's stable name (a pod name): a worker started under a name ends
    #: at once the leases of the name's earlier incarnations.
    worker_name: str | None = Field(default=None, alias="AGENT_DISPATCH_WORKER_NAME")
    app: str | None = Field(default=None, alias="AGENT_DISPATCH_APP")
    mesh_max_turns_per_agent: int = Field(default=4, ge=1, alias="MESH_MAX_TURNS_PER_AGENT")
    mesh_max_turns: int = Field(default=16, ge=1, alias="MESH_MAX_TURNS")
    #: Durable intake: the key sealing connector credentials (64 hex characters).
    intake_key: SecretStr | None = Field(default=None, alias="AGENT_DISPATCH_INTAKE_KEY")
    #: Durable intake: a receipt commit slower than this answers 503 (providers retry).
    intake_commit_timeout_s: float = Field(default=2.0, gt=0, le=60, alias="AGENT_DISPATCH_INTAKE_COMMIT_TIMEOUT_S")
    #: Gateway read deadline: a request head or webhook body not fully received within
    #: this cuts the sender off (the head by closing the connection, a body with 408).
    intake_body_timeout_s: float = Field(default=10.0, gt=0, le=120, alias="AGENT_DISPATCH_INTAKE_BODY_TIMEOUT_S")
    #: Durable intake: how often the gateway scrubs expired terminal bodies.
    intake_scrub_every_s: float = Field(default=3600.0, gt=0, le=86400, alias="AGENT_DISPATCH_INTAKE_SCRUB_EVERY_S")
    #: Durable intake: a trigger older than this since durable receipt is retired as stale.
    intake_stale_s: float = Field(default=300.0, gt=0, le=86400, alias="AGENT_DISPATCH_INTAKE_STALE_S")
    #: Durable intake: terminal envelope bodies older than this are scrubbed (7 days).
    intake_scrub_age_s: float = Field(
        default=7 * 86400.0, gt=0, le=366 * 86400, alias="AGENT_DISPATCH_INTAKE_SCRUB_AGE_S"
    )

    #: A bearer credential for ``GET /metrics`` that sees every tenant (an
    #: operator's Prometheus); at least 32 characters.
    metrics_token: SecretStr | None = Field(default=None, alias="AGENT_DISPATCH_METRICS_TOKEN")
    #: Workers warn when a PostgreSQL transaction has been open this long
    #: (it keeps vacuum from cleaning the queue); 0 turns the warning off.
    pg_xmin_alert_s: float = Field(default=120.0, ge=0, alias="AGENT_DISPATCH_PG_XMIN_ALERT_S")
    #: ``text`` (the default) or ``json``: one JSON object per log line.
    log_format: LogFormat = Field(default=LogFormat.TEXT, alias="AGENT_DISPATCH_LOG_FORMAT")

    @field_validator("worker_name", mode="before")
    @classmethod
    def _worker_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip() or None
            if value is not None:
                check_worker_name(value)
        return value

    @field_validator("intake_key", mode="before")
    @classmethod
    def _intake_key(cls, value: Any) -> Any:
        # Checked at start, not at the first webhook: a short key seals nothing.
        if isinstance(value, str):
            value = value.strip() or None
            if value is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", value):
                raise ValueError(
                    f"AGENT_DISPATCH_INTAKE_KEY must be 64 hex characters (got {len(value)} characters); "
                    "make one with: python -c 'import secrets; print(secrets.token_hex(32))'"
                )
        return value

    @field_validator("metrics_token", mode="before")
    @classmethod
    def _metrics_token(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip() or None
            if value is not None and len(value) < 32:
                raise ValueError(
                    f"AGENT_DISPATCH_METRICS_TOKEN must be at least 32 characters (got {len(value)}); "
                    "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
                )
        return value

    @field_validator("log_format", mode="before")
    @classmethod
    def _lower_format(cls, value: Any) -> Any:
        return value.strip().lower() or LogFormat.TEXT if isinstance(value, str) else value

    @field_validator("task_queue_backend", mode="before")
    @classmethod
    def _lower_backend(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip().lower()
            return value or None
        return value

    @field_validator("state_db_uri", mode="before")
    @classmethod
    def _postgres_uri(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip() or None
            if value is not None and not value.startswith(("postgresql://", "postgres://")):
                scheme = value.split("://", 1)[0] + "://" if "://" in value else "no scheme"
                raise ValueError(f"STATE_DB_URI must be a postgresql:// URI (got {scheme})")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        if self.claim_ttl_s > LEASE_RTO_S:
            raise ValueError(
                f"AGENT_DISPATCH_CLAIM_TTL_S={self.claim_ttl_s:g} is above the "
                f"{LEASE_RTO_S:g} s recovery-time objective"
            )
        if self.renew_interval_s >= self.claim_ttl_s:
            raise ValueError(
                f"AGENT_DISPATCH_RENEW_INTERVAL_S={self.renew_interval_s:g} must be below "
                f"AGENT_DISPATCH_CLAIM_TTL_S={self.claim_ttl_s:g}"
            )
        if self.backend is Backend.KAFKA and not self.kafka_bootstrap_servers:
            raise ValueError("KAFKA_BOOTSTRAP_SERVERS is required with TASK_QUEUE_BACKEND=kafka")
        if self.backend is Backend.POSTGRES and not self.state_db_uri:
            raise ValueError("STATE_DB_URI is required with TASK_QUEUE_BACKEND=postgres")
        return self

    @property
    def backend(self) -> Backend:
        """The transport: explicit, or postgres when STATE_DB_URI is set, else sqlite."""
        if self.task_queue_backend is not None:
            return self.task_queue_backend
        return Backend.POSTGRES if self.state_db_uri else Backend.SQLITE

    @property
    def sqlite_path(self) -> Path:
        """The one SQLite file of the embedded default."""
        return self.data_dir / SQLITE_FILE


_FIELD_TO_ENV = {name: (f.alias or name.upper()) for name, f in Settings.model_fields.items()}


def load_settings(**overrides: Any) -> Settings:
    """Read and validate the environment; a bad value raises :class:`ConfigError`
    naming the variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        var = _FIELD_TO_ENV.get(loc[0], loc[0].upper()) if loc else None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if var and var not in msg:
            msg = f"{var}: {msg}"
        raise ConfigError(msg) from None
