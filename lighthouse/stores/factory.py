"""Open the store a lighthouse is configured with, from its URL."""

from __future__ import annotations

from lighthouse.stores.base import Store
from lighthouse.stores.memory import InMemoryStore


def open_store(url: str) -> Store:
    """``memory://`` (the embedded default) or ``etcd://host:port[,host:port...][/prefix]``."""
    if url in ("", "memory", "memory://"):
        return InMemoryStore()
    if url.startswith("etcd://"):
        from lighthouse.stores.etcd import EtcdStore  # imported here: the embedded default needs no etcd client

        return EtcdStore(url)
    raise ValueError(f"unsupported store {url!r}: want memory:// or etcd://host:port[,host:port...][/prefix]")
