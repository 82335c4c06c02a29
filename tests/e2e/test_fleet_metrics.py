"""One truth in metrics: a real gateway and a real worker process on one
store, three tenants, and their scrapes compared; promtool checks the
exposition and the shipped scrape config, and every series the Grafana
dashboard queries exists in a real scrape."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ports import free_port

from .gatewayproc import Gateway, cli_env, start_gateway

ROOT = Path(__file__).resolve().parents[2]
METRICS_TOKEN = "m" * 40
PROMTOOL = shutil.which("promtool")
TENANTS = ("acme", "globex", "initech")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def names(text: str) -> set[str]:
    """Series names of an exposition; a labelled family with no child yet
    (no error of that class so far) counts by its declared type."""
    out = {name for name, _ in samples(text)}
    for family in text_string_to_metric_families(text):
        out.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, int, subprocess.Popen[str]]]:
    data = tmp_path_factory.mktemp("fleet")
    env = {"AGENT_DISPATCH_METRICS_TOKEN": METRICS_TOKEN, "AGENT_DISPATCH_MAX_ATTEMPTS": "1"}
    gw = start_gateway(data, **env)
    port = free_port()
    worker_env = cli_env(data, **env, PYTHONPATH=f"{ROOT / 'tests'}:{ROOT / 'src'}")
    log = (data / "worker.log").open("w")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentdispatch",
            "worker",
            "--app",
            "apps.ops_app:registry",
            "--metrics-port",
            f"{port}",
        ],
        env=worker_env,
        stdout=log,
        stderr=log,
        text=True,
    )
    log.close()
    try:
        # Each tenant: two turns that succeed; acme and globex one that is dead-lettered.
        for tenant in TENANTS:
            with gw.client(tenant) as c:
                ids = [c.post("/v1/jobs", json={"kind": "ok"}).json()["job_id"] for _ in range(2)]
                if tenant != "initech":
                    ids.append(c.post("/v1/jobs", json={"kind": "boom"}).json()["job_id"])
                for job_id in ids:
                    status = c.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()["status"]
                    assert status in ("succeeded", "dead_letter"), (job_id, status, (data / "worker.log").read_text())
        yield gw, port, worker
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        gw.stop()


def scrape_gateway(gw: Gateway, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{gw.url}/metrics", headers=headers, timeout=10)


def scrape_worker(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


FLEET = (
    "agent_utilities_dispatch_workers",
    "agent_utilities_dispatch_worker_capacity",
    "agent_utilities_dispatch_tenant_depth",
    "agent_utilities_dispatch_turns_in_flight",
    "agent_utilities_dispatch_dead_letter",
    "agent_utilities_dispatch_store_up",
    "agent_utilities_dispatch_transport_up",
    "agent_utilities_dispatch_queue_depth",
)


def test_gateway_and_worker_agree_on_the_fleet(fleet: tuple[Gateway, int, subprocess.Popen[str]]) -> None:
    gw, port, _ = fleet
    gateway = samples(scrape_gateway(gw, METRICS_TOKEN).text)
    worker = samples(scrape_worker(port))
    shared = {k: v for k, v in gateway.items() if k[0] in FLEET}
    assert shared == {k: v for k, v in worker.items() if k[0] in FLEET}
    assert gateway[("agent_utilities_dispatch_workers", ())] == 1
    assert gateway[("agent_utilities_dispatch_store_up", ())] == 1
    assert gateway[("agent_utilities_dispatch_transport_up", ())] == 1
    for tenant in ("acme", "globex"):
        assert gateway[("agent_utilities_dispatch_dead_letter", (("tenant", tenant),))] == 1
        assert gateway[("agent_utilities_dispatch_dead_letter_oldest_age_seconds", (("tenant", tenant),))] >= 0
    # initech has nothing open and nothing dead: an operator scrape lists no series for it.
    assert ("agent_utilities_dispatch_dead_letter", (("tenant", "initech"),)) not in gateway


def test_turn_counters_come_from_the_worker_that_ran_them(fleet: tuple[Gateway, int, subprocess.Popen[str]]) -> None:
    gw, port, _ = fleet
    worker = samples(scrape_worker(port))
    assert worker[("agent_utilities_dispatch_turns_total", (("outcome", "completed"),))] == 6
    assert worker[("agent_utilities_dispatch_turns_total", (("outcome", "dead_letter"),))] == 2
    assert worker[("agent_utilities_dispatch_runs_total", (("kind", "ok"), ("result", "ok")))] == 6
    assert worker[("agent_utilities_dispatch_runs_total", (("kind", "boom"), ("result", "error")))] == 2
    assert worker[("agent_utilities_dispatch_run_duration_seconds_count", (("kind", "ok"),))] == 6
    assert worker[("agent_utilities_dispatch_time_in_queue_seconds_count", ())] == 8
    # The worker's own series carry no scope; the gateway serves the fleet's
    # sums (here this one worker's counts) only with scope="fleet", so a
    # query picks one kind and never adds both (test_fleet_counters).
    assert not [k for k in worker if dict(k[1]).get("scope")]
    fleet = (("scope", "fleet"),)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the worker publishes within a second or so
        gateway = samples(scrape_gateway(gw, METRICS_TOKEN).text)
        if gateway[("agent_utilities_dispatch_time_in_queue_seconds_count", fleet)] == 8:
            break
        time.sleep(0.2)
    assert gateway[("agent_utilities_dispatch_turns_total", (("outcome", "completed"), *fleet))] == 6
    assert gateway[("agent_utilities_dispatch_turns_total", (("outcome", "dead_letter"), *fleet))] == 2
    assert gateway[("agent_utilities_dispatch_time_in_queue_seconds_count", fleet)] == 8
    assert not [k for k in gateway if k[0] == "agent_utilities_dispatch_turns_total" and ("scope", "fleet") not in k[1]]
    # Handler runs by kind stay the workers' own.
    assert "agent_utilities_dispatch_runs_total" not in names(scrape_gateway(gw, METRICS_TOKEN).text)


def test_a_tenant_token_sees_its_tenant_and_the_operator_every_tenant(
    fleet: tuple[Gateway, int, subprocess.Popen[str]],
) -> None:
    gw, _, _ = fleet
    assert scrape_gateway(gw, None).status_code == 401
    assert scrape_gateway(gw, "x" * 40).status_code == 401  # neither the metrics token nor a tenant's
    mine = samples(scrape_gateway(gw, gw.token("globex")).text)
    seen = {dict(k[1]).get("tenant") for k in mine if k[0] == "agent_utilities_dispatch_dead_letter"}
    assert seen == {"globex"}
    every = samples(scrape_gateway(gw, METRICS_TOKEN).text)
    seen = {dict(k[1]).get("tenant") for k in every if k[0] == "agent_utilities_dispatch_dead_letter"}
    assert seen == {"acme", "globex"}
    # A tenant with nothing open still gets its own zeros.
    initech = samples(scrape_gateway(gw, gw.token("initech")).text)
    assert initech[("agent_utilities_dispatch_dead_letter", (("tenant", "initech"),))] == 0


def test_promtool_accepts_both_scrapes_and_the_scrape_example(
    fleet: tuple[Gateway, int, subprocess.Popen[str]], tmp_path: Path
) -> None:
    gw, port, _ = fleet
    assert PROMTOOL is not None, "install promtool: apt-get install prometheus"
    for text in (scrape_gateway(gw, METRICS_TOKEN).text, scrape_worker(port)):
        out = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    config = tmp_path / "prometheus.yml"
    shutil.copy(ROOT / "deploy" / "prometheus" / "prometheus.yml", config)
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "agentdispatch-metrics-token").write_text(METRICS_TOKEN)
    out = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_dashboard_query_names_a_series_that_exists(fleet: tuple[Gateway, int, subprocess.Popen[str]]) -> None:
    gw, port, _ = fleet
    existing = names(scrape_gateway(gw, METRICS_TOKEN).text) | names(scrape_worker(port))
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "agentdispatch-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"agent_utilities_dispatch_[a-z_]+", e)}
    assert len(used) >= 15
    assert used <= existing, used - existing
    # A series both kinds of target serve (the gateway's with scope="fleet")
    # is queried with a scope, so that no panel adds a worker's to the fleet's.
    scraped = samples(scrape_gateway(gw, METRICS_TOKEN).text)
    fleet = {name for name, labels in scraped if ("scope", "fleet") in labels}
    assert {"agent_utilities_dispatch_turns_total", "agent_utilities_dispatch_attempts_bucket"} <= fleet
    for e in exprs:
        if set(re.findall(r"agent_utilities_dispatch_[a-z_]+", e)) & fleet:
            assert 'scope="fleet"' in e or 'scope!="fleet"' in e, e
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
