"""``agentdispatch gateway --port 0`` binds a port the system picks and prints
that port, so a caller (and this suite's harness) never races another
process for a port named in advance."""

from __future__ import annotations

from pathlib import Path

from e2e import gatewayproc


def test_port_zero_prints_the_port_it_bound(tmp_path: Path) -> None:
    gw = gatewayproc.start_gateway(tmp_path / "data")
    try:
        assert gw.port != 0 and gw.proc.poll() is None
        assert f"http://127.0.0.1:{gw.port}/" in gw.log()
        assert gatewayproc.listens(gw.proc.pid, gw.port)
        with gw.client() as c:
            assert c.get("/openapi.json").json()["info"]["title"] == "agentdispatch gateway"
    finally:
        gw.stop()
