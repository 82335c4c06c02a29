"""A loopback TCP proxy that delays every forwarded chunk by a fixed time, both ways.

Models a network (or replication) round trip in front of a local broker: a request
reaches the target ``delay`` after the client sent it and the answer comes back
``delay`` after the target sent it, so one round trip costs at least ``2 * delay``.
Delays overlap (a chunk is held until its own due time, never behind the previous
chunk's sleep), so it adds latency, not a bandwidth limit; order is kept per
direction.

Runs as its own process so that the benchmark's threads do not share its GIL:

    python benchmarks/latency_proxy.py --listen 19093 --target 127.0.0.1:19092 --delay-ms 2

Prints ``ready`` once it accepts connections; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk written ``delay_s`` after it was read."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((loop.time() + delay_s, data))
    except (ConnectionError, OSError):
        pass
    queue.put_nowait((0.0, b""))
    try:
        await sender
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(listen_port: int, target_host: str, target_port: int, delay_s: float) -> None:
    """Forward connections to ``listen_port`` (loopback) until cancelled."""

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            c_writer.close()
            return
        for w in (c_writer, t_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(_pipe(c_reader, t_writer, delay_s), _pipe(t_reader, c_writer, delay_s))
        except asyncio.CancelledError:  # shutting down: drop the connection quietly
            c_writer.close()
            t_writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, reuse_address=True)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    loop.add_signal_handler(signal.SIGINT, stop.set_result, None)
    print("ready", flush=True)
    async with server:
        await stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", type=int, required=True, help="loopback port to accept on")
    ap.add_argument("--target", required=True, help="host:port to forward to")
    ap.add_argument("--delay-ms", type=float, required=True, help="delay of every chunk, each direction")
    args = ap.parse_args()
    host, _, port = args.target.rpartition(":")
    asyncio.run(serve(args.listen, host, int(port), args.delay_ms / 1000))
    sys.exit(0)


if __name__ == "__main__":
    main()
