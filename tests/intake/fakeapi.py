"""A provider API on loopback for the intake tests: one real HTTP server whose
answers each test decides (scripted errors, held calls, plain 200s)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: An answer: status, extra headers, body.
Answer = tuple[int, dict[str, str], bytes]
OK: Answer = (200, {}, b'{"ok": true}')


@contextmanager
def serve(answer: Callable[[str, dict[str, str], bytes], Answer]) -> Iterator[str]:
    """Serve POSTs on loopback, each answered by ``answer(path, headers,
    body)`` (header names lower-cased) on its own thread; yields the base URL."""

    class H(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            status, headers, out = answer(self.path, {k.lower(): v for k, v in self.headers.items()}, raw)
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def body_of(raw: bytes) -> Any:
    """A request body as JSON, else as text (form posts)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode()
