"""The external KV tier: stores (CPU memory, disk, Redis) behind the prefix cache.

`config`, `connector` (the scheduler half: which blocks exist, which to load
and store), `stores` and `calls` (store calls bounded in time) import no torch;
`worker` (the worker half: reads, verifies and copies loads, writes stores) does.
`setup` wires both into an EngineCore.
"""
from tokenmill.kv_connector.config import KVConnectorConfig, KVGeometry

__all__ = ["KVConnectorConfig", "KVGeometry"]
