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
    from ..stores.base import Store
    from ..transports.base import Transport


class App:
    """What a CLI command needs, built on first use."""

    def __init__(self) -> None:
        self.app_spec: str | None = None

    @cached_property
    def settings(self) -> Settings:
        from ..settings import load_settings

        return load_settings()

    @cached_property
    def backends(self) -> tuple[Store, Transport]:
        from ..factory import open_backends

        return open_backends(self.settings)

    @property
    def store(self) -> Store:
        return self.backends[0]

    @property
    def transport(self) -> Transport:
        return self.backends[1]

    @cached_property
    def registry(self) -> Registry:
        from ..handlers import discover

        return discover(self.app_spec or self.settings.app)

    def dispatcher(self, *, check_kinds: bool = False) -> Dispatcher:
        from ..dispatch import Dispatcher

        kinds = self.registry.kinds() if check_kinds else None
        return Dispatcher(self.store, self.transport, self.settings, known_kinds=kinds)
