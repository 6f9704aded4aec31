"""Open the store a lighthouse is configured with, from its URL."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lighthouse.stores.base import Store
from lighthouse.stores.memory import InMemoryStore

if TYPE_CHECKING:
    from lighthouse.stores.etcd_tls import EtcdTLS


def open_store(url: str, etcd_tls: EtcdTLS | None = None) -> Store:
    """``memory://`` (the embedded default) or ``etcd://host:port[,host:port...][/prefix]``, over TLS with
    ``etcd_tls`` (which a ``memory://`` store refuses: a TLS option with no etcd is a mistake)."""
    if url in ("", "memory", "memory://"):
        if etcd_tls is not None:
            raise ValueError(f"etcd TLS options given for the store {url or 'memory://'!r}, which is not etcd")
        return InMemoryStore()
    if url.startswith("etcd://"):
        from lighthouse.stores.etcd import EtcdStore  # imported here: the embedded default needs no etcd client

        return EtcdStore(url, tls=etcd_tls)
    raise ValueError(f"unsupported store {url!r}: want memory:// or etcd://host:port[,host:port...][/prefix]")
