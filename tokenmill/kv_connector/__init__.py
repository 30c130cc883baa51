"""The external KV tier: stores (CPU memory, disk, Redis) behind the prefix cache.

`config` and `connector` (the scheduler half) and `stores` import no torch;
`worker` (the worker half) does. `setup` wires both into an EngineCore.
"""
from tokenmill.kv_connector.config import KVConnectorConfig, KVGeometry

__all__ = ["KVConnectorConfig", "KVGeometry"]
