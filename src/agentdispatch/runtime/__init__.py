"""The agent runtime: many turns in flight per worker process, as asyncio
tasks on one loop (``async def`` handlers) or in a bounded thread pool (sync
ones), with batched lease renewals, claims and commits."""

from .options import RuntimeOptions
from .worker import AsyncWorker

__all__ = ["AsyncWorker", "RuntimeOptions"]
