"""Settings: the one typed reader of the environment (SPEC section 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentdispatch.errors import ConfigError
from agentdispatch.settings import KAFKA_GROUP, KAFKA_TOPIC, SQLITE_FILE, Backend, Settings, load_settings

VARS = [
    "TASK_QUEUE_BACKEND",
    "STATE_DB_URI",
    "AGENT_DISPATCH_DATA_DIR",
    "KAFKA_BOOTSTRAP_SERVERS",
    "AGENT_TURNS_PARTITIONS",
    "AGENT_DISPATCH_MAX_DEPTH",
    "AGENT_DISPATCH_CLAIM_TTL_S",
    "AGENT_DISPATCH_RENEW_INTERVAL_S",
    "AGENT_DISPATCH_MAX_ATTEMPTS",
    "AGENT_DISPATCH_APP",
    "MESH_MAX_TURNS_PER_AGENT",
    "MESH_MAX_TURNS",
    "XDG_DATA_HOME",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.lower(), raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_defaults(tmp_path: Path) -> None:
    s = load_settings()
    assert s.backend is Backend.SQLITE
    assert s.task_queue_backend is None
    assert s.state_db_uri is None
    assert (s.max_depth, s.claim_ttl_s, s.renew_interval_s, s.max_attempts) == (100_000, 120.0, 30.0, 5)
    assert (s.agent_turns_partitions, s.mesh_max_turns_per_agent, s.mesh_max_turns) == (6, 4, 16)
    assert s.data_dir == tmp_path / "home" / ".local" / "share" / "agentdispatch"
    assert s.sqlite_path == s.data_dir / "agent_dispatch_queue.db"
    assert (KAFKA_TOPIC, KAFKA_GROUP, SQLITE_FILE) == ("agent_turns", "agent-dispatch", "agent_dispatch_queue.db")


def test_xdg_data_home_and_explicit_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert load_settings().data_dir == tmp_path / "xdg" / "agentdispatch"
    monkeypatch.setenv("AGENT_DISPATCH_DATA_DIR", str(tmp_path / "explicit"))
    assert load_settings().sqlite_path == tmp_path / "explicit" / SQLITE_FILE


def test_values_are_read_and_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_DISPATCH_MAX_DEPTH", "7")
    monkeypatch.setenv("AGENT_DISPATCH_CLAIM_TTL_S", "300")
    monkeypatch.setenv("AGENT_DISPATCH_RENEW_INTERVAL_S", "0.5")
    monkeypatch.setenv("AGENT_DISPATCH_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AGENT_DISPATCH_APP", "mymod:registry")
    s = load_settings()
    assert (s.max_depth, s.claim_ttl_s, s.renew_interval_s, s.max_attempts) == (7, 300.0, 0.5, 1)
    assert s.app == "mymod:registry"
    assert isinstance(s, Settings)


@pytest.mark.parametrize("raw", ["sqlite", "SQLite", "SQLITE", "  sqlite  "])
def test_backend_is_case_insensitive(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("TASK_QUEUE_BACKEND", raw)
    assert load_settings().backend is Backend.SQLITE


@pytest.mark.parametrize("raw", ["Postgres", "POSTGRES"])
def test_postgres_backend_case_insensitive(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("TASK_QUEUE_BACKEND", raw)
    monkeypatch.setenv("STATE_DB_URI", "postgresql://u:p@localhost/db")
    assert load_settings().backend is Backend.POSTGRES


def test_kafka_backend_with_bootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASK_QUEUE_BACKEND", "Kafka")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "localhost:9092")
    assert load_settings().backend is Backend.KAFKA


def test_auto_backend_follows_state_db_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().backend is Backend.SQLITE
    monkeypatch.setenv("STATE_DB_URI", "postgresql://localhost/db")
    assert load_settings().backend is Backend.POSTGRES
    monkeypatch.setenv("TASK_QUEUE_BACKEND", "")  # empty is unset: still auto
    assert load_settings().backend is Backend.POSTGRES


def test_unknown_backend_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASK_QUEUE_BACKEND", "redis")
    with pytest.raises(ConfigError, match="TASK_QUEUE_BACKEND"):
        load_settings()


def test_kafka_needs_bootstrap_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASK_QUEUE_BACKEND", "kafka")
    with pytest.raises(ConfigError, match="KAFKA_BOOTSTRAP_SERVERS"):
        load_settings()


def test_explicit_postgres_needs_state_db_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASK_QUEUE_BACKEND", "postgres")
    with pytest.raises(ConfigError, match="STATE_DB_URI"):
        load_settings()


@pytest.mark.parametrize("ttl", ["300.5", "301", "400", "3600", "inf"])
def test_ttl_above_the_300s_objective_is_an_error(monkeypatch: pytest.MonkeyPatch, ttl: str) -> None:
    monkeypatch.setenv("AGENT_DISPATCH_CLAIM_TTL_S", ttl)
    with pytest.raises(ConfigError, match=r"AGENT_DISPATCH_CLAIM_TTL_S.*300"):
        load_settings()


@pytest.mark.parametrize(("ttl", "renew"), [("120", "120"), ("120", "121"), ("10", "30"), ("1", "1")])
def test_renew_interval_must_be_below_ttl(monkeypatch: pytest.MonkeyPatch, ttl: str, renew: str) -> None:
    monkeypatch.setenv("AGENT_DISPATCH_CLAIM_TTL_S", ttl)
    monkeypatch.setenv("AGENT_DISPATCH_RENEW_INTERVAL_S", renew)
    with pytest.raises(ConfigError, match="AGENT_DISPATCH_RENEW_INTERVAL_S"):
        load_settings()


def test_renew_just_below_ttl_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_DISPATCH_CLAIM_TTL_S", "10")
    monkeypatch.setenv("AGENT_DISPATCH_RENEW_INTERVAL_S", "9.99")
    assert load_settings().renew_interval_s == pytest.approx(9.99)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("AGENT_DISPATCH_MAX_DEPTH", "-1"),
        ("AGENT_DISPATCH_MAX_DEPTH", "0"),
        ("AGENT_DISPATCH_MAX_DEPTH", "lots"),
        ("AGENT_DISPATCH_MAX_DEPTH", "1.5"),
        ("AGENT_DISPATCH_CLAIM_TTL_S", "-5"),
        ("AGENT_DISPATCH_CLAIM_TTL_S", "0"),
        ("AGENT_DISPATCH_CLAIM_TTL_S", "two minutes"),
        ("AGENT_DISPATCH_CLAIM_TTL_S", "nan"),
        ("AGENT_DISPATCH_RENEW_INTERVAL_S", "-1"),
        ("AGENT_DISPATCH_RENEW_INTERVAL_S", "soon"),
        ("AGENT_DISPATCH_MAX_ATTEMPTS", "0"),
        ("AGENT_DISPATCH_MAX_ATTEMPTS", "five"),
        ("AGENT_TURNS_PARTITIONS", "0"),
        ("AGENT_TURNS_PARTITIONS", "six"),
        ("MESH_MAX_TURNS_PER_AGENT", "-4"),
        ("MESH_MAX_TURNS", "x"),
    ],
)
def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert var in str(info.value)
    assert "Traceback" not in str(info.value)
    assert "\n" not in str(info.value)


def test_lowercase_variable_names_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("agent_dispatch_max_depth", "9")
    assert load_settings().max_depth == 9


def test_overrides_are_validated_too() -> None:
    assert load_settings(AGENT_DISPATCH_MAX_DEPTH=3).max_depth == 3
    with pytest.raises(ConfigError, match="AGENT_DISPATCH_MAX_DEPTH"):
        load_settings(AGENT_DISPATCH_MAX_DEPTH=0)
