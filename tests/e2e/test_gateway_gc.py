"""While the gateway serves, the cyclic collector leaves what startup built
alone: a full collection walked the whole startup heap (~100k objects) with
the GIL held, 30-50 ms during which no webhook was answered (the tail of
intake's time-to-200). The app runs its real lifespan over a SQLite store."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

from agentdispatch.gateway import Services, create_app
from backends import sqlite_harness


def test_startup_heap_is_frozen_while_serving_and_released_after(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path)
    try:
        app = create_app(Services.of(h.settings, h.store, h.transport))
        seen: dict[str, object] = {}

        async def serve() -> None:
            async with app.router.lifespan_context(app):
                tracked = gc.get_objects()
                seen["frozen"] = gc.get_freeze_count()
                seen["tracked"] = len(tracked)
                # Built before the app served: not walked by a collection now.
                seen["router_tracked"] = any(o is app.router for o in tracked)
                del tracked

        asyncio.run(serve())
        assert seen["router_tracked"] is False
        assert isinstance(seen["frozen"], int) and isinstance(seen["tracked"], int)
        assert seen["frozen"] > 10 * seen["tracked"], seen
        # Stopped: everything is the collector's again (an embedding process keeps its GC).
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        h.close()
