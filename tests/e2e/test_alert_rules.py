"""The shipped alert rules (deploy/prometheus/alerts.yml) fire when they
should, on synthetic series run through ``promtool test rules``; every series
they use exists in a real scrape (test_fleet_metrics, test_postgres_horizon)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool")

# Scraped every 15 s by two targets (the gateway and a worker serve the same
# fleet gauges). A REPEATABLE READ session opens at 0 and stays open; the
# store of another fleet is unreachable from 1 min on.
CASES = """
rule_files: [{rules}]
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
      - series: agent_utilities_dispatch_oldest_xmin_age_seconds{{instance="gateway"}}
        values: 0+15x40
      - series: agent_utilities_dispatch_oldest_xmin_age_seconds{{instance="worker"}}
        values: 0+15x40
    alert_rule_test:
      - eval_time: 2m
        alertname: AgentDispatchLongTransaction
        exp_alerts: []
      - eval_time: 4m
        alertname: AgentDispatchLongTransaction
        exp_alerts:
          - exp_labels: {{severity: warning}}
            exp_annotations:
              summary: A PostgreSQL transaction has been open for 4m 0s
              description: >-
                Vacuum cannot clean the queue while it is open. Find it in pg_stat_activity
                (the oldest xact_start) and end it with pg_terminate_backend, or finish a
                forgotten prepared transaction (pg_prepared_xacts).
  - interval: 15s
    input_series:
      - series: agent_utilities_dispatch_store_up{{instance="gateway"}}
        values: 1x3 0x20
      - series: agent_utilities_dispatch_transport_up{{instance="gateway"}}
        values: 1x3 0x20
      - series: agent_utilities_dispatch_workers{{instance="gateway"}}
        values: 1x3 0x40
      - series: agent_utilities_dispatch_tenant_depth{{instance="gateway", tenant="acme"}}
        values: 5x40
      - series: agent_utilities_dispatch_dead_letter{{instance="gateway", tenant="acme"}}
        values: 0x10 2x30
    alert_rule_test:
      - eval_time: 2m
        alertname: AgentDispatchStoreDown
        exp_alerts: []
      - eval_time: 4m
        alertname: AgentDispatchStoreDown
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: The agentdispatch store cannot be read
              description: Submissions are refused and no turn is claimed until the database is back.
      - eval_time: 2m
        alertname: AgentDispatchTransportDown
        exp_alerts: []
      - eval_time: 4m
        alertname: AgentDispatchTransportDown
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: The agentdispatch transport does not answer
              description: >-
                On Kafka the broker is down: submissions are refused and no turn is
                delivered until it is back; accepted turns stay in the store.
      - eval_time: 4m
        alertname: AgentDispatchDeadLetters
        exp_alerts:
          - exp_labels: {{severity: warning, tenant: acme}}
            exp_annotations:
              summary: Turns of tenant acme went to the dead-letter queue
              description: "`agentdispatch dlq list` shows them with their reasons."
      - eval_time: 4m
        alertname: AgentDispatchNoWorkers
        exp_alerts: []
      - eval_time: 7m
        alertname: AgentDispatchNoWorkers
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: Turns are waiting and no worker is alive
"""


def test_the_alert_rules_fire_when_they_should(tmp_path: Path) -> None:
    assert PROMTOOL is not None, "install promtool: apt-get install prometheus"
    cases = tmp_path / "cases.yml"
    cases.write_text(CASES.format(rules=RULES))
    out = subprocess.run([PROMTOOL, "test", "rules", str(cases)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_is_tested_and_names_documented_series() -> None:
    text = RULES.read_text()
    alerts = set(re.findall(r"alert: (\w+)", text))
    assert len(alerts) == 5 and alerts == set(re.findall(r"alertname: (\w+)", CASES))
    documented = (ROOT / "docs" / "metrics.md").read_text()
    for series in set(re.findall(r"agent_utilities_dispatch_[a-z_]+", text)):
        assert f"`{series}`" in documented, series
