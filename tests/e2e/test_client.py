"""``agentdispatch.Client`` and ``AsyncClient`` against a real gateway
subprocess and a real worker subprocess."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from agentdispatch import AsyncClient, Client, IdempotencyConflict, InvalidInput, InvalidTransition, JobNotFound
from agentdispatch.client import Unauthorized
from agentdispatch.errors import TaskQueueUnavailable
from e2e.gatewayproc import Gateway, cli_env, start_gateway
from ports import free_port


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # One attempt per job, so a failing turn is dead-lettered at once (replay).
    g = start_gateway(tmp_path_factory.mktemp("client") / "data", AGENT_DISPATCH_MAX_ATTEMPTS="1")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def worker(gw: Gateway) -> Iterator[subprocess.Popen[str]]:
    with (gw.data_dir / "worker.log").open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentdispatch", "worker", "--workers", "2"],
            env=cli_env(gw.data_dir, AGENT_DISPATCH_MAX_ATTEMPTS="1"),
            stdout=fh,
            stderr=subprocess.STDOUT,
            text=True,
        )
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture()
def client(gw: Gateway) -> Iterator[Client]:
    with Client(gw.url, gw.token("acme")) as c:
        yield c


def test_submit_wait_status_jobs(client: Client, worker: subprocess.Popen[str]) -> None:
    handle = client.submit("echo", {"q": 1}, session_id="s-1", priority=3)
    assert handle.session_id == "s-1" and handle.kind == "echo"
    view = client.wait(handle.job_id, timeout_s=30)
    assert view["status"] == "succeeded" and view["result"] == {"q": 1}
    assert client.status(handle.job_id)["priority"] == 3
    listed = client.jobs(limit=500)["jobs"]
    assert handle.job_id in {j["job_id"] for j in listed}
    # A batch, all or nothing, and waiting on its last job.
    many = client.submit_many([{"kind": "echo", "payload": i} for i in range(3)])
    assert len({h.job_id for h in many}) == 3
    assert client.wait(many[-1].job_id, timeout_s=30)["result"] == 2


def test_gateway_errors_are_typed(client: Client, gw: Gateway) -> None:
    with pytest.raises(JobNotFound):
        client.status("dispatch-nope")
    with pytest.raises(InvalidInput):
        client.submit("echo", dependencies=["never-submitted"])
    h = client.submit("echo", 1, idempotency_key="typed-1")
    assert client.submit("echo", 1, idempotency_key="typed-1") == h
    with pytest.raises(IdempotencyConflict) as err:
        client.submit("echo", 2, idempotency_key="typed-1")
    assert err.value.job_id == h.job_id
    with pytest.raises(InvalidTransition):
        client.replay(h.job_id)  # not dead-lettered
    with Client(gw.url, "adt_000000000000_" + "x" * 30) as stranger, pytest.raises(Unauthorized):
        stranger.status(h.job_id)
    with Client(f"http://127.0.0.1:{free_port()}", retries=1) as nowhere, pytest.raises(TaskQueueUnavailable):
        nowhere.status(h.job_id)


def test_a_body_json_cannot_hold_is_invalid_input_and_sends_nothing(client: Client) -> None:
    before = len(client.jobs(limit=500)["jobs"])
    deep: list[object] = []
    cur = deep
    for _ in range(5000):
        cur.append([])
        cur = cur[0]  # type: ignore[assignment]
    for payload in (float("nan"), {1, 2}, deep):
        with pytest.raises(InvalidInput):
            client.submit("echo", payload)
        with pytest.raises(InvalidInput):
            client.submit_many([{"kind": "echo", "payload": payload}])
    assert len(client.jobs(limit=500)["jobs"]) == before


def test_cancel_and_replay(client: Client, worker: subprocess.Popen[str]) -> None:
    parent = client.submit("sleep", {"seconds": 30})
    child = client.submit("echo", dependencies=[parent.job_id])
    assert client.cancel(child.job_id, "not needed")["status"] == "cancelled"
    client.cancel(parent.job_id)
    broken = client.submit("sleep", {"seconds": "not a number"})
    assert client.wait(broken.job_id, timeout_s=30)["status"] == "dead_letter"
    replayed = client.replay(broken.job_id)
    assert replayed["job"]["status"] == "ready" and "side_effects" in replayed


def test_async_client(gw: Gateway, worker: subprocess.Popen[str]) -> None:
    async def main() -> None:
        async with AsyncClient(gw.url, gw.token("acme")) as c:
            handle = await c.submit("echo", {"a": 1})
            assert (await c.wait(handle.job_id, timeout_s=30))["result"] == {"a": 1}
            assert (await c.status(handle.job_id))["status"] == "succeeded"
            with pytest.raises(JobNotFound):
                await c.cancel("dispatch-nope")
            assert len(await c.submit_many([{"kind": "echo"}, {"kind": "echo"}])) == 2

    asyncio.run(main())


class LosingProxy:
    """A loopback TCP proxy that forwards each request to the gateway and, for
    the first ``lose`` connections, drops the answer: the request was served
    but the caller never hears back."""

    def __init__(self, upstream_port: int, lose: int) -> None:
        self.upstream = upstream_port
        self.lose = lose
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            drop = self.lose > 0
            self.lose -= 1
            threading.Thread(target=self._one, args=(conn, drop), daemon=True).start()

    def _one(self, conn: socket.socket, drop: bool) -> None:
        with conn, socket.create_connection(("127.0.0.1", self.upstream)) as up:
            # Generous: on a loaded machine a served request may take seconds,
            # and a timeout here would be one more lost answer than planned.
            conn.settimeout(60)
            up.settimeout(60)
            while True:
                # A whole request: the client may send its head and body in
                # separate segments, and the gateway answers only after both.
                try:
                    request = _read_message(conn)
                except OSError:
                    return
                if request is None:
                    return
                up.sendall(request)
                answer = _read_message(up)
                if answer is None:
                    return
                if drop:
                    return  # served upstream; the caller's connection just closes
                conn.sendall(answer)

    def close(self) -> None:
        self.sock.close()


def _read_message(sock: socket.socket) -> bytes | None:
    """One HTTP/1.1 message with a Content-Length body (None: the peer closed first)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_a_lost_answer_is_retried_with_the_same_key(gw: Gateway) -> None:
    proxy = LosingProxy(gw.port, lose=2)
    try:
        with Client(f"http://127.0.0.1:{proxy.port}", gw.token("retry-tenant"), retries=3, timeout_s=60) as c:
            handle = c.submit("echo", {"once": True})
        with Client(gw.url, gw.token("retry-tenant")) as direct:
            jobs = direct.jobs(limit=500)["jobs"]
    finally:
        proxy.close()
    # Three requests reached the gateway; one job exists.
    assert [j["job_id"] for j in jobs] == [handle.job_id]
