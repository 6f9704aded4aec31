"""Durable job state behind one interface (``base.Store``, with its ``Capabilities``): in memory (``memory``, the
embedded default) or in etcd (``etcd``, with ``election``: several lighthouses, one elected leader).
``factory.open_store(url)`` picks one."""
