"""Schema-driven fuzzing from the gateway's own /openapi.json: no request
the schema allows (or slightly breaks) may answer 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from e2e.gatewayproc import Gateway, start_gateway


@pytest.fixture(scope="module")
def codes() -> list[int]:
    return []


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, codes: list[int]) -> Iterator[Gateway]:
    g = start_gateway(Path(tmp_path_factory.mktemp("gw-fuzz")) / "data")
    yield g
    g.stop()
    # The fuzzing must reach past authentication and validation, not bounce off them.
    assert any(200 <= c < 300 for c in codes) and 422 in codes and 404 in codes, sorted(set(codes))
    assert "Traceback" not in g.log(), g.log()


@pytest.fixture(scope="module")
def api_schema(gw: Gateway) -> Any:
    loaded = schemathesis.openapi.from_url(f"{gw.url}/openapi.json")
    # Valid and deliberately invalid requests: both must stay below 500.
    loaded.config.generation.update(modes=list(schemathesis.GenerationMode), database="none")
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_no_generated_request_is_a_server_error(case: Any, gw: Gateway, codes: list[int]) -> None:
    response = case.call(headers={"Authorization": f"Bearer {gw.token('fuzz')}"}, timeout=10)
    codes.append(response.status_code)
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])
    if response.status_code >= 400 and response.status_code != 404:
        body = response.json()
        assert body["status"] == "error" and isinstance(body["error"], str) and body["message"]
