"""Lazily built settings, backends and dispatcher shared by subcommands."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Imported where first used: ``--help`` and commands that never build a
    # dispatcher or a registry start without them.
    from ..dispatch import Dispatcher
    from ..handlers import Registry
    from ..settings import Settings
    from ..stores.base import Outbox, Store
    from ..transports.base import Transport


class App:
    """What a CLI command needs, built on first use."""

    def __init__(self) -> None:
        self.app_spec: str | None = None

    @cached_property
    def settings(self) -> Settings:
        from ..settings import load_settings

        return load_settings()

    @property
    def backends(self) -> tuple[Store, Transport]:
        return self.store, self.transport

    @cached_property
    def store(self) -> Store:
        from ..factory import open_store

        return open_store(self.settings)

    @cached_property
    def transport(self) -> Transport:
        # Opened apart from the store, when first used: reading, cancelling
        # and replaying jobs need only the store, and must work while a
        # Kafka broker is down.
        from ..factory import open_transport

        return open_transport(self.settings, self.store)

    @cached_property
    def registry(self) -> Registry:
        from ..handlers import discover

        return discover(self.app_spec or self.settings.app)

    def dispatcher(self, *, check_kinds: bool = False) -> Dispatcher:
        from ..dispatch import Dispatcher

        kinds = self.registry.kinds() if check_kinds else None
        return Dispatcher(self.store, _LazySender(self), self.settings, known_kinds=kinds)


class _LazySender:
    """The dispatcher's transport, opened on its first use (a submission's
    admission, a replay's publish; a replay that cannot publish leaves the
    turn to the reconciler)."""

    def __init__(self, app: App) -> None:
        self._app = app

    @property
    def redeliver_after_s(self) -> float:
        return self._app.transport.redeliver_after_s

    @redeliver_after_s.setter
    def redeliver_after_s(self, value: float) -> None:
        self._app.transport.redeliver_after_s = value

    def admit(self, n: int, max_depth: int) -> None:
        self._app.transport.admit(n, max_depth)

    def relay(self, store: Outbox) -> int:
        return self._app.transport.relay(store)

    def depth(self) -> int:
        return self._app.transport.depth()
