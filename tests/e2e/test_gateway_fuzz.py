"""Schema-driven fuzzing from the gateway's own /openapi.json: no request
the schema allows (or slightly breaks) may answer 5xx.

Schemathesis builds the Hypothesis strategies and Hypothesis runs them inside
one plain test: the schemathesis pytest plugin rewrites pytest's private node
ids, which breaks with each pytest release.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentdispatch.waiting import MAX_WAIT_S
from e2e.gatewayproc import start_gateway

EXAMPLES_PER_OPERATION = 40


def test_no_generated_request_is_a_server_error(tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(Path(tmp_path_factory.mktemp("gw-fuzz")) / "data")
    try:
        schema = schemathesis.openapi.from_url(f"{gw.url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 5, [op.label for op in operations]
        headers = {"Authorization": f"Bearer {gw.token('fuzz')}"}
        codes: list[int] = []
        failures: list[tuple[str, str, int, str]] = []

        for operation in operations:
            # Valid and deliberately invalid requests: both must stay below 500.
            strategy = st.one_of(
                operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE),
                operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE),
            )

            @given(case=strategy)
            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            )
            def run(case: Any) -> None:
                # A long-poll (?wait=) may rightly hold the answer up to MAX_WAIT_S.
                response = case.call(headers=headers, timeout=MAX_WAIT_S + 10)
                codes.append(response.status_code)
                if response.status_code >= 500:
                    failures.append((case.method, case.formatted_path, response.status_code, response.text[:300]))
                elif response.status_code >= 400 and response.status_code != 404:
                    body = response.json()
                    assert body["status"] == "error" and isinstance(body["error"], str) and body["message"], body

            run()

        assert not failures, failures
        # The fuzzing must reach past authentication and validation, not bounce off them.
        assert any(200 <= c < 300 for c in codes) and 422 in codes and 404 in codes, sorted(set(codes))
        assert "Traceback" not in gw.log(), gw.log()
    finally:
        gw.stop()
