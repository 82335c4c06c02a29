"""Lazily built settings, backends and dispatcher shared by subcommands."""

from __future__ import annotations

from functools import cached_property

from ..dispatch import Dispatcher
from ..factory import open_backends
from ..handlers import Registry, discover
from ..settings import Settings, load_settings
from ..stores.base import Store
from ..transports.base import Transport


class App:
    """What a CLI command needs, built on first use."""

    def __init__(self) -> None:
        self.app_spec: str | None = None

    @cached_property
    def settings(self) -> Settings:
        return load_settings()

    @cached_property
    def backends(self) -> tuple[Store, Transport]:
        return open_backends(self.settings)

    @property
    def store(self) -> Store:
        return self.backends[0]

    @property
    def transport(self) -> Transport:
        return self.backends[1]

    @cached_property
    def registry(self) -> Registry:
        return discover(self.app_spec or self.settings.app)

    def dispatcher(self, *, check_kinds: bool = False) -> Dispatcher:
        kinds = self.registry.kinds() if check_kinds else None
        return Dispatcher(self.store, self.transport, self.settings, known_kinds=kinds)
