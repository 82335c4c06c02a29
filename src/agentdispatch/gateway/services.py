"""What the gateway's routers share: one object, built once per process."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..dispatch import Dispatcher
from ..factory import open_backends
from ..metrics import Metrics
from ..settings import Settings
from ..stores.base import Store
from ..transports.base import Transport


@dataclass
class Services:
    """The gateway's dependencies, passed to every router factory.

    * ``settings``: the validated :class:`Settings` of this process.
    * ``store`` / ``transport``: the backends (thread-safe; call them from
      sync route functions, which FastAPI runs in its thread pool).
    * ``dispatcher``: submit / status / cancel / replay over the two.
    * ``metrics``: this process's Prometheus registry (refreshed at scrape).
    * ``auth``: when True (the default) every data route needs a bearer token
      bound to one tenant; False is only allowed on a loopback address.
    """

    settings: Settings
    store: Store
    transport: Transport
    dispatcher: Dispatcher
    metrics: Metrics = field(default_factory=Metrics)
    auth: bool = True

    @classmethod
    def open(cls, settings: Settings, *, auth: bool = True) -> Services:
        """Open the configured store and transport (fails loudly when unreachable)."""
        store, transport = open_backends(settings)
        return cls.of(settings, store, transport, auth=auth)

    @classmethod
    def of(cls, settings: Settings, store: Store, transport: Transport, *, auth: bool = True) -> Services:
        """Wrap backends that are already open (tests, embedding)."""
        return cls(
            settings=settings,
            store=store,
            transport=transport,
            dispatcher=Dispatcher(store, transport, settings),
            auth=auth,
        )

    def close(self) -> None:
        """Release the backends."""
        self.transport.close()
        self.store.close()
