"""A real PgBouncer in transaction mode in front of the test PostgreSQL.

Started once per test session on a free loopback port (as the ``postgres``
user: PgBouncer refuses to run as root) and stopped at exit. ``scripts/test.sh``
installs it; a missing binary fails the tests that need it, loudly.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from ports import free_port

_RUNNING: list[Bouncer] = []


class Bouncer:
    """One PgBouncer process (``pool_mode = transaction``)."""

    def __init__(self, upstream: str) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(binary).exists():
            raise RuntimeError("pgbouncer is not installed (scripts/test.sh installs it with apt-get)")
        up = urlsplit(upstream)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ad-pgbouncer-"))
        user = up.username or "postgres"
        (self.dir / "userlist.txt").write_text(f'"{user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={up.hostname or '127.0.0.1'} port={up.port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"auth_type = trust\nauth_file = {self.dir / 'userlist.txt'}\n"
            "pool_mode = transaction\nmax_client_conn = 1000\ndefault_pool_size = 20\n"
            # Idle server connections are handed out in turn, not the last
            # used first: consecutive transactions of one client land on
            # different servers, as under production load.
            "server_round_robin = 1\n"
            "ignore_startup_parameters = extra_float_digits\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        cmd = [binary, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            shutil.chown(self.dir, user="postgres")
            for f in self.dir.iterdir():
                shutil.chown(f, user="postgres")
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("pgbouncer did not start listening") from None
                time.sleep(0.1)

    def uri(self, database: str, user: str = "postgres") -> str:
        """A URI of ``database`` through this bouncer."""
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def bouncer(upstream: str) -> Bouncer:
    """The session's PgBouncer (started on first use)."""
    if not _RUNNING or _RUNNING[0].proc.poll() is not None:
        _RUNNING[:] = [Bouncer(upstream)]
        atexit.register(_RUNNING[0].stop)
    return _RUNNING[0]
